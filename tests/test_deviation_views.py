"""The "Why rejected" analysis as each view shows it: terminal summary, report.html / .md / .json, compare."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from dflash_doctor.stats import deviations
from dflash_doctor.cli import app as cli_app
from dflash_doctor.report.terminal import PATTERNS_PER_CLASS, print_why_rejected
from dflash_doctor.report import render_html, render_json, render_markdown
from dflash_doctor.rundir.load import load_run
from dflash_doctor.rundir.tables import TABLES
from fixture_runs import HOSTILE_TOKEN_TEXT, make_fixture_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {
        "base": make_fixture_run(root / "base", seed=0, num_requests=18),
        "degraded": make_fixture_run(root / "degraded", seed=1, num_requests=18, degrade=0.35),
        "empty": make_fixture_run(root / "empty", seed=3, num_requests=0),
    }


def test_terminal_summary_has_top_patterns_per_class_and_the_bound(runs):
    analysis = deviations.analyze_run(load_run(runs["base"]))
    console = Console(record=True, width=200)
    print_why_rejected(analysis, console)
    text = console.export_text()
    rows = [line for line in text.splitlines() if line.startswith("│")]
    assert len(rows) == PATTERNS_PER_CLASS * len(analysis.by_class)
    for cls, summary in analysis.by_class.items():
        assert f"{cls}: tau {summary.tau:.2f}, attainable <= {summary.attainable_tau:.2f}" in text
        assert repr(summary.top_pairs[0].target_text) in text


def test_terminal_summary_is_silent_without_rejections(runs):
    console = Console(record=True)
    print_why_rejected(deviations.analyze_run(load_run(runs["empty"])), console)
    assert console.export_text() == ""


def test_report_json_holds_the_analysis(runs):
    payload = json.loads(render_json(load_run(runs["base"])))
    why = payload["why_rejected"]
    assert set(why["by_class"]) == {"chat", "code", "math"}
    assert why["overall"]["attainable_tau"] >= why["overall"]["tau"]
    assert "upper bound" in why["definitions"]["attainable_tau"]


def test_report_html_section_escapes_tokens_and_links_examples_into_the_viewer(runs):
    run = load_run(runs["base"])
    html = render_html(run)
    section = html[html.index('<h2 id="why-rejected">') : html.index('<h2 id="tokens">')]
    assert HOSTILE_TOKEN_TEXT not in section  # token text is escaped (the fixture drafts it at a first rejection)
    ids = set(re.findall(r'id="([^"]+)"', html))
    links = re.findall(r'<a href="#([^"]+)"', section)
    assert links, "top patterns link to their example in the token viewer"
    assert all(link.replace("%23", "#") in ids for link in links)
    analysis = deviations.analyze_run(run)
    for cls in analysis.by_class:
        assert f'data-class="{cls}"' in section
    assert "chart-why-category" in section


def test_report_markdown_section_lists_patterns(runs):
    text = render_markdown(load_run(runs["base"]))
    section = text[text.index("### Why rejected") : text.index("### Models and environment")]
    analysis = deviations.analyze_run(load_run(runs["base"]))
    for cls, summary in analysis.by_class.items():
        assert f"| {cls} | {summary.tau:.2f} | {summary.attainable_tau:.2f} |" in section
    assert section.count("\n| chat | '") == PATTERNS_PER_CLASS


def test_reports_of_a_run_without_tokens_say_so(runs):
    run = load_run(runs["empty"])
    assert "No drafted tokens were recorded" in render_markdown(run)
    assert "no rejection patterns to show" in render_html(run)


def test_compare_lists_patterns_that_grew(runs):
    result = CliRunner().invoke(
        cli_app, ["compare", str(runs["base"]), str(runs["degraded"]), "--out", str(runs["degraded"])]
    )
    assert "Rejection patterns that grew" in result.output
    grown = deviations.grown_patterns(
        deviations.run_tables(load_run(runs["base"])), deviations.run_tables(load_run(runs["degraded"]))
    )
    assert grown and f"{grown[0]['growth']:+.3f}" in result.output
    md = (runs["degraded"] / "compare.md").read_text()
    assert "### Rejection patterns that grew" in md and f"| {grown[0]['class']} | {grown[0]['kind']} |" in md
    assert 'id="grown-patterns-table"' in (runs["degraded"] / "compare.html").read_text()


def test_empty_tables_give_an_empty_analysis():
    empty = {name: schema.empty_table().to_pandas() for name, schema in TABLES.items()}
    tables = deviations.deviation_tables(empty["tokens"], empty["steps"], empty["requests"])
    analysis = deviations.analyze(tables)
    assert analysis.by_class == {} and analysis.overall.tau is None and analysis.overall.top_pairs == []
    assert deviations.grown_patterns(tables, tables) == []
