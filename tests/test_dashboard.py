"""The Streamlit dashboard, page by page, through Streamlit's AppTest (no browser, no server).

Every page is run on synthetic fixture runs written through the real RunWriter (tests/fixture_runs.py):
a healthy run with a sweep, a degraded run (what Compare must flag), a run without a sweep, and an
empty run. Assertions compare what the page shows with what run.json / the tables hold.
"""

from __future__ import annotations

import io
import re
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from dflash_doctor.app import data
from dflash_doctor.cli import app as cli_app
from dflash_doctor.cli.dashboard import port_is_free, streamlit_command
from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.run_record import Metrics, ModelInfo, RunMeta, RunRecord, Summary, TauDistribution
from dflash_doctor.rundir.load import load_run
from dashboard_app import open_app
from fixture_runs import HOSTILE_TOKEN_TEXT, make_fixture_run

PAGES = ("rejection", "positions", "tokens", "sweep", "compare")


def texts(elements) -> str:
    return "\n".join(str(e.value) for e in elements)


def plotly_charts(at: AppTest) -> list:
    return list(at.get("plotly_chart"))


# ------------------------------------------------------------------------------------ pages


def test_overview_shows_verdict_headline_and_check_fixes(monkeypatch, dashboard_runs):
    at = open_app(monkeypatch, dashboard_runs["root"], dashboard_runs["base"])
    run = load_run(dashboard_runs["base"], tables=())
    meta = run.meta
    status, sentence = data.run_verdict(run.record.checks)
    assert at.title[0].value == "Overview"
    assert f"Verdict: {status.upper()}" in texts(at.error) + texts(at.warning) + texts(at.success)
    tau = meta["summary"]["overall"]["mean_acceptance_length"]
    shown = {m.label: m.value for m in at.metric}
    assert shown["tau"] == f"{tau:.2f}"
    assert shown["Recommended K (overall)"] == str(meta["recommendation"]["overall"]["k"])
    fixes = [f["fix"] for c in meta["checks"] for f in c["findings"] if f.get("fix")]
    shown_markdown = [re.sub(r"\\(.)", r"\1", m.value) for m in at.markdown]  # user text arrives Markdown-escaped
    assert fixes and all(any(fix in text for text in shown_markdown) for fix in fixes)
    assert len(plotly_charts(at)) == 2
    environment = at.dataframe[-1].value
    assert meta["environment"]["torch"] in environment["value"].tolist()


def test_rejection_table_matches_summary_and_filters_recompute(monkeypatch, dashboard_runs):
    at = open_app(monkeypatch, dashboard_runs["root"], dashboard_runs["base"], "rejection")
    summary = load_run(dashboard_runs["base"], tables=()).meta["summary"]
    table = at.dataframe[0].value.set_index("class")
    assert table.index[0] == "overall"
    for cls, metrics in summary["by_class"].items():
        assert table.loc[cls, "tau"] == pytest.approx(metrics["mean_acceptance_length"])
        assert table.loc[cls, "rejection_rate"] == pytest.approx(1 - metrics["draft_acceptance_rate"])
        assert (
            table.loc[cls, "rejection_rate_lo"]
            <= table.loc[cls, "rejection_rate"]
            <= table.loc[cls, "rejection_rate_hi"]
        )
    worst = min(summary["by_class"], key=lambda c: summary["by_class"][c]["mean_acceptance_length"])
    assert at.selectbox(key="drill_class").value == worst
    drill = at.dataframe[1].value
    assert set(drill["request_id"].str.split("-").str[0]) == {worst}
    assert drill["tau"].is_monotonic_increasing

    at.multiselect(key="filter_class").set_value(["math"]).run()
    filtered = at.dataframe[0].value.set_index("class")
    assert list(filtered.index) == ["overall", "math"]
    assert filtered.loc["overall", "tau"] == pytest.approx(summary["by_class"]["math"]["mean_acceptance_length"])
    assert "Recomputed over the 6 requests" in texts(at.caption)


def test_rejection_drill_down_opens_the_request_in_the_token_view(monkeypatch, dashboard_runs):
    at = open_app(monkeypatch, dashboard_runs["root"], dashboard_runs["base"], "rejection")
    at.selectbox(key="drill_class").set_value("code").run()
    first = at.dataframe[1].value["request_id"].iloc[0]
    at.button(key="open_tokens").click().run()
    assert not at.exception
    assert at.title[0].value == "Tokens"
    assert at.selectbox(key="token_request").value == first


