"""The dashboard's Deviations page through Streamlit's AppTest, on fixture runs written by the real RunWriter."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dflash_doctor import deviations
from dflash_doctor.app import RUNS_DIR_ENV
from dflash_doctor.schema import load_run
from fixture_runs import make_fixture_run

MAIN = Path(__file__).resolve().parents[1] / "app" / "main.py"
APP_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {
        "root": root,
        "base": make_fixture_run(root / "base", seed=0, num_requests=18),
        "empty": make_fixture_run(root / "empty", seed=3, num_requests=0),
    }


def open_page(monkeypatch, runs_dir: Path, run: Path) -> AppTest:
    monkeypatch.setenv(RUNS_DIR_ENV, str(runs_dir))
    at = AppTest.from_file(str(MAIN), default_timeout=APP_TIMEOUT_S)
    at.session_state["run_path"] = str(run)
    at.run()
    at.switch_page("views/deviations.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_deviations_page_shows_the_runs_costliest_patterns(monkeypatch, runs):
    at = open_page(monkeypatch, runs["root"], runs["base"])
    expected = deviations.analyze_run(load_run(runs["base"]))["overall"]
    pairs = at.dataframe[0].value
    assert list(pairs["lost tokens"]) == [p["lost_tokens"] for p in expected["top_pairs"]]
    assert list(pairs["target token"]) == [repr(p["target_text"]) for p in expected["top_pairs"]]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["tau"] == f"{expected['tau']:.2f}"
    assert metrics["Attainable tau (upper bound)"] == f"{expected['attainable_tau']:.2f}"
    assert len(at.get("plotly_chart")) >= 3  # categories, context length, output position


def test_deviations_filters_narrow_to_a_class_and_a_category(monkeypatch, runs):
    at = open_page(monkeypatch, runs["root"], runs["base"])
    at.multiselect(key="deviation_class").set_value(["math"]).run()
    at.multiselect(key="deviation_category").set_value(["word_start"]).run()
    assert not at.exception
    tables = deviations.run_tables(load_run(runs["base"]))
    expected = deviations.slice_summary(tables, *deviations.select(tables, ["math"], ["word_start"]))
    pairs = at.dataframe[0].value
    assert set(pairs["category"]) == {"word_start"}
    assert list(pairs["lost tokens"]) == [p["lost_tokens"] for p in expected["top_pairs"]]
    categories = at.dataframe[1].value
    assert list(categories["category"]) == ["word_start"]


def test_deviation_example_opens_in_the_token_view(monkeypatch, runs):
    at = open_page(monkeypatch, runs["root"], runs["base"])
    example = deviations.analyze_run(load_run(runs["base"]))["overall"]["top_pairs"][0]["example"]
    at.button(key="deviation_open").click().run()
    assert not at.exception
    assert at.title[0].value == "Tokens"
    assert at.selectbox(key="token_request").value == example["request_id"]


def test_deviations_page_explains_an_empty_run(monkeypatch, runs):
    at = open_page(monkeypatch, runs["root"], runs["empty"])
    assert "no drafted requests" in "\n".join(str(i.value) for i in at.info)
