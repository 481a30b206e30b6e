"""The exit contract: 70 means a bug and nothing else. A NaN start timeout, an --out that cannot be
written, a full disk and a closed stdout are the user's input or environment: exit 2 with one sentence (a full
disk leaves the earlier reports whole), or, for a reader that went away (``| head -1``), a quiet 0."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli_helpers import assert_usage_error, invoke
from fixture_runs import make_fixture_run
from recording_server import recording_server
from dflash_doctor.tune import experiment as tune_experiment
from dflash_doctor.cli.root import _CommandsOnDemand
from dflash_doctor.processes import EXIT_CRASH


# ------------------------------------------------------------------------------------- D2-D3: tune --start-timeout


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0"])
def test_tune_start_timeout_is_finite_and_positive_before_any_server_starts(tmp_path, monkeypatch, value):
    def launched(*args, **kwargs):
        raise AssertionError("tune went on to launch a server")

    monkeypatch.setattr(tune_experiment, "run_tune", launched)
    result = invoke(
        "tune",
        "--engine",
        "http://127.0.0.1:9",
        "--k",
        "0,2",
        f"--start-timeout={value}",
        "--launch-baseline",
        "sleep 1000",
        "--launch",
        "sleep 1000 {k}",
        "--out",
        tmp_path / "t",
    )
    assert_usage_error(result, f"--start-timeout {float(value)}", "seconds")
    assert not (tmp_path / "t").exists()


# ----------------------------------------------------------------------------------- I1, I2: --out that cannot be


def _dangling(tmp_path: Path) -> str:
    (tmp_path / "dang").symlink_to(tmp_path / "nonexistent" / "deep" / "x")
    return "dang"


def _under_a_file(tmp_path: Path) -> str:
    (tmp_path / "plain").write_text("a file\n")
    return "plain/run"


def _runs_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "runs").write_text("a file\n")  # where a command given no --out makes its folder


OUT_ROWS = [  # (break, makes the --out value in the working directory (None: give no --out), sentence fragments)
    ("I1 dangling symlink", _dangling, ["--out dang is a link to", "does not exist"]),
    ("I2 under /proc", lambda _: "/proc/dd-out", ["--out /proc/dd-out cannot be written", "No such file or directory"]),
    ("I2 under a file", _under_a_file, ["--out plain/run cannot be written", "Not a directory"]),
    ("I2 runs/ is a file", _runs_is_a_file, ["no run directory can be made in runs"]),
]


@pytest.mark.parametrize(("name", "make", "fragments"), OUT_ROWS, ids=[row[0] for row in OUT_ROWS])
def test_an_out_that_cannot_be_written_is_bad_input(tmp_path, monkeypatch, name, make, fragments):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DFLASH_DOCTOR_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "user-config"))  # no config file of the developer's
    out = make(tmp_path)
    with recording_server() as (url, received):
        result = invoke("check", "--engine", url, "--max-requests", "2", *(["--out", out] if out else []))
    assert_usage_error(result, *fragments)
    assert received == []


# ------------------------------------------------------------------------------------ I3: a full disk while writing


def _full_disk(number: int):
    """Path.write_text on a disk that fills up halfway through the text (what ENOSPC leaves behind)."""

    def write_text(self: Path, data: str, encoding=None, errors=None, newline=None) -> int:
        with open(self, "w", encoding=encoding) as handle:
            handle.write(data[: len(data) // 2])
        raise OSError(number, os.strerror(number), str(self))

    return write_text


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_a_full_disk_is_the_environment_not_a_crash_and_leaves_the_reports_whole(tmp_path, monkeypatch, number):
    run = make_fixture_run(tmp_path / "run", num_requests=6)
    assert invoke("report", run, "--format", "html,md,json", "--plotly", "cdn").exit_code == 0
    before = {path.name: path.read_bytes() for path in run.iterdir() if path.name.startswith("report.")}
    monkeypatch.setattr(Path, "write_text", _full_disk(number))
    result = invoke("report", run, "--format", "html,md,json", "--plotly", "cdn")
    assert result.exit_code == 2, result.output
    assert_usage_error(result, os.strerror(number), "free space")
    assert {path.name: path.read_bytes() for path in run.iterdir() if path.name.startswith("report.")} == before
    assert not list(run.glob("*.tmp"))


def test_another_os_error_is_still_a_crash(tmp_path, monkeypatch):
    run = make_fixture_run(tmp_path / "run", num_requests=6)
    monkeypatch.setattr(Path, "write_text", _full_disk(errno.EIO))
    result = invoke("report", run, "--format", "md")
    assert result.exit_code == EXIT_CRASH and "please report it" in result.output


# -------------------------------------------------------------------------------------- I4: a closed stdout


def _compare_args(tmp_path: Path) -> list[str]:
    return [
        "compare",
        str(make_fixture_run(tmp_path / "a", num_requests=6)),
        str(make_fixture_run(tmp_path / "b", num_requests=6)),
        "--json",
        "--out",
        str(tmp_path / "cmp"),
        "--plotly",
        "cdn",
    ]


PIPE_ROWS = [  # (how the command writes stdout, its arguments)
    ("rich console, workloads show", lambda _: ["workloads", "show", "demo"]),
    ("rich table, workloads", lambda _: ["workloads"]),
    ("sys.stdout.write, compare --json", _compare_args),
]


@pytest.mark.parametrize(("name", "args"), PIPE_ROWS, ids=[row[0] for row in PIPE_ROWS])
def test_a_closed_stdout_ends_quietly_with_0(tmp_path, name, args):
    """The reader is gone before the first byte (``| head -0``): the worst case of ``| head -1``."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dflash_doctor", *args(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=300) == 0, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


def test_a_broken_pipe_that_is_not_stdout_stays_a_crash():
    """A server's socket closing mid-request raises the same BrokenPipeError: that one must not pass as done."""
    probe = typer.Typer(cls=_CommandsOnDemand)

    @probe.command("boom")
    def boom() -> None:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    @probe.command("other")
    def other() -> None:
        pass

    result = CliRunner().invoke(probe, ["boom"])
    assert result.exit_code == EXIT_CRASH, result.output
