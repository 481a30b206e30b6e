"""The synthetic fixture run (shared with the dashboard tests) and the figure builders drawn from it."""

from __future__ import annotations

import pytest

from dflash_doctor.report import figures
from dflash_doctor.rundir.load import load_run
from fixture_runs import FIXTURE_K_MAX, HOSTILE_TOKEN_TEXT, make_fixture_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return load_run(make_fixture_run(tmp_path_factory.mktemp("fx") / "run", seed=3))


def test_fixture_tables_agree_with_each_other(run):
    requests, steps, tokens = run.requests, run.steps, run.tokens
    assert len(tokens) == len(steps) * FIXTURE_K_MAX
    per_request = steps.groupby("request_id")["num_accepted"].sum()
    assert (
        requests.set_index("request_id")["num_accepted_tokens"].sort_index().tolist()
        == per_request.sort_index().tolist()
    )
    accepted_tokens = tokens.groupby(["request_id", "step"])["accepted"].sum()
    assert (
        accepted_tokens.to_numpy()
        == steps.set_index(["request_id", "step"]).loc[accepted_tokens.index, "num_accepted"].to_numpy()
    ).all()
    assert (tokens.loc[tokens["accepted"], "draft_token"] == tokens.loc[tokens["accepted"], "target_token"]).all()
    assert (tokens["draft_text"] == HOSTILE_TOKEN_TEXT).sum() == 1


def test_fixture_classes_differ_and_degrade_lowers_tau(run, tmp_path):
    by_class = run.meta["summary"]["by_class"]
    assert (
        by_class["math"]["mean_acceptance_length"]
        > by_class["code"]["mean_acceptance_length"]
        > by_class["chat"]["mean_acceptance_length"]
    )
    degraded = load_run(make_fixture_run(tmp_path / "degraded", seed=3, degrade=0.4)).meta["summary"]["overall"]
    assert degraded["mean_acceptance_length"] < run.meta["summary"]["overall"]["mean_acceptance_length"] - 0.5


def test_fixture_edge_cases(tmp_path):
    empty = load_run(make_fixture_run(tmp_path / "empty", num_requests=0))
    assert empty.requests.empty and empty.meta["summary"]["by_class"] == {} and empty.record.summary.sweep is None
    no_sweep = load_run(make_fixture_run(tmp_path / "nosweep", with_sweep=False, hostile_token=False))
    assert no_sweep.record.summary.sweep is None and no_sweep.record.recommendation == {}
    assert HOSTILE_TOKEN_TEXT not in set(no_sweep.tokens["draft_text"])
    sized = load_run(make_fixture_run(tmp_path / "sized", num_requests=6, num_tokens_target=4000))
    assert 2000 < len(sized.tokens) < 8000


def test_speedup_figure_marks_each_recommended_k(run):
    recommendation = run.record.recommendation
    fig = figures.speedup_by_k_figure(run.record.summary.sweep, recommendation)
    stars = {trace.legendgroup: trace.x[0] for trace in fig.data if trace.marker.symbol == "star"}
    assert stars == {name: rec.k for name, rec in recommendation.items()}


def test_figures_draw_one_series_per_class_plus_overall(run):
    summary = run.record.summary
    names = {"chat", "code", "math", "overall"}
    assert set(figures.tau_by_class_figure(summary).data[0].x) == names
    lines = figures.acceptance_by_position_figure(summary, conditional=True).data
    assert {t.name for t in lines} == names and all(len(t.y) == FIXTURE_K_MAX for t in lines)
    histogram = figures.acceptance_histogram_figure(summary).data
    assert all(sum(t.y) == pytest.approx(1.0) for t in histogram)
    assert {t.name for t in figures.acceptance_along_output_figure(run.steps).data} == names


def test_figures_of_an_empty_run_explain_themselves(tmp_path):
    empty = load_run(make_fixture_run(tmp_path / "empty", num_requests=0))
    for fig in (
        figures.tau_by_class_figure(empty.record.summary),
        figures.speedup_by_k_figure(None, {}),
        figures.acceptance_along_output_figure(empty.steps),
    ):
        assert not fig.data and fig.layout.annotations[0].text
