"""Config files in the working directory and NaN gates: a doctor.toml or pyproject.toml in the
folder the tool runs in (a cloned repository) may not send the user's key anywhere, replace files outside the
run, or switch a gate off with a non-finite or unknown threshold. One row per break; every refused row also
asserts that a recording server got nothing and that a folder the file aimed at kept its file."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import re

import pytest
import typer
from typer.testing import CliRunner

from cli_helpers import assert_usage_error, invoke
from recording_server import recording_server
from dflash_doctor.cli.log_setup import OURS
from dflash_doctor.checks.base import get_check, make_check, registered_ids
from dflash_doctor.cli.options import config_command
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.config import THRESHOLDS, DoctorConfig, build_config

SECRET = "sk-USER-hostile-config-0123456789"
PYPROJECT = '[project]\nname = "cloned"\n[tool.dflash-doctor]\n'


@pytest.fixture
def cloned_repo(tmp_path, monkeypatch):
    """A cloned repository as the working directory, the user's own config folder beside it, OPENAI_API_KEY
    set, and a folder outside the repository holding a file the user cares about."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "report.md").write_text("precious\n")
    monkeypatch.chdir(repo)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "user-config"))
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    for name in ("DFLASH_DOCTOR_CONFIG", "DFLASH_DOCTOR_TARGET", "DFLASH_DOCTOR_DRAFT"):
        monkeypatch.delenv(name, raising=False)
    ours = logging.getLogger(OURS)  # the default verbosity, whatever -q an earlier test of this process passed
    level = ours.level
    ours.setLevel(logging.WARNING)
    yield repo
    ours.setLevel(level)


# (break, file written relative to the repository, its text ({url}: the recording server), flags, sentence fragments)
REFUSED = [
    (
        "C1 engine in ./doctor.toml",
        "doctor.toml",
        'engine = "{url}"\nmax_requests = 1\nmax_new_tokens = 4\nout = "./escaped"\n',
        [],
        ["doctor.toml sets engine", "--engine"],
    ),
    (
        "C1 engine in ./pyproject.toml",
        "pyproject.toml",
        PYPROJECT + 'engine = "{url}"\nmax_requests = 1\n',
        [],
        ["pyproject.toml sets engine", "--engine"],
    ),
    ("C1 engine even beside the flag", "doctor.toml", 'engine = "{url}"\n', ["--engine", "{url}"], ["sets engine"]),
    (
        "C1 engine in a --config file outside the user folder",
        "../mine.toml",
        'engine = "{url}"\n',
        ["--config", "../mine.toml"],
        ["mine.toml sets engine"],
    ),
    (
        "C2 out + overwrite",
        "doctor.toml",
        'out = "../victim"\noverwrite = true\n',
        ["--engine", "{url}"],
        ["doctor.toml sets overwrite", "--overwrite"],
    ),
    (
        "C2 the file's out with the flag --overwrite",
        "doctor.toml",
        'out = "../victim"\n',
        ["--engine", "{url}", "--overwrite"],
        ["doctor.toml sets out", "--out"],
    ),
    (
        "C2 out + overwrite in pyproject",
        "pyproject.toml",
        PYPROJECT + 'out = "../victim"\noverwrite = true\n',
        ["--engine", "{url}"],
        ["sets overwrite"],
    ),
    (
        "C3 tau_fail_below = nan",
        "doctor.toml",
        "[checks.acceptance]\ntau_fail_below = nan\ntau_warn_below "
        "= nan\nconditional_rate_floor = nan\nmin_drafts = 1\n",
        ["--engine", "{url}"],
        ["'acceptance' parameter 'tau_fail_below' nan", "finite"],
    ),
    (
        "C3 tau_warn_below = inf",
        "doctor.toml",
        "[checks.acceptance]\ntau_warn_below = inf\n",
        ["--engine", "{url}"],
        ["'tau_warn_below' inf"],
    ),
    (
        "C3 a negative count",
        "doctor.toml",
        "[checks.acceptance]\nmin_drafts = -5\n",
        ["--engine", "{url}"],
        ["'min_drafts' -5", ">= 0"],
    ),
    (
        "C3 nan in pyproject",
        "pyproject.toml",
        PYPROJECT + "[tool.dflash-doctor.checks.speculative-k]\nslot_rate_floor = -inf\n",
        ["--engine", "{url}"],
        ["'slot_rate_floor' -inf"],
    ),
    (
        "C4 unknown threshold keys",
        "pyproject.toml",
        PYPROJECT + "[tool.dflash-doctor.thresholds]\ntau = nan\nacceptance_fail_tau = nan\n",
        ["--engine", "{url}"],
        ["[thresholds] has no key 'tau'", "strict_max_k"],
    ),
    (
        "C4 strict_max_k = 0",
        "doctor.toml",
        "[thresholds]\nstrict_max_k = 0\n",
        ["--engine", "{url}"],
        ["[thresholds] strict_max_k 0"],
    ),
    (
        "C4 strict_max_k = 2.5",
        "doctor.toml",
        "[thresholds]\nstrict_max_k = 2.5\n",
        ["--engine", "{url}"],
        ["strict_max_k 2.5", "integer"],
    ),
    (
        "C4 conservative_share = nan",
        "doctor.toml",
        "[thresholds]\nconservative_share = nan\n",
        ["--engine", "{url}"],
        ["conservative_share nan"],
    ),
    (
        "C4 conservative_share = 1.5",
        "doctor.toml",
        "[thresholds]\nconservative_share = 1.5\n",
        ["--engine", "{url}"],
        ["conservative_share 1.5", "<= 1"],
    ),
]


