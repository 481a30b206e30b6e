"""`dflash-doctor dashboard` stopped by a signal stops the Streamlit server it started.

A service manager or a CI step sends SIGTERM to the command's own pid; before the fix the command died
and its `python -m streamlit run` child kept serving (and holding the port). The real console script
is started here, as a user or a service manager would start it, and signalled the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_doctor.cli.dashboard import port_is_free
from fixture_runs import make_fixture_run
from local_servers import free_port, wait_until_answering

SERVER_START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30
CONSOLE_SCRIPT = Path(sys.executable).with_name("dflash-doctor")


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return status.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process trees from Linux /proc")
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_to_the_command_stops_its_streamlit_server(tmp_path, stop_signal):
    make_fixture_run(tmp_path / "runs" / "a", seed=0, num_requests=3)
    port = free_port()
    log = tmp_path / "dashboard.log"
    command = subprocess.Popen(
        [str(CONSOLE_SCRIPT), "dashboard", str(tmp_path / "runs"), "--port", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    server_pids: list[int] = []
    try:
        not_started = wait_until_answering(f"http://127.0.0.1:{port}/_stcore/health", command, SERVER_START_TIMEOUT_S)
        assert not_started is None, f"dashboard did not start: {not_started}: {log.read_text()}"
        server_pids = children(command.pid)
        assert server_pids, "the command serves through a child process"

        command.send_signal(stop_signal)  # to the command's pid only, as systemd or a CI runner does
        returncode = command.wait(timeout=STOP_TIMEOUT_S)

        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(alive(pid) for pid in server_pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in server_pids), f"Streamlit server {server_pids} outlived the command"
        assert port_is_free("127.0.0.1", port)
        assert returncode == 0, f"a requested stop is not a failure: {log.read_text()}"
    finally:
        for pid in [command.pid, *server_pids]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
