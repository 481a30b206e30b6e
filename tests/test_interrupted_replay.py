"""`replay` and `check` stopped by a signal, as real processes: Ctrl-C, SIGTERM and SIGHUP are one path.

Whichever signal stops the command, run.json says ``interrupted``, the finished requests are kept, every
view of the run says it is incomplete, and the exit status is 128 + the signal (130, 143, 129). Before the
fix a SIGINT to a command started in the background of a script (which inherits SIGINT ignored, so Python
installs no handler) went unnoticed: the run went on and was recorded as complete; and SIGTERM exited 130.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_doctor.report import render_reports
from dflash_doctor.rundir.load import load_run, read_run_meta
from dflash_doctor.rundir.writer import read_journal
from tiny_models import write_workload

CONSOLE_SCRIPT = Path(sys.executable).with_name("dflash-doctor")
NUM_REQUESTS = 60  # far more than run before the signal: minutes of replay uninterrupted, seconds to the first request
START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60


def _ignore_sigint() -> None:
    """What a non-interactive shell does to a command it starts with ``&``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _finished_requests(run_dir: Path) -> int:
    try:
        return read_journal(run_dir)["requests"].num_rows
    except (OSError, KeyError, ValueError):  # not created yet, or a batch half written
        return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals to a child process")
@pytest.mark.parametrize(
    "command, stop_signal, background",
    [
        ("replay", signal.SIGINT, False),
        ("replay", signal.SIGINT, True),  # started as `dflash-doctor replay ... &` in a CI script
        ("replay", signal.SIGTERM, False),
        ("replay", signal.SIGHUP, False),
        ("check", signal.SIGTERM, False),
    ],
)
def test_a_signal_during_the_replay_is_recorded_as_an_interruption_and_exits_128_plus_it(
    tiny_dir, tmp_path, command, stop_signal, background
):
    workload = write_workload(tmp_path / "workload.jsonl", per_class=NUM_REQUESTS // 3)
    out = tmp_path / "run"
    log = tmp_path / "command.log"
    extra = ["--only", "acceptance"] if command == "check" else []
    argv = [
        str(CONSOLE_SCRIPT),
        command,
        "--target",
        str(tiny_dir / "target"),
        "--draft",
        str(tiny_dir / "dflash"),
        "--workload",
        str(workload),
        "--max-new-tokens",
        "200",
        "--out",
        str(out),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as output:
        process = subprocess.Popen(
            argv, stdout=output, stderr=subprocess.STDOUT, env=env, preexec_fn=_ignore_sigint if background else None
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while _finished_requests(out) < 1 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process.poll() is None and _finished_requests(out) >= 1, f"no request finished: {log.read_text()}"
        process.send_signal(stop_signal)
        returncode = process.wait(timeout=STOP_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    said = log.read_text()
    assert returncode == 128 + stop_signal, said
    assert "interrupted" in said and "Traceback" not in said

    assert read_run_meta(out)["interrupted"] is True
    run = load_run(out)
    assert 1 <= len(run.requests) < NUM_REQUESTS and not run.complete
    assert run.record.summary.overall is not None  # the summary of what finished
    (report,) = render_reports(out, formats="md", out_dir=tmp_path / "reports")
    assert "Interrupted run" in report.read_text()


def test_an_interrupt_after_the_replay_still_marks_the_run_interrupted(tiny_dir, tmp_path, monkeypatch):
    """SIGTERM while `check` prices the sweep (the replay itself done): the open run directory records the
    interruption as well, and the exit status is still 143."""
    from dflash_doctor import pipeline
    from dflash_doctor.processes import Stopped
    from cli_helpers import invoke, pair_args

    def stopped_while_pricing(*args, **kwargs):
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr(pipeline, "_sweep", stopped_while_pricing)
    result = invoke(
        "check", *pair_args(tiny_dir, tiny_dir / "dflash", "--only", "acceptance", "--out", tmp_path / "run")
    )
    assert result.exit_code == 143, result.output
    assert read_run_meta(tmp_path / "run")["interrupted"] is True and not load_run(tmp_path / "run").complete
