"""`watch` as a service: a real subprocess whose stdout is a pipe (as under systemd, docker or Kubernetes).

It must print one plain line per series per evaluation while it runs (Rich's Live would print nothing
until exit off a terminal), end on SIGTERM / SIGINT with a complete run directory, and exit 0, or 1
when an alert fired during the run. The server is the small exporter serving captured real vLLM text.
"""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from dflash_doctor.rundir.load import load_run
from dflash_doctor.telemetry.watch_record import read_windows
from telemetry_fixtures import DATA, MetricsExporter

LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00 smollm2-dflash: (\S+)")


def capture(name: str) -> str:
    return (DATA / f"vllm_metrics_{name}.txt").read_text()


def read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))


@pytest.mark.parametrize(
    "stop_signal, baseline, exit_code",
    [
        (signal.SIGTERM, [], 0),
        (signal.SIGINT, ["--baseline", "9.0"], 1),  # production tau ~1.6 against an expected 9: acceptance-drop
    ],
)
def test_piped_watch_prints_lines_as_it_goes_and_stops_cleanly(tmp_path, stop_signal, baseline, exit_code):
    run_dir = tmp_path / "run"
    with MetricsExporter(capture("good_1")) as exporter:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dflash_doctor",
                "watch",
                exporter.url,
                "--interval",
                "0.3",
                "--window",
                "30s",
                "--min-drafts",
                "1",
                *baseline,
                "--out",
                str(run_dir),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=read_lines, args=(process.stdout, lines), daemon=True)
        reader.start()
        seen: list[str] = []
        deadline = time.monotonic() + 120
        while sum(bool(LINE.match(line)) for line in seen) < 3 and time.monotonic() < deadline:
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                continue
            if exporter.scrapes >= 2:
                exporter.text = capture("good")  # more requests arrive: the next windows have drafts
        assert process.poll() is None, "\n".join(seen)  # the lines came while it ran, not at exit
        process.send_signal(stop_signal)
        assert process.wait(timeout=60) == exit_code, "\n".join(seen)
    # The reader ends at the pipe's end of file, after the process's
    # last line (a fixed pause raced it on a busy machine).
    reader.join(timeout=60)
    assert not reader.is_alive(), "watch exited but its stdout never reached end of file"
    while not lines.empty():
        seen.append(lines.get())
    output = "\n".join(seen)
    assert "\x1b[" not in output  # plain text: no terminal control codes in a log
    statuses = [m.group(1) for m in map(LINE.match, seen) if m]
    assert len(statuses) >= 3
    assert ("ALERT acceptance-drop" in output) == bool(exit_code)
    assert seen[-1] == f"wrote {run_dir}"
    windows = read_windows(run_dir)
    assert len(windows) >= len(statuses)
    assert load_run(run_dir).meta["source"]["kind"] == "telemetry"
