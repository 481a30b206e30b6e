"""Log stamps are local wall-clock time: read in the log's zone (the host's, or --log-timezone), never as UTC.

vLLM and SGLang stamp lines through Python logging's ``asctime``, the server's local time without a
zone. The host zone is switched with the ``TZ`` variable and ``time.tzset()`` (as a service manager's
``Environment=TZ=...`` would set it); the real vLLM line below comes from tests/data/telemetry.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from zoneinfo import ZoneInfo

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.telemetry.logs import LogContext, parse_log_lines
from dflash_doctor.telemetry.observation import ParseProblems
from dflash_doctor.telemetry.watch_record import read_windows
from dflash_doctor.telemetry.sources import LogFile
from dflash_doctor.telemetry.watcher import Watcher
from telemetry_fixtures import DATA

VLLM_LINE = next(
    line for line in (DATA / "vllm_server_good.log").read_text().splitlines() if "SpecDecoding metrics:" in line
)
VLLM_STAMP = "11-30 15:51:53"
SGLANG_LINE = (
    "[2026-11-30 15:51:53] Decode batch, #running-req: 4, #cached-token: 0, #token: 900, token usage: 0.01, "
    "accept len: 2.10, accept rate: 0.40, cuda graph: True, gen throughput (token/s): 50.00, #queue-req: 0"
)


@pytest.fixture
def host_zone(monkeypatch):
    """Set this process's local zone for one test (restored afterwards)."""

    def switch(name: str) -> None:
        monkeypatch.setenv("TZ", name)
        time.tzset()

    yield switch
    monkeypatch.undo()
    time.tzset()


def parsed_time(line: str, engine: str, zone: dt.tzinfo | None) -> float:
    ctx = LogContext(model="m", origin="test.log", year=2026, problems=ParseProblems(), zone=zone)
    (observation,) = parse_log_lines([line], server_kind=engine, ctx=ctx)
    assert observation.time_s is not None
    return observation.time_s


def utc(*fields: int) -> float:
    return dt.datetime(*fields, tzinfo=dt.timezone.utc).timestamp()


@pytest.mark.parametrize("line, engine", [(VLLM_LINE, "vllm"), (SGLANG_LINE, "sglang")])
def test_stamps_are_read_in_the_zone_given(line, engine):
    assert VLLM_STAMP in VLLM_LINE
    assert parsed_time(line, engine, ZoneInfo("Asia/Kolkata")) == utc(2026, 11, 30, 10, 21, 53)  # UTC+5:30
    assert parsed_time(line, engine, ZoneInfo("UTC")) == utc(2026, 11, 30, 15, 51, 53)


@pytest.mark.parametrize("line, engine", [(VLLM_LINE, "vllm"), (SGLANG_LINE, "sglang")])
def test_stamps_default_to_the_hosts_local_zone(host_zone, line, engine):
    host_zone("America/New_York")  # EST in November, UTC-5
    assert parsed_time(line, engine, None) == utc(2026, 11, 30, 20, 51, 53)


def test_live_watch_of_a_log_on_a_host_east_of_utc(host_zone, tmp_path):
    """The line vLLM writes now, in local time, lands in the current window (read as UTC it would sit
    5.5 hours in the future and every window would be empty)."""
    host_zone("Asia/Kolkata")
    now = time.time()
    log = tmp_path / "vllm.log"
    log.write_text(VLLM_LINE.replace(VLLM_STAMP, time.strftime("%m-%d %H:%M:%S", time.localtime(now - 5))) + "\n")
    watcher = Watcher([LogFile(log, server_kind="vllm", model="m")], window_s=60)
    watcher.poll(now)
    (window,) = watcher.current_windows(now)
    assert window.counts.num_accepted_tokens == 7 and window.counts.num_draft_tokens == 105


def test_log_timezone_flag_reads_a_log_from_another_zone(host_zone, tmp_path):
    """A UTC server's log read on a host in Kolkata: with --log-timezone UTC the window ends at the
    line's UTC time; without it, at the same wall clock read in Kolkata."""
    host_zone("Asia/Kolkata")
    log = tmp_path / "vllm.log"
    log.write_text(VLLM_LINE + "\n")
    os.utime(log, (utc(2026, 12, 1), utc(2026, 12, 1)))  # vLLM's stamp has no year: it is the file's
    runner = CliRunner()
    args = ["watch", str(log), "--once", "--window", "1m", "--min-drafts", "1"]
    for flags, expected in (
        (["--log-timezone", "UTC"], utc(2026, 11, 30, 15, 51, 53)),
        ([], utc(2026, 11, 30, 10, 21, 53)),
    ):
        out = tmp_path / f"run{len(flags)}"
        result = runner.invoke(app, [*args, *flags, "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert read_windows(out)["end_s"].max() == expected
    bad = runner.invoke(app, [*args, "--log-timezone", "Mars/Olympus", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "--log-timezone 'Mars/Olympus' is not a time zone name" in bad.output
