"""Exit codes as a contract a supervisor can act on: a crash (an unexpected exception, a bug) exits 70 in
every command, never 1 (a finding: failed check, regression, alert) nor 2 (bad input), and the shipped
systemd unit restarts the watch on it while an alert (1) counts as success and bad input (2) is not retried.
"""

from __future__ import annotations

import configparser
import importlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.processes import EXIT_CRASH

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "deploy" / "systemd" / "dflash-doctor-watch.service"


def _broken(*args, **kwargs):
    raise RuntimeError("a bug deep inside")


# (command line, the module and function the bug is planted in)
CRASHES = [
    (["watch", "http://127.0.0.1:1/metrics", "--once"], "dflash_doctor.cli.watch", "build_watch_settings"),
    (["compare", "{tmp}", "{tmp}"], "dflash_doctor.cli.compare", "compare_runs"),
    (["report", "{tmp}"], "dflash_doctor.cli.report", "render_reports"),
    (
        ["tune", "--engine", "0=http://127.0.0.1:1", "--k", "0", "--out", "{tmp}/tune"],
        "dflash_doctor.tune.experiment",
        "run_tune",
    ),
]


@pytest.mark.parametrize("args, module, name", CRASHES, ids=[c[0][0] for c in CRASHES])
def test_a_crash_exits_70_with_its_traceback_in_every_command(tmp_path, monkeypatch, args, module, name):
    monkeypatch.setattr(importlib.import_module(module), name, _broken)
    result = CliRunner().invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.exit_code == EXIT_CRASH, result.output
    assert "RuntimeError: a bug deep inside" in result.output  # the traceback, for the bug report
    assert f"dflash-doctor crashed (an internal error, not your input): exit {EXIT_CRASH}" in result.output


def test_bad_input_and_a_finding_keep_their_codes(tmp_path):
    assert CliRunner().invoke(app, ["compare", str(tmp_path / "nope"), str(tmp_path / "nope")]).exit_code == 2
    assert CliRunner().invoke(app, ["watch", "--json"]).exit_code == 2


def test_the_systemd_unit_restarts_a_crashed_watch_and_not_an_alert_or_bad_input():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string(UNIT.read_text().replace("\\\n", " "))
    service = unit["Service"]
    success = service["SuccessExitStatus"].split()
    prevent = service.get("RestartPreventExitStatus", "").split()
    assert service["Restart"] == "on-failure"  # any other non-zero exit (a crash: 70) restarts
    assert "1" in success and str(EXIT_CRASH) not in success  # an alert is success; a crash is a failure
    assert "2" in prevent and str(EXIT_CRASH) not in prevent  # bad input is not retried; a crash is