def test_positions_page_shows_rates_of_the_summary(monkeypatch, dashboard_runs):
    at = open_app(monkeypatch, dashboard_runs["root"], dashboard_runs["base"], "positions")
    summary = load_run(dashboard_runs["base"], tables=()).meta["summary"]
    assert len(plotly_charts(at)) == 3
    pivot = at.dataframe[0].value
    np.testing.assert_allclose(
        pivot["math"], np.array(summary["by_class"]["math"]["acceptance_rate_per_pos"], dtype=float)
    )
    at.segmented_control(key="positions_metric").set_value("conditional").run()
    pivot = at.dataframe[0].value
    np.testing.assert_allclose(
        pivot["chat"], np.array(summary["by_class"]["chat"]["conditional_acceptance_rate_per_pos"], dtype=float)
    )
    assert "Weakest slot" in texts(at.caption)


def test_tokens_page_escapes_hostile_token_text(monkeypatch, dashboard_runs):
    at = open_app(monkeypatch, dashboard_runs["root"], dashboard_runs["base"], "tokens")
    at.selectbox(key="token_request").set_value("math-0000").run()
    assert not at.exception
    body = at.get("html")[0].value
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert HOSTILE_TOKEN_TEXT not in body
    candidates = at.dataframe[0].value
    assert list(candidates["rank"]) == list(range(1, len(candidates) + 1))
    assert candidates["draft candidate"].iloc[0] == HOSTILE_TOKEN_TEXT  # the preselected first rejection


def test_tokens_page_paginates_long_requests(monkeypatch, tmp_path):
    run = make_fixture_run(tmp_path / "long", seed=4, num_requests=2, classes=("math",), num_tokens_target=2400)
    at = open_app(monkeypatch, tmp_path, run, "tokens")
    request_id = at.selectbox(key="token_request").value
    steps = load_run(run, tables=("steps",)).steps
    num_steps = int((steps["request_id"] == request_id).sum())
    assert num_steps > data.STEPS_PER_TOKEN_PAGE
    pager = at.get("pagination")[0]
    pager.set_value(2).run()
    assert f"Steps {data.STEPS_PER_TOKEN_PAGE}–" in texts(at.caption)
    assert at.get("html")[0].value.count('class="dd-step"') == min(
        data.STEPS_PER_TOKEN_PAGE, num_steps - data.STEPS_PER_TOKEN_PAGE
    )


def test_sweep_page_shows_recommendation_and_costs(monkeypatch, dashboard_runs):
    at = open_app(monkeypatch, dashboard_runs["root"], dashboard_runs["base"], "sweep")
    meta = load_run(dashboard_runs["base"], tables=()).meta
    assert len(plotly_charts(at)) == 1
    rec = at.dataframe[0].value.set_index("class")
    assert {c: int(r["k"]) for c, r in meta["recommendation"].items()} == rec["k"].astype(int).to_dict()
    speedups = at.dataframe[1].value
    overall = {row["k"]: row["speedup"] for row in meta["summary"]["sweep"]["overall"]}
    assert speedups["overall"].to_dict() == pytest.approx(overall)
    assert "measured" in texts(at.caption)


def test_sweep_page_says_when_the_run_has_no_sweep(monkeypatch, dashboard_runs):
    at = open_app(monkeypatch, dashboard_runs["root"], dashboard_runs["nosweep"], "sweep")
    assert "no K sweep" in texts(at.info)
    assert not plotly_charts(at)


def test_compare_flags_a_degraded_run_and_names_what_changed(monkeypatch, dashboard_runs):
    at = open_app(monkeypatch, dashboard_runs["root"], dashboard_runs["degraded"], "compare")
    at.selectbox(key="compare_base").set_value(str(dashboard_runs["base"])).run()
    assert "regression" in texts(at.error)
    tau_rows = at.dataframe[0].value.set_index("class")
    assert tau_rows["regression"].any()
    assert (tau_rows.loc[tau_rows["regression"], "delta"] < 0).all()
    changed = at.dataframe[2].value
    assert "config.seed" in changed["fact"].tolist()


def test_compare_of_a_run_with_itself_finds_no_regression(monkeypatch, tmp_path):
    first = make_fixture_run(tmp_path / "a", seed=5, num_requests=9)
    make_fixture_run(tmp_path / "b", seed=5, num_requests=9)
    at = open_app(monkeypatch, tmp_path, first, "compare")
    assert "No regression" in texts(at.success)


