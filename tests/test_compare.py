"""`compare`: flags a degraded draft, stays quiet for a reseeded run, and gates CI through exit codes."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.compare import bootstrap_rates, compare_runs, expanded_level, percentile_interval, pooled_rates, request_counts
from dflash_doctor.schema import load_run
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


def test_request_counts_pool_like_vllm_counters():
    steps = pd.DataFrame({"request_id": ["a", "a", "b"], "num_drafted": [3, 3, 3], "num_accepted": [3, 0, 1]})
    counts = request_counts(steps)
    assert counts.num_drafts.tolist() == [2, 1]
    assert counts.accepted_per_pos.tolist() == [[1, 1, 1], [1, 0, 0]]
    tau, rates = pooled_rates(counts.num_drafts.sum(), counts.accepted_per_pos.sum(axis=0))
    assert tau == pytest.approx(1 + 4 / 3) and rates.tolist() == pytest.approx([2 / 3, 1 / 3, 1 / 3])


def test_bootstrap_interval_covers_the_estimate_and_widens_for_few_requests():
    rng = np.random.default_rng(0)
    accepted = rng.integers(0, 4, size=200)
    steps = pd.DataFrame({"request_id": np.repeat(np.arange(20), 10), "num_drafted": 3, "num_accepted": accepted})
    counts = request_counts(steps)
    tau, _ = pooled_rates(counts.num_drafts.sum(), counts.accepted_per_pos.sum(axis=0))
    tau_samples, _ = bootstrap_rates(counts, seed=0)
    plain = percentile_interval(tau_samples)
    expanded = percentile_interval(tau_samples, num_units=counts.num_requests)
    assert plain[0] < tau < plain[1]
    assert expanded[0] < plain[0] and expanded[1] > plain[1]
    assert expanded_level(0.95, 8) > expanded_level(0.95, 100) > 0.95 and expanded_level(0.95, 10_000) == pytest.approx(0.95, abs=1e-3)


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


def test_cli_bad_input_exits_2(runs, tmp_path):
    result = CliRunner().invoke(app, ["compare", str(runs["base"]), str(tmp_path / "missing")])
    assert result.exit_code == 2, result.output
    assert "is not a run directory" in result.output
