"""Readers of a run directory against damaged or hostile files (the class "dashboard and readers").

run.json is typed once where it is read (:meth:`RunRecord.from_json` via ``read_run_meta``): a field of another
type, a null where the type is not Optional, a NaN or an integer past int64 is one sentence naming the file and
the field, exit 2. The Parquet tables are checked against their declared columns and types. A seeded fuzz loop
mutates every field path of a fixture run and drives ``compare``, ``report`` and ``watch --baseline`` in process:
exit 0, 1 or 2 only, never 70 (a crash) and never a traceback.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import pytest

from cli_helpers import assert_usage_error, invoke
from fixture_runs import make_fixture_run

WATCH_SOURCE = Path(__file__).parent / "data" / "telemetry" / "vllm_responses_good.jsonl"
FUZZ_SEED = 49
ALLOWED_EXITS = {0, 1, 2}


@pytest.fixture(scope="module")
def good_runs(tmp_path_factory) -> tuple[Path, Path]:
    """A fixture run with a sweep and recommendations (every section of run.json filled), and a second run."""
    root = tmp_path_factory.mktemp("hostile-readers")
    return make_fixture_run(root / "good", num_requests=6), make_fixture_run(root / "other", num_requests=6, seed=1)


def _copy_with(run: Path, dest: Path, change) -> Path:
    """A copy of ``run`` at ``dest`` whose run.json went through ``change`` (a function editing the dict)."""
    shutil.copytree(run, dest)
    meta = json.loads((dest / "run.json").read_text())
    change(meta)
    (dest / "run.json").write_text(json.dumps(meta))
    return dest


def _set(path: tuple, value: Any):
    def change(meta: dict) -> None:
        node = meta
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


def _commands(base: Path, run: Path, out: Path) -> dict[str, list]:
    """The three readers of a run directory the probe crashed, with ``run`` as the damaged one."""
    return {
        "compare": ["compare", base, run],
        "report": ["report", run, "--format", "md,json,junit", "--out", out / "report"],
        "watch": [
            "watch",
            WATCH_SOURCE,
            "--once",
            "--window",
            "1h",
            "--min-drafts",
            "1",
            "--baseline",
            run,
            "--out",
            out / "watch",
        ],
    }


# ----------------------------------------------------------------------------- the probe's three null fields


@pytest.mark.parametrize(
    "command, path, field",
    [
        ("compare", ("models", "target", "revision_or_hash"), "models.target.revision_or_hash"),
        ("report", ("created_at",), "created_at"),
        ("watch", ("summary", "overall", "acceptance_rate_per_pos"), "summary.overall.acceptance_rate_per_pos"),
    ],
)
def test_a_null_field_is_one_sentence_naming_the_file_and_the_field(good_runs, tmp_path, command, path, field):
    good, _ = good_runs
    bad = _copy_with(good, tmp_path / "bad", _set(path, None))
    result = invoke(*_commands(good, bad, tmp_path)[command])
    assert_usage_error(result, "run.json", field, "is null")


def test_a_nan_or_a_huge_integer_is_refused_with_its_path(good_runs, tmp_path):
    good, _ = good_runs
    nan = _copy_with(good, tmp_path / "nan", _set(("summary", "overall", "mean_acceptance_length"), float("nan")))
    assert_usage_error(invoke("compare", good, nan), "summary.overall.mean_acceptance_length", "not a finite number")
    huge = _copy_with(good, tmp_path / "huge", _set(("summary", "overall", "num_drafts"), 10**30))
    assert_usage_error(invoke("report", huge, "--format", "md", "--out", tmp_path / "r"), "summary.overall.num_drafts")


# ----------------------------------------------------------------------------- Parquet tables


@pytest.mark.parametrize("table", ["requests", "steps", "tokens"])
@pytest.mark.parametrize("command", ["report", "compare"])
def test_a_parquet_table_with_other_columns_names_the_missing_column(good_runs, tmp_path, table, command):
    good, _ = good_runs
    bad = shutil.copytree(good, tmp_path / "bad")
    pd.DataFrame({"a": [1, 2]}).to_parquet(bad / f"{table}.parquet")
    result = invoke(*_commands(good, bad, tmp_path)[command])
    assert_usage_error(result, f"{table}.parquet", "request_id")


_DAMAGED_TABLES = {
    "text where a count belongs": ("steps", lambda f: f.assign(num_accepted=f["num_accepted"].astype(str))),
    "a count past the column's width": ("steps", lambda f: f.assign(k=f["k"].astype("int64") + 10**6)),
    "floats where integers belong": ("requests", lambda f: f.assign(num_drafts=f["num_drafts"] + 0.5)),
    "a list column as text": ("requests", lambda f: f.assign(output_token_ids="[1, 2]")),
    "booleans as integers": ("tokens", lambda f: f.assign(accepted=f["accepted"].astype(int) * 7)),
    "no rows and other columns": ("tokens", lambda f: pd.DataFrame({"request_id": pd.Series([], dtype=str)})),
}


@pytest.mark.parametrize("name", list(_DAMAGED_TABLES))
def test_a_damaged_parquet_table_is_one_sentence(good_runs, tmp_path, name):
    good, _ = good_runs
    table, damage = _DAMAGED_TABLES[name]
    bad = shutil.copytree(good, tmp_path / "bad")
    damage(pd.read_parquet(bad / f"{table}.parquet")).to_parquet(bad / f"{table}.parquet")
    for command in ("report", "compare"):
        result = invoke(*_commands(good, bad, tmp_path)[command])
        assert_usage_error(result, f"{table}.parquet")


# ----------------------------------------------------------------------------- the fuzz loop


def _paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every field path of a JSON value, containers and leaves."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield (*prefix, key)
        yield from _paths(item, (*prefix, key))


#: The mutations of one field: null, other types, non-finite and huge numbers, nested containers.
MUTATIONS = [
    None,
    "x",
    "",
    7,
    -1,
    True,
    2.5,
    float("nan"),
    float("inf"),
    10**30,
    1e308,
    [],
    [[1, "x"]],
    {},
    {"a": {"b": None}},
]
#: One class stands for the others (the fixture's classes are math, code and chat), and a list's first item for
#: its other items: the fuzz then reaches every kind of field (about 120 paths) in a few hundred cases.
_REPEATS = {"math", "code"}


def _fuzz_cases(meta: dict) -> list[tuple[tuple, Any]]:
    """Every distinct field path of ``meta`` set to null, and to one other mutation drawn with a fixed seed."""
    rng = random.Random(FUZZ_SEED)
    paths = [
        p
        for p in _paths(meta)
        if p[0] != "schema_version"  # another version is its own sentence
        and not any(key in _REPEATS or (isinstance(key, int) and key > 0) for key in p)
    ]
    return [case for path in paths for case in ((path, None), (path, rng.choice(MUTATIONS[1:])))]


def test_fuzzed_run_json_never_crashes_a_reader(good_runs, tmp_path):
    good, other = good_runs
    meta = json.loads((good / "run.json").read_text())
    bad = shutil.copytree(good, tmp_path / "bad")
    exits: dict[int, int] = {}
    cases = _fuzz_cases(meta)
    for index, (path, value) in enumerate(cases):
        mutated = json.loads(json.dumps(meta))
        _set(path, value)(mutated)
        (bad / "run.json").write_text(json.dumps(mutated))  # NaN and Infinity as JSON's non-standard literals
        command = list(_commands(other, bad, tmp_path / f"out{index}").values())[index % 3]
        result = invoke(*command)
        where = f"{command[0]} with {'.'.join(map(str, path))} = {value!r}"
        assert result.exit_code in ALLOWED_EXITS, f"{where}: exit {result.exit_code}\n{result.output}"
        assert "Traceback" not in result.output, where
        exits[result.exit_code] = exits.get(result.exit_code, 0) + 1
    assert len(cases) > 200 and exits.get(2, 0) > len(cases) // 2, exits  # most mutations are refused at the boundary
    assert exits.get(0, 0) + exits.get(1, 0) > 0, exits  # and values of the right type still read
