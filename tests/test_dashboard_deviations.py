"""The dashboard's Deviations page through Streamlit's AppTest, on fixture runs written by the real RunWriter."""

from __future__ import annotations

from dflash_doctor.stats import deviations
from dflash_doctor.rundir.load import load_run
from dashboard_app import open_app


def open_page(monkeypatch, runs_dir, run):
    return open_app(monkeypatch, runs_dir, run, "deviations")


def test_deviations_page_shows_the_runs_costliest_patterns(monkeypatch, dashboard_runs):
    at = open_page(monkeypatch, dashboard_runs["root"], dashboard_runs["base"])
    expected = deviations.analyze_run(load_run(dashboard_runs["base"])).overall
    pairs = at.dataframe[0].value
    assert list(pairs["lost tokens"]) == [p.lost_tokens for p in expected.top_pairs]
    assert list(pairs["target token"]) == [repr(p.target_text) for p in expected.top_pairs]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["tau"] == f"{expected.tau:.2f}"
    assert metrics["Attainable tau (upper bound)"] == f"{expected.attainable_tau:.2f}"
    assert len(at.get("plotly_chart")) >= 3  # categories, context length, output position


def test_deviations_filters_narrow_to_a_class_and_a_category(monkeypatch, dashboard_runs):
    at = open_page(monkeypatch, dashboard_runs["root"], dashboard_runs["base"])
    at.multiselect(key="deviation_class").set_value(["math"]).run()
    at.multiselect(key="deviation_category").set_value(["word_start"]).run()
    assert not at.exception
    tables = deviations.run_tables(load_run(dashboard_runs["base"]))
    expected = deviations.slice_summary(tables, *deviations.select(tables, ["math"], ["word_start"]))
    pairs = at.dataframe[0].value
    assert set(pairs["category"]) == {"word_start"}
    assert list(pairs["lost tokens"]) == [p.lost_tokens for p in expected.top_pairs]
    categories = at.dataframe[1].value
    assert list(categories["category"]) == ["word_start"]


def test_deviation_example_opens_in_the_token_view(monkeypatch, dashboard_runs):
    at = open_page(monkeypatch, dashboard_runs["root"], dashboard_runs["base"])
    example = deviations.analyze_run(load_run(dashboard_runs["base"])).overall.top_pairs[0].example
    at.button(key="deviation_open").click().run()
    assert not at.exception
    assert at.title[0].value == "Tokens"
    assert at.selectbox(key="token_request").value == example.request_id


def test_deviations_page_explains_an_empty_run(monkeypatch, dashboard_runs):
    at = open_page(monkeypatch, dashboard_runs["root"], dashboard_runs["empty"])
    assert "no drafted requests" in "\n".join(str(i.value) for i in at.info)
