"""Page load time of the dashboard on a large run (about 100k drafted-token rows).

Writes a synthetic run with tests/fixture_runs.py, then runs every page through Streamlit's AppTest
(the real page scripts, in process, no browser): "cold" is the first visit in a fresh cache (Parquet
read + aggregation), "warm" a second visit (what a user feels when switching pages), and "widget"
a rerun after changing the page's main widget. Prints seconds per page; not a test, nothing asserts.

    python benchmarks/dashboard_load.py [--num-tokens 100000] [--num-requests 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import streamlit as st  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

from dflash_doctor.app import RUNS_DIR_ENV  # noqa: E402
from dflash_doctor.rundir.load import load_run  # noqa: E402
from fixture_runs import make_fixture_run  # noqa: E402

MAIN = REPO / "app" / "main.py"
PAGES = ("overview", "rejection", "positions", "tokens", "sweep", "compare")


def timed_run(at: AppTest, page: str | None = None) -> float:
    """Seconds for one script run (switching to ``page`` first); fails loudly if the page raised."""
    if page is not None:
        at.switch_page(f"views/{page}.py")
    start = time.perf_counter()
    at.run()
    elapsed = time.perf_counter() - start
    if at.exception:
        raise SystemExit(f"{page} raised: {at.exception[0].value}")
    return elapsed


def change_main_widget(at: AppTest, page: str, run: Path, other: Path) -> bool:
    """Touch the widget a user would touch first on ``page``; False when the page has none."""
    if page == "rejection":
        at.multiselect(key="filter_class").set_value(["math"])
    elif page == "positions":
        at.segmented_control(key="positions_metric").set_value("conditional")
    elif page == "tokens":
        requests = load_run(run, tables=("requests",)).requests
        at.selectbox(key="token_request").set_value(requests["request_id"].iloc[-1])
    elif page == "compare":
        at.selectbox(key="compare_base").set_value(str(other))
    else:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tokens", type=int, default=100_000, help="drafted-token rows in tokens.parquet (about)")
    parser.add_argument("--num-requests", type=int, default=200)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="dashboard-bench-") as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        run = make_fixture_run(root / "big", seed=0, num_requests=args.num_requests, num_tokens_target=args.num_tokens)
        other = make_fixture_run(
            root / "big-degraded",
            seed=1,
            num_requests=args.num_requests,
            num_tokens_target=args.num_tokens,
            degrade=0.2,
        )
        tables = load_run(run)
        print(
            f"run: {len(tables.tokens):,} token rows, {len(tables.steps):,} steps, {len(tables.requests):,} requests "
            f"(written in {time.perf_counter() - start:.1f} s)"
        )
        os.environ[RUNS_DIR_ENV] = str(root)

        print(f"{'page':<12}{'cold s':>10}{'warm s':>10}{'widget s':>10}")
        for page in PAGES:
            at = AppTest.from_file(str(MAIN), default_timeout=300)
            at.session_state["run_path"] = str(run)
            at.run()  # registers the pages (switch_page needs one run first)
            st.cache_data.clear()  # the caches are process-wide: start each page cold
            st.cache_resource.clear()
            cold = timed_run(at, None if page == "overview" else page)
            warm = timed_run(at)
            widget = timed_run(at) if change_main_widget(at, page, run, other) else float("nan")
            print(f"{page:<12}{cold:>10.2f}{warm:>10.2f}{widget:>10.2f}")


if __name__ == "__main__":
    main()