@pytest.mark.parametrize(
    ("page", "note"),
    [
        ("overview", "no drafted steps"),
        ("rejection", "no drafted requests"),
        ("positions", "no per-slot acceptance"),
        ("tokens", "no drafted requests"),
        ("sweep", "no K sweep"),
    ],
)
def test_every_page_explains_an_empty_run(monkeypatch, dashboard_runs, page, note):
    at = open_app(monkeypatch, dashboard_runs["root"], dashboard_runs["empty"], None if page == "overview" else page)
    assert note in texts(at.info)


def test_compare_with_an_empty_run_says_nothing_was_compared(monkeypatch, dashboard_runs):
    at = open_app(monkeypatch, dashboard_runs["root"], dashboard_runs["empty"], "compare")
    at.selectbox(key="compare_base").set_value(str(dashboard_runs["nosweep"])).run()
    assert "nothing could be compared" in texts(at.warning)
    assert not at.success
    assert set(at.dataframe[0].value["note"]) == {"only in BASE: not compared"}


def test_no_runs_found_points_to_upload(monkeypatch, tmp_path):
    at = open_app(monkeypatch, tmp_path)
    assert "No runs under" in texts(at.info)
    assert "No run is open" in texts(at.info)


def test_uploading_a_zipped_run_opens_it(monkeypatch, dashboard_runs, tmp_path):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for file in dashboard_runs["nosweep"].iterdir():
            archive.write(file, f"my-run/{file.name}")
    at = open_app(monkeypatch, tmp_path)
    at.get("file_uploader")[0].set_value(("my-run.zip", buffer.getvalue(), "application/zip")).run()
    assert not at.exception
    opened = Path(at.session_state["run_path"])
    assert (opened / "tokens.parquet").is_file()
    assert load_run(opened, tables=()).meta["config"]["seed"] == 2
    assert at.title[0].value == "Overview"


def test_uploading_a_non_run_file_says_what_to_upload(monkeypatch, tmp_path):
    at = open_app(monkeypatch, tmp_path)
    at.get("file_uploader")[0].set_value(("notes.json", b"{}", "application/json")).run()
    assert "is not part of a run" in texts(at.error)


# ------------------------------------------------------------------------------------ data layer


def test_find_runs_accepts_a_run_or_a_folder_and_skips_broken_ones(dashboard_runs, tmp_path):
    assert data.find_runs(dashboard_runs["base"]) == [dashboard_runs["base"]]
    found = data.find_runs(dashboard_runs["root"])
    assert set(found) == {
        dashboard_runs["base"],
        dashboard_runs["degraded"],
        dashboard_runs["nosweep"],
        dashboard_runs["empty"],
    }
    (tmp_path / "group" / "broken").mkdir(parents=True)
    (tmp_path / "group" / "broken" / "run.json").write_text("{not json")
    make_fixture_run(tmp_path / "group" / "ok", seed=6, num_requests=3)
    assert data.find_runs(tmp_path) == [tmp_path / "group" / "ok"]
    assert data.find_runs(tmp_path / "missing") == []


def test_save_upload_writes_only_run_files_inside_dest(dashboard_runs, tmp_path):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("../../escape/run.json", (dashboard_runs["base"] / "run.json").read_bytes())
        archive.writestr("../../escape/evil.py", b"print('x')")
    dest = tmp_path / "uploads" / "one"
    assert data.save_upload([("run.zip", buffer.getvalue())], dest) == dest
    assert sorted(p.name for p in dest.iterdir()) == ["run.json"]
    assert not (tmp_path / "escape").exists()


@pytest.mark.parametrize(
    ("files", "named"),
    [
        ([("run.zip", b"not a zip")], "run.zip is not a valid zip"),
        ([("steps.parquet", b"x")], "has no run.json"),
        ([("model.safetensors", b"x")], "'model.safetensors' is not part of a run"),
        ([], "No file was uploaded"),
    ],
)
def test_save_upload_rejects_what_is_not_a_run(tmp_path, files, named):
    with pytest.raises(UsageError, match=named):
        data.save_upload(files, tmp_path / "dest")


def test_request_chips_rebuild_the_committed_output(dashboard_runs):
    run = load_run(dashboard_runs["nosweep"])
    vocabulary = data.token_vocabulary(run.tokens)
    request = run.requests.iloc[1]
    steps = run.steps[run.steps["request_id"] == request["request_id"]]
    tokens = run.tokens[run.tokens["request_id"] == request["request_id"]]
    blocks = data.request_chips(steps, tokens, vocabulary)
    committed = "".join(chip.text for chips in blocks for chip in chips if chip.kind != "rejected")
    assert committed == request["output_text"]
    for chips, step in zip(blocks, steps.sort_values("step").itertuples()):
        kinds = [chip.kind for chip in chips]
        assert kinds.count("accepted") == step.num_accepted
        assert kinds.count("rejected") == (1 if step.num_accepted < step.num_drafted else 0)
        assert kinds[-1] == "target"