@pytest.mark.parametrize(("name", "file", "text", "flags", "fragments"), REFUSED, ids=[row[0] for row in REFUSED])
def test_a_hostile_config_file_is_refused_before_anything_is_sent(cloned_repo, name, file, text, flags, fragments):
    with recording_server() as (url, received):
        (cloned_repo / file).write_text(text.replace("{url}", url))
        result = invoke("check", *(flag.replace("{url}", url) for flag in flags), "--max-requests", "1")
    assert_usage_error(result, *fragments)
    assert received == [], f"{name}: the server got {received}"
    assert SECRET not in result.output
    assert (cloned_repo.parent / "victim" / "report.md").read_text() == "precious\n"
    assert not (cloned_repo / "escaped").exists()


def _probe_app() -> tuple[typer.Typer, list[DoctorConfig]]:
    """A command declared like check's, recording the DoctorConfig it is handed (no work, no request)."""
    seen: list[DoctorConfig] = []
    probe = typer.Typer()

    @probe.command()
    @config_command("engine", "out", "overwrite", "max_new_tokens")
    def run(config: DoctorConfig) -> None:
        seen.append(config)

    return probe, seen


def test_the_user_config_folder_may_set_the_guarded_keys_and_the_terminal_names_the_file(cloned_repo):
    folder = cloned_repo.parent / "user-config" / "dflash-doctor"
    folder.mkdir(parents=True)
    (folder / "doctor.toml").write_text('engine = "http://127.0.0.1:9"\nout = "../victim"\noverwrite = true\n')
    probe, seen = _probe_app()
    result = CliRunner().invoke(probe, [])
    assert result.exit_code == 0, result.output
    assert (seen[-1].engine, seen[-1].out, seen[-1].overwrite) == ("http://127.0.0.1:9", "../victim", True)
    assert f"settings read from {folder / 'doctor.toml'}" in result.stderr


@pytest.mark.parametrize(
    ("text", "flags", "expected"),
    [
        ('out = "runs/ci"\nmax_new_tokens = 5\n', [], ("runs/ci", False, 5)),  # out alone: a new or empty folder only
        ('out = "runs/ci"\n', ["--out", "mine", "--overwrite"], ("mine", True, 128)),  # the file's out is not used
        ("overwrite = false\n", [], (None, False, 128)),  # a guarded key switched off asks for nothing
    ],
)
def test_a_working_directory_file_keeps_its_harmless_settings_and_is_named(cloned_repo, text, flags, expected):
    (cloned_repo / "doctor.toml").write_text(text)
    probe, seen = _probe_app()
    result = CliRunner().invoke(probe, flags)
    assert result.exit_code == 0, result.output
    assert (seen[-1].out, seen[-1].overwrite, seen[-1].max_new_tokens) == expected
    assert f"settings read from {cloned_repo / 'doctor.toml'}" in result.stderr


def test_no_config_file_prints_no_settings_line(cloned_repo):
    probe, _ = _probe_app()
    assert "settings read from" not in CliRunner().invoke(probe, []).stderr


# ------------------------------------------------------------------------------------------- fuzzed numbers


def _number_fields(check_id: str) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(get_check(check_id)) if f.type in ("int", "float", int, float)]


def _hostile(rng: random.Random, integer: bool) -> int | float:
    """A number that would switch a check's gate off: non-finite (floats only: TOML ints are finite) or negative."""
    if not integer and rng.random() < 0.5:
        return rng.choice([math.nan, math.inf, -math.inf])
    return -rng.randint(1, 10**12) if integer else -rng.uniform(1e-9, 1e9)


FUZZ_CASES = 400


def test_fuzzed_check_parameters_are_refused_when_hostile_and_kept_when_fair():
    """Seeded: every numeric parameter of every registered check, a hostile value refused (naming the check and
    the parameter) and a fair one accepted; the defaults themselves pass the rule."""
    rng = random.Random(49)
    fields = [(check_id, f) for check_id in registered_ids() for f in _number_fields(check_id)]
    assert len(fields) > 20
    for check_id in registered_ids():
        make_check(check_id, {f.name: f.default for f in _number_fields(check_id)})
    for _ in range(FUZZ_CASES // 2):
        check_id, f = rng.choice(fields)
        integer = f.type in ("int", int)
        value = _hostile(rng, integer)
        with pytest.raises(UsageError, match=re.escape(f"check {check_id!r} parameter {f.name!r}")):
            make_check(check_id, {f.name: value})
        fair = rng.randint(0, 1000) if integer else rng.uniform(0, 1000)
        assert getattr(make_check(check_id, {f.name: fair}), f.name) == fair


def test_fuzzed_thresholds_are_refused_out_of_range_or_unknown():
    """Seeded: each [thresholds] key with a value outside its range, and made-up keys, refused; values inside
    kept."""
    rng = random.Random(4949)
    for _ in range(FUZZ_CASES // 4):
        key = rng.choice(list(THRESHOLDS))
        bounds = THRESHOLDS[key]
        low = bounds.get("minimum", bounds.get("above"))
        bad = rng.choice(
            [math.nan, math.inf, -math.inf, low - rng.uniform(0.001, 1e6), bounds["maximum"] + rng.uniform(0.001, 1e6)]
        )
        with pytest.raises(UsageError, match=re.escape(f"[thresholds] {key}")):
            build_config(None, thresholds={key: bad})
        good = (
            rng.randint(max(1, int(low)), int(bounds["maximum"]))
            if bounds.get("integer")
            else rng.uniform(low, bounds["maximum"])
        )
        if good > low or "minimum" in bounds:
            assert build_config(None, thresholds={key: good}).thresholds[key] == good
        unknown = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(1, 20)))
        if unknown not in THRESHOLDS:
            with pytest.raises(UsageError, match="has no key"):
                build_config(None, thresholds={unknown: 1.0})
