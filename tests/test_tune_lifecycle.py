"""How `tune` ends: every process of the server tree it launched is gone afterwards, whatever ended it (a
signal while the server starts or while it is measured, an error), and a port already served is refused.

These run the real command in a subprocess against a launched "engine" that is a process tree
(tests/fake_tree_engine.py: the engine and a worker it started), signal it as a CI cancellation, `timeout`,
systemd or Kubernetes would, and look the tree's pids up afterwards.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.processes import STOP_GRACE_S
from local_servers import QuietHandler, ThreadedServer, free_port
from tune_fixtures import write_sweep_run, write_workload

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (a zombie waiting for init to reap it has ended too)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, (
            f"tune ended early with {process.returncode}: {process.stderr.read() if process.stderr else ''}"
        )
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def _start_tune(tmp_path: Path, mode: str, port: int, after: str = "") -> tuple[subprocess.Popen, Path]:
    """tune launching fake_tree_engine.py; ``after``: more of the shell command line after it (a compound
    command: bash then forks the engine instead of becoming it)."""
    pids = tmp_path / "pids"
    command = (
        f"{sys.executable} {TESTS / 'fake_tree_engine.py'} --port {port} --pids {pids} --mode {mode} --k {{k}}{after}"
    )
    tune = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash_doctor",
            "tune",
            "--launch",
            command,
            "--engine",
            f"http://127.0.0.1:{port}",
            "--k",
            "2",
            "--workload",
            str(write_workload(tmp_path)),
            "--max-new-tokens",
            "8",
            "--start-timeout",
            "60",
            "--sweep",
            str(write_sweep_run(tmp_path, [2])),
            "--out",
            str(tmp_path / "run"),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return tune, pids


def _assert_tree_gone(pids: Path, port: int) -> None:
    tree = [int(pid) for pid in pids.read_text().split()]
    deadline = time.monotonic() + 10  # init reaps the orphaned worker
    while not all(_gone(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: _command_line(pid) for pid in tree if not _gone(pid)}
    for pid in left:  # leave nothing behind for the next test, then fail
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the launched server left running: {left}"
    # the tree is gone, so its listening socket is closed; poll a moment (a busy machine reaps late) before calling
    # an answer a leftover server's
    while time.monotonic() < deadline + 5 and _answers(port):
        time.sleep(0.1)
    assert not _answers(port), "the launched server's port still answers"


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


# (phase the signal arrives in, the engine's mode, the signal)
SIGNAL_CASES = [
    (phase, mode, signum)
    for phase, mode in (("starting", "silent"), ("measuring", "serve"))
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
]


@pytest.mark.parametrize(
    "phase, mode, signum", SIGNAL_CASES, ids=[f"{p}-{signal.Signals(s).name}" for p, _, s in SIGNAL_CASES]
)
def test_a_signal_to_tune_stops_the_whole_process_tree_it_launched(tmp_path, phase, mode, signum):
    port = free_port()
    tune, pids = _start_tune(tmp_path, mode, port)
    try:
        _wait_for(pids if phase == "starting" else Path(str(pids) + ".request"), tune)
        signalled = time.monotonic()
        tune.send_signal(signum)
        _, stderr = tune.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if tune.poll() is None:
            tune.kill()
    assert tune.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr, stderr
    assert took < STOP_GRACE_S, took  # the server ended on SIGTERM, not on the SIGKILL after the grace period
    _assert_tree_gone(pids, port)


@pytest.mark.parametrize("after", ["", "; echo after"], ids=["simple", "compound"])
def test_tune_killed_outright_leaves_no_process_of_the_server_it_launched(tmp_path, after):
    """kill -9 runs no cleanup in tune: the supervisor leading the server's group stops it (the death signal
    alone reached only the shell of a compound command, which forked the server)."""
    port = free_port()
    tune, pids = _start_tune(tmp_path, "serve", port, after)
    try:
        _wait_for(Path(str(pids) + ".request"), tune)
        tune.kill()
        tune.communicate(timeout=60)
    finally:
        if tune.poll() is None:
            tune.kill()
    assert tune.returncode == -signal.SIGKILL
    _assert_tree_gone(pids, port)


def test_tune_ending_on_an_error_stops_the_process_tree_it_launched(tmp_path):
    port = free_port()
    tune, pids = _start_tune(tmp_path, "refuse", port)
    _, stderr = tune.communicate(timeout=120)
    assert tune.returncode == 2, stderr
    assert "answered HTTP 400" in stderr and "Traceback" not in stderr, stderr
    _assert_tree_gone(pids, port)


def test_a_port_served_before_the_launch_is_refused_in_one_sentence(tmp_path):
    class Answering(QuietHandler):
        def do_GET(self):  # noqa: N802
            self.reply_json({"data": [{"id": "someone-else"}]})

    pids = tmp_path / "pids"
    with ThreadedServer(Answering) as other:
        command = (
            f"{sys.executable} {TESTS / 'fake_tree_engine.py'} --port {other.port} --pids {pids} --mode serve --k {{k}}"
        )
        result = CliRunner().invoke(
            app,
            [
                "tune",
                "--launch",
                command,
                "--engine",
                other.base_url,
                "--k",
                "2",
                "--workload",
                str(write_workload(tmp_path)),
                "--sweep",
                str(write_sweep_run(tmp_path, [2])),
                "--out",
                str(tmp_path / "run"),
            ],
        )
    assert result.exit_code == 2, result.output
    assert f"port {other.port} is already served before tune launched its server" in result.output
    assert "Traceback" not in result.output and not pids.exists()  # nothing was launched


def _tune_args(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    return [
        "tune",
        "--engine",
        "0=http://127.0.0.1:1",
        "--k",
        "0",
        "--workload",
        str(write_workload(tmp_path)),
        "--sweep",
        str(write_sweep_run(tmp_path, [2])) if not (tmp_path / "sweep").exists() else str(tmp_path / "sweep"),
        "--out",
        str(out),
        *extra,
    ]


def _replay_run(folder: Path) -> Path:
    folder.mkdir()
    (folder / "run.json").write_text('{"schema_version": 1, "meta": {"command": "replay"}}')
    (folder / "steps.parquet").write_bytes(b"PAR1")
    return folder


def _earlier_tune(folder: Path) -> Path:
    folder.mkdir()
    (folder / "tune.json").write_text("{}")
    return folder


def _locked_by_a_live_process(folder: Path) -> Path:
    folder.mkdir()
    (folder / ".dflash-doctor.lock").write_text(f"{os.getppid()}\n")  # pytest's parent: alive for the test's length
    return folder


# (what --out holds, extra flags, what the one sentence says)
OUT_CASES = [
    (_replay_run, (), "holds the run directory of another command"),
    (_replay_run, ("--overwrite",), "holds the run directory of another command"),
    (_earlier_tune, (), "already holds files"),
    (_locked_by_a_live_process, (), "is being written by another dflash-doctor process"),
    (_locked_by_a_live_process, ("--overwrite",), "is being written by another dflash-doctor process"),
]


@pytest.mark.parametrize(
    "make, extra, says",
    OUT_CASES,
    ids=["replay-run", "replay-run-overwrite", "earlier-tune", "locked", "locked-overwrite"],
)
def test_tune_owns_its_out_and_refuses_a_folder_it_may_not_write(tmp_path, make, extra, says):
    out = make(tmp_path / "out")
    before = sorted(p.name for p in out.iterdir())
    result = CliRunner().invoke(app, _tune_args(tmp_path, out, *extra))
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written into it, no lock left


def test_a_second_tune_on_the_out_of_a_running_one_is_refused(tmp_path):
    port = free_port()
    first, pids = _start_tune(tmp_path, "silent", port)  # holds tmp_path/"run" while its server "starts"
    try:
        _wait_for(pids, first)
        result = CliRunner().invoke(app, _tune_args(tmp_path, tmp_path / "run"))
        assert result.exit_code == 2, result.output
        assert f"being written by another dflash-doctor process (pid {first.pid})" in result.output
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM
    assert not (tmp_path / "run" / ".dflash-doctor.lock").exists()  # the lock went with the first tune


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_a_command_run_to_its_end_in_a_group_is_stopped_with_the_doctor(tmp_path, signum):
    """processes.run_in_group (the torchrun of --devices): the doctor signalled while it waits leaves no
    process of that group behind."""
    leader = tmp_path / "leader"
    code = (
        "import sys\nfrom dflash_doctor.processes import run_in_group, stop_signals_raise\n"
        "with stop_signals_raise():\n"
        "    run_in_group(['bash', '-c', 'sleep 600 & ps -o pgid= "
        f"$$ > {leader}.tmp; mv {leader}.tmp {leader}; wait'])\n"
    )
    doctor = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(leader, doctor, 30)
        pgid = int(leader.read_text())
        assert len(_group_members(pgid)) == 3  # the supervisor, bash and its sleep
        doctor.send_signal(signum)
        _, stderr = doctor.communicate(timeout=60)
    finally:
        if doctor.poll() is None:
            doctor.kill()
    assert doctor.returncode != 0 and ("Stopped" in stderr or "KeyboardInterrupt" in stderr), stderr
    left = {pid: _command_line(pid) for pid in _group_members(pgid)}
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left
