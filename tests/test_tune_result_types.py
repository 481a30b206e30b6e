"""tune.json through the typed result (dflash_doctor/tune/result.py): files written before the result was typed
read back to the same bytes and render the same views; a bad or old file is one sentence naming it; the vLLM
setting names the method the draft kind's registry entry declares."""

from __future__ import annotations

import io
import json
from pathlib import Path

import plotly.io as pio
import pytest
from rich.console import Console
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.errors import UsageError
from dflash_doctor.report.html import plotly_script
from dflash_doctor.tune.result import read_tune_result
from dflash_doctor.tune.views import print_tune, render_html, render_markdown

import fake_spec_engine as fake
from dashboard_app import open_app
from tune_fixtures import MAX_TOKENS, write_sweep_run, write_workload

WRITTEN_BEFORE = Path(__file__).resolve().parent / "fixtures" / "tune-result-2026-12-04"
RUNS = ("concurrency", "request-rate", "counters")


@pytest.mark.parametrize("name", RUNS)
def test_a_tune_json_written_before_the_types_reads_back_to_its_bytes(name):
    result = read_tune_result(WRITTEN_BEFORE / name)
    written = json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n"
    assert written == (WRITTEN_BEFORE / name / "tune.json").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", RUNS)
def test_the_views_render_what_they_rendered_before_the_types(name, monkeypatch):
    # the report's figures carry plotly's default template, which importing Streamlit (the dashboard test's
    # helpers) replaces in this process: the command that wrote these files ran without Streamlit
    monkeypatch.setattr(pio.templates, "default", "plotly")
    result = read_tune_result(WRITTEN_BEFORE / name)
    folder = WRITTEN_BEFORE / name
    assert render_markdown(result) == (folder / "report.md").read_text(encoding="utf-8")
    page = render_html(result)
    assert page.count(str(plotly_script())) == 1
    assert page.replace(str(plotly_script()), "") == (folder / "report-body.html").read_text(encoding="utf-8")
    terminal = io.StringIO()
    print_tune(result, Console(file=terminal, width=240, color_system=None))
    assert terminal.getvalue() == (folder / "terminal.txt").read_text(encoding="utf-8")


def _edited(tmp_path: Path, edit) -> Path:
    """A copy of the concurrency run whose tune.json ``edit`` changed (a dict -> the new file text)."""
    run = tmp_path / "tune"
    run.mkdir()
    (run / "tune.json").write_text(edit(json.loads((WRITTEN_BEFORE / "concurrency" / "tune.json").read_text())))
    return run


def _set(path: str, value):
    def edit(data: dict) -> str:
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value
        return json.dumps(data)

    return edit


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda data: "{not json", "is not readable JSON"),
        (lambda data: "[]", "has schema_version None but this dflash-doctor reads 1; re-run `dflash-doctor tune`"),
        (_set("schema_version", 0), "has schema_version 0 but this dflash-doctor reads 1; re-run `dflash-doctor tune`"),
        (_set("schema_version", 2), "read it with the dflash-doctor version that wrote it"),
        (_set("cells.3.tau", "2.5"), "(cells[3].tau is '2.5', not a finite number or null)"),
        (_set("cells.0.concurrency", True), "(cells[0].load is True, not an integer or a finite number or a string)"),
        (_set("grid.k", None), "(grid.k is None, not a list)"),
        (_set("recommendation.1.overall.k", 2.5), "(recommendation.1.overall.k is 2.5, not an integer)"),
        (_set("fits.1.fit_ks", ["2"]), "(fits.1.fit_ks[0] is '2', not an integer)"),
        (_set("servers.0.surprise", 1), "(servers[0] has no field(s) ['surprise'])"),
        (_set("cells", []), "(cells is an empty list"),
    ],
)
def test_a_bad_or_old_tune_json_is_one_sentence_naming_the_file(tmp_path, edit, says):
    run = _edited(tmp_path, edit)
    with pytest.raises(UsageError) as refused:
        read_tune_result(run)
    message = refused.value.message
    assert str(run / "tune.json") in message and says in message, message
    assert message.count(". ") == 0 and message.endswith("."), message


def test_a_folder_without_tune_json_is_named_with_the_fix(tmp_path):
    with pytest.raises(UsageError, match="is not a tune run directory .no tune.json.; pass a folder written by"):
        read_tune_result(tmp_path)


def test_the_dashboard_page_says_why_it_cannot_show_a_bad_tune_json(monkeypatch, tmp_path):
    _edited(tmp_path, _set("grid.k", None))
    at = open_app(monkeypatch, tmp_path, page="tune")
    errors = [str(e.value) for e in at.error]
    assert len(errors) == 1 and "grid.k is None, not a list" in errors[0], errors
    assert not list(at.get("plotly_chart"))


def _tune_with_sweep_kind(tmp_path: Path, kind: str):
    """`tune` at K 0 and 2 on cheap drafts (speculation pays, so the vLLM setting names a method), reading the
    teacher-forced sweep from a run whose draft is of ``kind``."""
    sweep = write_sweep_run(tmp_path, [2])
    record = json.loads((sweep / "run.json").read_text())
    record["models"]["draft"]["kind"] = kind
    (sweep / "run.json").write_text(json.dumps(record))
    costs = fake.FakeCosts(draft_s=0.002, slope_s=0.001)
    servers = {k: fake.start(k, costs) for k in (0, 2)}
    try:
        engine = ",".join(f"{k}=http://127.0.0.1:{s.server_address[1]}" for k, s in servers.items())
        return CliRunner().invoke(
            app,
            [
                "tune",
                "--engine",
                engine,
                "--k",
                "0,2",
                "--workload",
                str(write_workload(tmp_path)),
                "--max-new-tokens",
                str(MAX_TOKENS),
                "--sweep",
                str(sweep),
                "--out",
                str(tmp_path / "tune"),
            ],
        )
    finally:
        for server in servers.values():
            server.shutdown()


@pytest.mark.parametrize(("kind", "method"), [("eagle3", "eagle3"), ("autoregressive", "draft_model")])
def test_the_vllm_setting_names_the_method_the_kinds_registry_entry_declares(tmp_path, kind, method):
    result = _tune_with_sweep_kind(tmp_path, kind)
    assert result.exit_code == 0, result.output
    setting = read_tune_result(tmp_path / "tune").engine_settings["vllm"]
    assert f'"method": "{method}"' in setting, setting


def test_a_sweep_of_a_kind_this_version_does_not_know_is_refused(tmp_path):
    result = _tune_with_sweep_kind(tmp_path, "medusa")
    assert result.exit_code == 2, result.output
    assert "names the draft kind 'medusa', which this dflash-doctor does not know" in " ".join(result.output.split())