def test_chips_html_escapes_text_and_tooltips():
    chip = data.TokenChip(HOSTILE_TOKEN_TEXT, "rejected", 0, 1, f'draft "{HOSTILE_TOKEN_TEXT}"')
    body = data.chips_html([[chip]])
    assert HOSTILE_TOKEN_TEXT not in body
    assert body.count("&lt;script&gt;") == 2


def test_bootstrap_ratio_ci_brackets_the_ratio_and_collapses_when_constant():
    lo, hi = data.bootstrap_ratio_ci([3, 3, 3], [4, 4, 4])
    assert lo == pytest.approx(0.75) and hi == pytest.approx(0.75)
    lo, hi = data.bootstrap_ratio_ci([1, 4, 2, 8, 5], [10, 10, 10, 10, 10])
    assert lo < 20 / 50 < hi
    assert all(pd.isna(x) for x in data.bootstrap_ratio_ci([], []))


def test_prompt_length_buckets_are_half_open():
    labels = data.prompt_length_bucket(pd.Series([0, 127, 128, 511, 512, 9000]))
    assert labels.tolist() == ["<128", "<128", "128-511", "128-511", "512-2047", ">=8192"]


def test_weakest_slot_ignores_slots_that_few_drafts_reach():
    chat = Metrics(
        num_requests=10,
        num_output_tokens=300,
        num_drafts=100,
        num_draft_tokens=500,
        num_accepted_tokens=151,
        num_accepted_tokens_per_pos=[80, 40, 30, 1, 0],
        mean_acceptance_length=2.51,
        mean_acceptance_length_ci=[2.3, 2.7],
        acceptance_rate_per_pos=[0.8, 0.4, 0.3, 0.01, 0.0],
        acceptance_rate_per_pos_ci=[],  # a telemetry summary has no per-slot intervals
        conditional_acceptance_rate_per_pos=[0.8, 0.5, 0.75, 0.033, 0.0],
        draft_acceptance_rate=0.302,
        acceptance_histogram=[20, 40, 10, 29, 1, 0],
        request_tau=TauDistribution(None, None, None, None),
        wasted_verify_tokens_per_output_token=None,
    )
    summary = Summary(by_class={"chat": chat})
    weakest = data.weakest_slots(data.position_table(summary))
    assert weakest[["class", "slot"]].to_dict("records") == [{"class": "chat", "slot": 4}]  # slot 5: reach 1% < 5%
    assert data.weakest_slots(data.position_table(summary), min_reach=0.5)["slot"].tolist() == [2]


def test_changed_facts_lists_only_differences():
    def record(dtype: str) -> RunRecord:
        target = ModelInfo(id="a", revision_or_hash="abc", dtype=dtype, device="cpu", kind="target")
        return RunRecord(meta=RunMeta(command="check"), models={"target": target}, environment={"torch": "2.9"})

    changed = data.changed_facts(record("float32"), record("bfloat16"))
    assert changed.to_dict("records") == [{"fact": "models.target.dtype", "BASE": "float32", "NEW": "bfloat16"}]


# ------------------------------------------------------------------------------------ CLI


def test_cli_refuses_a_missing_runs_dir(tmp_path):
    result = CliRunner().invoke(cli_app, ["dashboard", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "RUNS_DIR" in result.output and "is not a folder" in result.output


def test_cli_refuses_a_busy_port(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert not port_is_free("127.0.0.1", port)
        result = CliRunner().invoke(cli_app, ["dashboard", str(tmp_path), "--port", str(port)])
    assert result.exit_code == 2
    assert f"--port {port}" in result.output and "already in use" in result.output


def test_streamlit_command_runs_the_packaged_app_headless():
    command = streamlit_command("127.0.0.1", 8765)
    script = Path(command[command.index("run") + 1])
    assert script.name == "main.py" and script.is_file()
    flags = dict(zip(command[command.index("run") + 2 :: 2], command[command.index("run") + 3 :: 2]))
    assert flags["--server.headless"] == "true"
    assert flags["--server.port"] == "8765"
    assert flags["--server.address"] == "127.0.0.1"
