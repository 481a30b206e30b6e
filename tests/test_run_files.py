"""Every file a run directory holds is validated when read back: run.json of the wrong shape or field
types and truncated or garbage Parquet tables are refused in one sentence naming the file (exit 2), and
one such run under the dashboard's runs folder is skipped while the others still open."""

from __future__ import annotations

import json
import shutil

import pytest

from cli_helpers import assert_usage_error, invoke
from dashboard_app import open_app
from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.load import load_run
from fixture_runs import make_fixture_run
from dflash_doctor.app.data.runs import find_runs


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    make_fixture_run(root / "run", seed=0, num_requests=4)
    return root / "run"


def _meta(good_run):
    return json.loads((good_run / "run.json").read_text())


#: run.json documents of the wrong shape or with fields of the wrong type
BAD_META = {
    "a list": lambda m: [1, 2],
    "a string": lambda m: "run",
    "a number": lambda m: 3,
    "null": lambda m: None,
    "summary a list": lambda m: {**m, "summary": [1]},
    "models a string": lambda m: {**m, "models": "x"},
    "checks a dict of numbers": lambda m: {**m, "checks": {"a": 1}},
    "checks a string": lambda m: {**m, "checks": "x"},
    "overall a string": lambda m: {**m, "summary": {**m["summary"], "overall": "x"}},
    "config a list": lambda m: {**m, "config": [1]},
    "schema_version a string": lambda m: {**m, "schema_version": "x"},
}


@pytest.mark.parametrize("case", list(BAD_META))
def test_a_run_json_of_the_wrong_shape_is_one_sentence(tmp_path, good_run, case):
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    (run / "run.json").write_text(json.dumps(BAD_META[case](_meta(good_run))))
    with pytest.raises(UsageError) as caught:
        load_run(run)
    assert "run.json" in str(caught.value)
    assert_usage_error(invoke("report", run), "run.json")


#: how a Parquet table can be damaged
BAD_PARQUET = {
    "truncated": lambda data: data[: len(data) // 2],
    "head only": lambda data: data[:100],
    "garbage": lambda data: b"garbage" * 20,
    "empty": lambda data: b"",
    "footer lost": lambda data: data[:-12],
}


@pytest.mark.parametrize("table", ["steps", "requests", "tokens"])
@pytest.mark.parametrize("damage", list(BAD_PARQUET))
def test_a_damaged_parquet_table_is_one_sentence(tmp_path, good_run, table, damage):
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    path = run / f"{table}.parquet"
    assert path.is_file(), f"the fixture run has no {table} table"
    path.write_bytes(BAD_PARQUET[damage](path.read_bytes()))
    with pytest.raises(UsageError) as caught:
        load_run(run)
    assert f"{table}.parquet" in str(caught.value)


def test_one_bad_run_does_not_break_the_dashboard(monkeypatch, tmp_path, good_run):
    runs = tmp_path / "runs"
    shutil.copytree(good_run, runs / "a-good")
    for i, case in enumerate(BAD_META):
        bad = runs / f"z-bad-{i}"
        bad.mkdir(parents=True)
        (bad / "run.json").write_text(json.dumps(BAD_META[case](_meta(good_run))))
    skipped: list = []
    assert find_runs(runs, skipped) == [runs / "a-good"]
    assert len(skipped) == len(BAD_META) and all("run.json" in reason for _, reason in skipped)
    at = open_app(monkeypatch, runs, runs / "a-good")  # asserts no exception on the page
    notes = [caption.value for caption in at.sidebar.caption]
    assert any(f"{len(BAD_META)} folder(s) skipped" in note for note in notes), notes


#: tokenizer files that are not a JSON object: truncated, empty, an HTML error page, a list, binary
BAD_TOKENIZER_JSON = {
    "truncated": lambda text: text[: len(text) // 2],
    "empty": lambda text: "",
    "html": lambda text: "<html><body>404 Not Found</body></html>",
    "a list": lambda text: "[1, 2, 3]",
    "binary": lambda text: "\x00\x01\x02garbage",
}


@pytest.mark.parametrize("damage", list(BAD_TOKENIZER_JSON))
@pytest.mark.parametrize("form", ["folder", "file"])
def test_a_tokenizer_json_that_is_not_json_is_one_sentence(tmp_path, tiny_dir, damage, form):
    folder = tmp_path / "tok"
    shutil.copytree(tiny_dir / "target", folder)
    path = folder / "tokenizer.json"
    path.write_text(BAD_TOKENIZER_JSON[damage](path.read_text()))
    spec = folder if form == "folder" else path
    assert_usage_error(invoke("tokenizers", spec, tiny_dir / "target"), "tokenizer.json")


@pytest.mark.parametrize("damage", ["truncated", "html"])
def test_a_model_folder_with_a_broken_tokenizer_json_is_refused_before_loading(tmp_path, tiny_dir, damage):
    from dflash_doctor.inputs.validation import check_model_folder

    folder = tmp_path / "target"
    shutil.copytree(tiny_dir / "target", folder)
    path = folder / "tokenizer.json"
    path.write_text(BAD_TOKENIZER_JSON[damage](path.read_text()))
    with pytest.raises(UsageError) as caught:
        check_model_folder(folder)
    assert "tokenizer.json" in str(caught.value)
