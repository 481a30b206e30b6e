"""`compare`: flags a degraded draft, stays quiet for a reseeded run, and gates CI through exit codes."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.report.comparison import compare_runs
from dflash_doctor.rundir.load import load_run
from dflash_doctor.stats.gate import Side, compare_slice
from dflash_doctor.stats.metrics import NUM_BOOTSTRAP_RESAMPLES
from fixture_runs import make_fixture_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    return {
        "base": make_fixture_run(root / "base", seed=0),
        "reseeded": [make_fixture_run(root / f"seed{s}", seed=s) for s in (1, 2, 3)],
        "degraded": make_fixture_run(root / "degraded", seed=0, degrade=0.4),
    }


def test_degraded_draft_is_flagged_in_every_class(runs):
    comparison = compare_runs(runs["base"], runs["degraded"])
    assert comparison.has_regression
    flagged_tau = {row.cls for row in comparison.regressions if row.slot is None}
    assert flagged_tau == {"math", "code", "chat", "overall"}
    for row in comparison.regressions:
        assert row.delta < -row.threshold and row.new_ci[1] < row.base_ci[0]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_runs_differing_only_by_seed_are_not_flagged(runs, index):
    comparison = compare_runs(runs["base"], runs["reseeded"][index])
    assert not comparison.has_regression, [(r.cls, r.label, r.delta) for r in comparison.regressions]
    assert len(comparison.rows) == 4 * (1 + 8)  # 3 classes + overall, tau + 8 slots each


def test_a_drop_below_the_threshold_is_not_a_regression(runs):
    comparison = compare_runs(runs["base"], runs["degraded"], threshold_tau=10.0, threshold_rate=1.0)
    assert not comparison.has_regression
    assert all(row.delta is not None for row in comparison.rows)


def test_different_k_is_compared_by_truncation_with_a_note(runs):
    short = load_run(runs["base"])
    short.steps = short.steps.assign(k=4, num_drafted=4, num_accepted=short.steps["num_accepted"].clip(upper=4))
    comparison = compare_runs(runs["base"], short)
    assert comparison.k_compared == 4 and any("truncation" in note for note in comparison.notes)
    assert not comparison.has_regression  # same steps, only cut at 4: nothing dropped


def test_cli_exit_codes_and_written_reports(runs, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["compare", str(runs["base"]), str(runs["reseeded"][0]), "--out", str(tmp_path / "ok")])
    assert ok.exit_code == 0, ok.output
    assert "OK" in ok.output
    bad = runner.invoke(app, ["compare", str(runs["base"]), str(runs["degraded"]), "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 1, bad.output
    assert "REGRESSION" in bad.output
    markdown = (tmp_path / "bad" / "compare.md").read_text()
    assert markdown.startswith("## dflash-doctor compare: REGRESSION") and "| math | 1 |" in markdown
    assert (tmp_path / "bad" / "compare.html").stat().st_size > 1_000_000  # plotly.js embedded


def test_cli_plotly_cdn_writes_a_small_compare_page_linking_plotly_js(runs, tmp_path):
    result = CliRunner().invoke(
        app, ["compare", str(runs["base"]), str(runs["reseeded"][0]), "--plotly", "cdn", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    html = (tmp_path / "compare.html").read_text()
    assert (
        len(html.encode()) < 200_000
        and html.count('src="https://cdn.plot.ly/plotly-') == 1
        and "plotly.js v" not in html
    )


def test_cli_bad_input_exits_2(runs, tmp_path):
    result = CliRunner().invoke(app, ["compare", str(runs["base"]), str(tmp_path / "missing")])
    assert result.exit_code == 2, result.output
    assert "is not a run directory" in result.output


def test_a_metric_without_an_interval_is_not_gated_and_says_so():
    """A watch's tau can have no interval (too few scrape intervals): the row must say it was not gated
    rather than read like a pass."""
    samples = np.full(NUM_BOOTSTRAP_RESAMPLES, 2.0)
    rates = np.full((NUM_BOOTSTRAP_RESAMPLES, 1), 0.5)
    base = Side(10, 3.0, [2.9, 3.1], [0.9], [[0.85, 0.95]], samples + 1, rates + 0.4)
    new = Side(10, 1.5, None, [0.2], [[0.15, 0.25]], samples, rates)
    tau, rate = compare_slice("overall", base, new, 1, threshold_tau=0.2, threshold_rate=0.05)
    assert not tau.regression and tau.note == "no 95% interval in NEW: not gated"
    assert rate.regression and rate.note == ""  # both intervals there: the rule applies


#: run.json edits that make NEW measure something else than BASE, and the words the warning must hold
_OTHER_INPUTS = [
    (lambda m: m["models"]["target"].update(id="other/target"), "different targets"),
    (lambda m: m["models"]["target"].update(revision_or_hash="f" * 64), "different weights"),
    (lambda m: m["config"].update(workload="other.jsonl"), "different workloads"),
    (lambda m: m["config"].update(max_new_tokens=7), "different workloads"),
    (lambda m: m["config"].update(classes=["math"]), "different workloads"),
    (lambda m: m["config"].update(temperature=0.7), "different workloads"),
]


@pytest.mark.parametrize(("edit", "says"), _OTHER_INPUTS)
def test_compare_warns_when_the_runs_measured_different_inputs(runs, tmp_path, edit, says):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(runs["degraded"], other)
    meta = json.loads((other / "run.json").read_text())
    edit(meta)
    (other / "run.json").write_text(json.dumps(meta))
    comparison = compare_runs(runs["base"], other)
    assert any(says in note for note in comparison.notes), comparison.notes
    result = CliRunner().invoke(app, ["compare", str(runs["base"]), str(other), "--out", str(tmp_path / "out")])
    assert "WARNING" in result.output and says in " ".join(result.output.split())


def test_compare_of_the_same_inputs_has_no_input_warning(runs):
    assert not any("WARNING" in note for note in compare_runs(runs["base"], runs["degraded"]).notes)
