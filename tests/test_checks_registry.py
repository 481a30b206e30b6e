"""The check registry and runner: registration, lookup, skip / error handling, params, exit codes."""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash_doctor.checks import (
    CheckContext,
    CheckResult,
    Finding,
    Need,
    exit_code,
    get_check,
    register,
    registered_ids,
    run_checks,
)
from dflash_doctor.checks import base
from dflash_doctor.errors import UsageError


@pytest.fixture
def scratch_registry():
    """Register throwaway checks without leaking them into other tests (or the meta-test)."""
    saved = dict(base._REGISTRY)
    yield
    base._REGISTRY.clear()
    base._REGISTRY.update(saved)


def _define(check_id: str, body, needs=()):
    @dataclass(frozen=True)
    class Dummy(base.Check):
        threshold: float = 1.0

        def run(self, ctx):
            return body(self, ctx)

    Dummy.id, Dummy.needs = check_id, needs
    return Dummy


def test_register_refuses_a_duplicate_id(scratch_registry):
    register(_define("dummy-a", lambda self, ctx: None))
    with pytest.raises(ValueError, match="already registered"):
        register(_define("dummy-a", lambda self, ctx: None))


def test_unknown_id_suggests_the_closest():
    with pytest.raises(UsageError, match="did you mean 'tokenizer-parity'"):
        get_check("tokenizer-parit")
    with pytest.raises(UsageError, match="did you mean 'environment'"):
        run_checks(CheckContext(), only=["enviroment"])


def test_missing_needs_skip_and_a_raising_check_errors_while_others_run(scratch_registry):
    register(
        _define(
            "dummy-needs",
            lambda self, ctx: CheckResult("dummy-needs", "pass", "ok"),
            needs=("draft_config", "target_tokenizer|target_template"),
        )
    )

    def boom(self, ctx):
        raise RuntimeError("exploded on purpose")

    register(_define("dummy-boom", boom))
    register(_define("dummy-ok", lambda self, ctx: CheckResult("dummy-ok", "pass", f"threshold {self.threshold}")))
    results = {
        r.id: r
        for r in run_checks(
            CheckContext(draft_config={"a": 1}),
            only=["dummy-needs", "dummy-boom", "dummy-ok"],
            params={"dummy-ok": {"threshold": 2.5}},
        )
    }
    assert results["dummy-needs"].status == "skip"
    assert "target_tokenizer or target_template" in results["dummy-needs"].summary
    assert results["dummy-boom"].status == "error" and "exploded on purpose" in results["dummy-boom"].summary
    assert results["dummy-ok"].status == "pass" and results["dummy-ok"].summary == "threshold 2.5"


def test_skip_list_and_config_file_params(scratch_registry):
    register(_define("dummy-ok", lambda self, ctx: CheckResult("dummy-ok", "pass", f"threshold {self.threshold}")))

    class Config:
        checks = {"dummy-ok": {"threshold": 7.0}}

    results = run_checks(CheckContext(config=Config()), only=["dummy-ok"])
    assert results[0].summary == "threshold 7.0"
    assert run_checks(CheckContext(), only=["dummy-ok"], skip=["dummy-ok"]) == []
    with pytest.raises(UsageError, match="no parameter 'treshold'.*did you mean 'threshold'"):
        run_checks(CheckContext(), only=["dummy-ok"], params={"dummy-ok": {"treshold": 1}})


def test_status_follows_the_worst_finding_and_to_dict_matches_run_json():
    findings = [
        Finding("info", "note"),
        Finding("warn", "careful", "ev", "do x"),
        Finding("fail", "broken", "ev2", "do y"),
    ]
    result = CheckResult.from_findings("x", findings, {"m": 1}, "all good")
    assert result.status == "fail" and result.summary == "broken (+1 more)" and result.fix == "do y"
    assert CheckResult.from_findings("x", findings[:1], {}, "all good").status == "pass"
    as_dict = result.to_dict()
    assert set(as_dict) == {"id", "status", "summary", "metrics", "findings"}
    assert as_dict["findings"][1] == {"severity": "warn", "message": "careful", "evidence": "ev", "fix": "do x"}


def test_exit_code_follows_fail_on():
    warn, fail = CheckResult("a", "warn", "w"), CheckResult("b", "fail", "f")
    assert exit_code([warn]) == 0
    assert exit_code([warn], fail_on="warn") == 1
    assert exit_code([warn, fail]) == 1
    assert exit_code([CheckResult("c", "skip", "s")], fail_on="warn") == 0


def test_every_registered_check_has_pass_warn_and_fail_tests():
    """Meta-test: each check id needs test functions test_<id>_pass / _warn / _fail in tests/test_checks*.py, or,
    for a check of one draft kind, beside that kind's tests in tests/test_speculators_*.py."""
    folder = Path(__file__).parent
    sources = "\n".join(
        p.read_text(encoding="utf-8") for p in [*folder.glob("test_checks*.py"), *folder.glob("test_speculators_*.py")]
    )
    missing = []
    for check_id in registered_ids():
        slug = check_id.replace("-", "_")
        for outcome in ("pass", "warn", "fail"):
            if not re.search(rf"def test_{slug}_{outcome}\w*\(", sources):
                missing.append(f"test_{slug}_{outcome}")
    assert registered_ids(), "no checks registered"
    assert not missing, f"registered checks without tests: {missing}"


def test_every_need_is_a_path_of_typed_fields():
    """Each need walks dataclass fields from CheckContext (``record.probes.lossless``): a renamed record field
    fails here and in the type checker, instead of leaving a check that silently skips."""
    for check_id in registered_ids():
        for need in get_check(check_id).needs:
            for path in (need.path if isinstance(need, Need) else need).split("|"):
                kind: typing.Any = CheckContext
                for name in path.split("."):
                    hints = typing.get_type_hints(kind)
                    assert name in hints, f"{check_id} needs {path!r}, but {kind.__name__} has no field {name!r}"
                    kind = next((a for a in typing.get_args(hints[name]) if a is not type(None)), hints[name])


def test_a_need_with_its_own_sentence_skips_in_those_words_and_a_dotted_need_names_its_path(scratch_registry):
    register(
        _define(
            "worded",
            lambda self, ctx: CheckResult("worded", "pass", "ok"),
            needs=(Need("record.probes.lossless", "no comparison ran"),),
        )
    )
    register(
        _define("dotted", lambda self, ctx: CheckResult("dotted", "pass", "ok"), needs=("record.probes.prompt_format",))
    )
    worded, dotted = run_checks(CheckContext(), only=["worded", "dotted"])
    assert (worded.status, worded.summary) == ("skip", "skipped: no comparison ran")
    assert (dotted.status, dotted.summary) == ("skip", "skipped: needs record.probes.prompt_format")
    assert dotted.metrics == {"missing": ["record.probes.prompt_format"]}
