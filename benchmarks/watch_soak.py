"""A day of `watch` on a simulated clock: what grows with the watch's age, measured at its start and end.

A synthetic vLLM-shaped counter source (two models, K = 15, 100 drafts per model per poll) is polled
every 30 simulated seconds through the real WatchSession (judge, alarms, run directory), for
``--hours`` (default 24: 2880 polls) with ``--retain`` (default 1h; 0 keeps everything). After
``--start-hours`` (default 3: past the first retention periods and the filling of the summary's bounded
sample) and at the end it prints the Python heap in use (tracemalloc, after a full collection), the run directory's
bytes and the seconds one poll takes, and the end/start ratios. Flat state means ratios near 1. Not a test, nothing
asserts (tests/test_telemetry_bounded.py holds the same day to stated ratios).

    python benchmarks/watch_soak.py [--hours 24] [--interval-s 30] [--retain 1h] [--start-hours 3]
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from dflash_doctor.telemetry.session import WatchSession  # noqa: E402
from dflash_doctor.telemetry.settings import WatchSettings  # noqa: E402
from dflash_doctor.telemetry.sources import parse_duration_s  # noqa: E402
from telemetry_fixtures import SyntheticCounters, directory_bytes  # noqa: E402

K = 15
RATES = tuple(0.8 ** (i + 1) for i in range(K))  # survival per position: tau = 1 + sum = 4.45
MODELS = ("qwen3-8b", "llama-3.1-8b")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--interval-s", type=float, default=30.0)
    parser.add_argument("--retain", default="1h")
    parser.add_argument("--start-hours", type=float, default=3.0)
    args = parser.parse_args()
    polls = int(args.hours * 3600 / args.interval_s)
    start = int(args.start_hours * 3600 / args.interval_s)
    retain_s = parse_duration_s(args.retain) or None
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "watch"
        settings = WatchSettings(window_s=300.0, interval_s=args.interval_s, retain_s=retain_s)
        session = WatchSession([SyntheticCounters(RATES, MODELS)], settings, run_dir=run_dir, config={})
        tracemalloc.start()
        clock = 1_800_000_000.0
        session.start(clock)
        marks: dict[str, tuple[float, int, float]] = {}
        for i in range(1, polls + 1):
            clock += args.interval_s
            started = time.perf_counter()
            session.step(clock)
            seconds = time.perf_counter() - started
            if i in (start, polls):
                gc.collect()  # the heap in use, not cyclic garbage the collector has not reached yet
                marks[f"after {i * args.interval_s / 3600:g} h"] = (
                    tracemalloc.get_traced_memory()[0] / 2**20,
                    directory_bytes(run_dir),
                    seconds,
                )
        session.close(clock)
        print(
            f"{polls} polls every {args.interval_s:g} s (simulated), {len(MODELS)} models, K={K}, retain {args.retain}"
        )
        print(f"{'':>14} {'heap MiB':>9} {'run dir KiB':>12} {'s per poll':>11}")
        for name, (heap, disk, seconds) in marks.items():
            print(f"{name:>14} {heap:9.2f} {disk / 1024:12.1f} {seconds:11.4f}")
        (h0, d0, s0), (h1, d1, s1) = marks.values()
        print(f"{'end / start':>14} {h1 / h0:9.2f} {d1 / d0:12.2f} {s1 / s0:11.2f}")


if __name__ == "__main__":
    sys.exit(main())
