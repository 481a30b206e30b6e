"""One verdict per run: the exit code, every report format, the terminal and the dashboard agree.

A table of check-status mixes, each with the one verdict every view must show (they once disagreed: with one
check in ``error`` the CLI exited 1, report.json said ``warn`` and the dashboard said ``error``; with
no checks the report said ``pass`` and the dashboard ``none``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import xml.etree.ElementTree as ET

import pytest
from rich.console import Console

from dflash_doctor.app import data
from dflash_doctor.checks.base import CheckResult, exit_code
from dflash_doctor.report.terminal import print_check_results
from dflash_doctor.report import render_html, render_json, render_junit, render_markdown
from dflash_doctor.rundir.load import load_run
from fixture_runs import make_fixture_run

# (statuses of the run's checks, the verdict, exit code with --fail-on fail, exit code with --fail-on warn)
TABLE = [
    ([], "none", 0, 0),
    (["skip"], "none", 0, 0),
    (["pass", "skip"], "pass", 0, 0),
    (["pass", "warn"], "warn", 0, 1),
    (["pass", "error"], "error", 1, 1),
    (["warn", "error", "pass"], "error", 1, 1),
    (["warn", "fail", "error"], "fail", 1, 1),
]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    return load_run(make_fixture_run(tmp_path_factory.mktemp("verdict") / "run", seed=0))


def _run_with(base_run, statuses):
    checks = [CheckResult(f"check-{i}", s, f"{s} summary") for i, s in enumerate(statuses)]
    return dataclasses.replace(base_run, record=dataclasses.replace(base_run.record, checks=checks))


@pytest.mark.parametrize(("statuses", "expected", "exit_fail", "exit_warn"), TABLE)
def test_every_view_shows_the_same_verdict(base_run, statuses, expected, exit_fail, exit_warn):
    results = [CheckResult(f"check-{i}", s, f"{s} summary") for i, s in enumerate(statuses)]
    run = _run_with(base_run, statuses)

    assert exit_code(results) == exit_fail
    assert exit_code(results, fail_on="warn") == exit_warn
    assert json.loads(render_json(run))["verdict"] == expected
    assert render_markdown(run).splitlines()[0].startswith(f"## dflash-doctor: {expected.upper()} ")
    badge = re.search(r'<span id="verdict" class="badge verdict (\w+)">(\w+)</span>', render_html(run))
    assert badge is not None and badge.groups() == (expected, expected.upper())
    console = Console(record=True, width=200)
    print_check_results(results, console)
    assert console.export_text().rstrip().splitlines()[-1] == f"verdict: {expected.upper()}"
    assert data.run_verdict(run.record.checks)[0] == expected
    suite = ET.fromstring(render_junit(run)).find("testsuite")
    assert int(suite.get("failures")) + int(suite.get("errors")) == sum(s in ("fail", "error") for s in statuses)


def test_dashboard_sentence_counts_statuses_worst_first():
    status, sentence = data.run_verdict(
        [CheckResult(check_id, status, "") for check_id, status in [("a", "warn"), ("b", "error"), ("c", "pass")]]
    )
    assert status == "error" and sentence == "3 checks: 1 errored, 1 warned, 1 passed."
