"""The Streamlit dashboard driven through Streamlit's AppTest (no browser, no server): one page of the app
opened on a runs folder, with a run selected."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

from dflash_doctor.app import RUNS_DIR_ENV

MAIN = Path(__file__).resolve().parents[1] / "app" / "main.py"
APP_TIMEOUT_S = 60


def open_app(monkeypatch, runs_dir: Path, run: Path | None = None, page: str | None = None) -> AppTest:
    """Run the app on ``runs_dir`` with ``run`` open, on ``page`` (default Overview)."""
    monkeypatch.setenv(RUNS_DIR_ENV, str(runs_dir))
    at = AppTest.from_file(str(MAIN), default_timeout=APP_TIMEOUT_S)
    if run is not None:
        at.session_state["run_path"] = str(run)
    at.run()
    if page is not None:
        at.switch_page(f"views/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at
