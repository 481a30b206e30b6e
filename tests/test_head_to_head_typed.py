"""The typed head-to-head (:class:`~dflash_doctor.stats.head_to_head.HeadToHead`): a head_to_head.json written by
the untyped code before it (tests/fixtures/head-to-head-2026-12-04, a real `check --draft ... --draft ngram` of the
tiny pair with timed costs) reads back into the types and writes the same bytes, its pages render the same bytes
from the typed value, `check --json`'s head-to-head is the same; a bad or older file is one UsageError sentence
naming the file and the fix."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from dflash_doctor.cli.output import json_safe
from dflash_doctor.errors import UsageError
from dflash_doctor.report.head_to_head import html_page, markdown, write_head_to_head
from dflash_doctor.rundir.tables import HEAD_TO_HEAD_JSON
from dflash_doctor.stats.head_to_head import HeadToHead, read_head_to_head

FIXTURE = Path(__file__).parent / "fixtures" / "head-to-head-2026-12-04"


def test_a_head_to_head_written_before_the_types_reads_back_to_the_same_bytes(tmp_path):
    typed = read_head_to_head(FIXTURE)
    assert [s.name for s in typed.speculators] == ["dflash", "ngram"]
    assert typed.costs.spread is not None and typed.speculators[0].sub_run is not None  # timed, described
    assert typed.scopes["overall"].verdict.deploy is not None  # the leader's engine settings
    write_head_to_head(tmp_path, typed)
    for name in (HEAD_TO_HEAD_JSON, "head_to_head.md", "head_to_head.html"):
        assert (tmp_path / name).read_bytes() == (FIXTURE / name).read_bytes(), name
    assert markdown(typed) == (FIXTURE / "head_to_head.md").read_text(encoding="utf-8")
    assert html_page(typed) == (FIXTURE / "head_to_head.html").read_text(encoding="utf-8")


def test_check_json_prints_the_same_head_to_head_from_the_typed_value():
    """`check --json` printed the head-to-head with sorted keys (cli/output.py print_json): the typed value's JSON
    form gives back the same text as the command printed before."""
    printed = json.loads((FIXTURE / "check-json-stdout.json").read_text(encoding="utf-8"))["head_to_head"]
    typed = read_head_to_head(FIXTURE)
    assert json.dumps(json_safe(typed.to_json()), indent=2, sort_keys=True) == json.dumps(
        printed, indent=2, sort_keys=True
    )


def _written(tmp_path: Path, edit) -> Path:
    data = json.loads((FIXTURE / HEAD_TO_HEAD_JSON).read_text(encoding="utf-8"))
    edit(data)
    folder = tmp_path / "h2h"
    folder.mkdir()
    (folder / HEAD_TO_HEAD_JSON).write_text(json.dumps(data), encoding="utf-8")
    return folder


def _drop_source(data):  # a head-to-head written before the costs named their source
    del data["costs"]["source"]


def _half_a_sub_run(data):  # some of a sub-run's facts without the others
    del data["speculators"][0]["command"]


def _speedup_as_text(data):
    data["scopes"]["overall"]["rows"][0]["speedup"] = "1.2x"


def _scopes_as_list(data):
    data["scopes"] = list(data["scopes"].values())


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (_drop_source, "costs lacks the field(s) ['source']"),
        (_half_a_sub_run, "speculators[0] lacks the field(s) ['command']"),
        (_speedup_as_text, "scopes.overall.rows[0].speedup is '1.2x', not a number"),
        (_scopes_as_list, "scopes is a list, not an object"),
    ],
)
def test_a_bad_or_older_file_is_one_sentence_naming_the_file_and_the_fix(tmp_path, edit, named):
    folder = _written(tmp_path, edit)
    with pytest.raises(UsageError) as caught:
        read_head_to_head(folder)
    message = caught.value.message
    assert str(folder / HEAD_TO_HEAD_JSON) in message and named in message, message
    assert message.endswith("re-run the `dflash-doctor check --draft A --draft B ...` that wrote it.")
    assert message.count(". ") == 0  # one sentence


def test_a_folder_without_the_file_and_a_file_that_is_not_json_are_refused(tmp_path):
    with pytest.raises(UsageError, match="holds no head_to_head.json; pass a folder written by"):
        read_head_to_head(tmp_path)
    (tmp_path / HEAD_TO_HEAD_JSON).write_text("{not json", encoding="utf-8")
    with pytest.raises(UsageError, match="is not valid JSON"):
        read_head_to_head(tmp_path)


def test_a_head_to_head_without_sub_run_facts_keeps_its_layout():
    """A speculator whose sub-run had no run.json carries no sub-run facts (and its verdict no settings): the
    typed value leaves those keys out again instead of writing them as null."""
    data = json.loads((FIXTURE / HEAD_TO_HEAD_JSON).read_text(encoding="utf-8"))
    bare = copy.deepcopy(data)
    for speculator in bare["speculators"]:
        for key in list(speculator)[4:]:
            del speculator[key]
    for scope in bare["scopes"].values():
        for key in ("settings", "settings_k", "draft_shown"):
            scope["verdict"].pop(key)
    typed = HeadToHead.from_json(bare)
    assert all(s.sub_run is None for s in typed.speculators) and typed.scopes["overall"].verdict.deploy is None
    assert typed.to_json() == bare and json.dumps(typed.to_json()) == json.dumps(bare)
