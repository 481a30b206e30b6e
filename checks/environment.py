"""environment: library versions, the GPU, the serving engine's flags, and known incompatibilities.

Acceptance can collapse with nothing wrong in the models: a draft attention backend that cannot do
DFlash's non-causal block attention, K counted in the other engine's convention, a kernel bug under CUDA
graphs, a transformers release that reads the draft's config differently. Those facts are collected here
and matched against ``rules.toml``, a data file of known incompatibilities with their source threads
(docs/draft-formats.md, docs/troubleshooting.md). :func:`dflash_doctor.inputs.machine.collect_environment` collects them
(run.json ``environment``).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from dflash_doctor.checks.base import SEVERITIES, Check, CheckContext, CheckResult, Finding, register
from dflash_doctor.checks.draft_facts import block_size, is_dflash
from dflash_doctor.errors import UsageError

MATCHER_OPS = ("eq", "ne", "gt", "ge", "lt", "le", "in", "not_in", "version", "exists")


def _minor(version: str | None) -> str | None:
    try:
        parsed = Version(str(version))
    except InvalidVersion:
        return None
    return f"{parsed.major}.{parsed.minor}"


def build_facts(ctx: CheckContext) -> dict[str, Any]:
    """Flatten the context into the ``env.* / draft.* / engine.*`` facts that rules test (None = unknown)."""
    facts: dict[str, Any] = {f"env.{k}": v for k, v in (ctx.environment or {}).items()}
    facts["env.transformers_minor"] = _minor(facts.get("env.transformers"))
    draft_config = ctx.draft_config or {}
    dflash = is_dflash(ctx)
    facts["draft.kind"] = "dflash" if dflash else (ctx.draft_kind or ("autoregressive" if draft_config else None))
    block = block_size(draft_config) if dflash else None
    facts["draft.block_size"] = block
    facts["draft.block_size_minus_one"] = None if block is None else block - 1
    facts["draft.transformers_version"] = draft_config.get("transformers_version")
    facts["draft.transformers_minor"] = _minor(draft_config.get("transformers_version"))
    for key, value in (ctx.engine_config or {}).items():
        facts[f"engine.{key}"] = value
    return {k: v for k, v in facts.items() if v is not None}


@dataclass(frozen=True)
class Rule:
    """One known incompatibility from rules.toml: when every condition holds, emit a finding."""

    id: str
    severity: str
    message: str
    fix: str
    source: str
    when: dict[str, Any]

    def applies(self, facts: dict[str, Any]) -> bool:
        return all(_matches(facts, fact, matcher) for fact, matcher in self.when.items())

    def finding(self, facts: dict[str, Any]) -> Finding:
        return Finding(
            self.severity, _fill(self.message, facts), f"rule {self.id}; source: {self.source}", _fill(self.fix, facts)
        )


def _fill(text: str, facts: dict[str, Any]) -> str:
    return re.sub(r"\{([a-z_]+\.[a-z_]+)\}", lambda m: str(facts.get(m.group(1), m.group(0))), text)


def _resolve(facts: dict[str, Any], value: Any) -> Any:
    """A "@fact.name" string refers to another fact; anything else is a literal."""
    if isinstance(value, str) and value.startswith("@"):
        return facts.get(value[1:])
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    return a == b


def _matches(facts: dict[str, Any], fact: str, matcher: Any) -> bool:
    present = fact in facts
    if not isinstance(matcher, dict):
        return present and _same(facts[fact], matcher)
    if "exists" in matcher and matcher["exists"] != present:
        return False
    if not present:
        return "exists" in matcher and not matcher["exists"]
    value = facts[fact]
    for op, raw in matcher.items():
        if op == "exists":
            continue
        expected = _resolve(facts, raw)
        if expected is None:
            return False  # compares with an unknown fact: the rule cannot be decided, so it does not apply
        if op == "eq" and not _same(value, expected):
            return False
        if op == "ne" and _same(value, expected):
            return False
        if op in ("in", "not_in"):
            member = any(_same(value, item) for item in expected)
            if member != (op == "in"):
                return False
        if op in ("gt", "ge", "lt", "le"):
            try:
                ok = {"gt": value > expected, "ge": value >= expected, "lt": value < expected, "le": value <= expected}[
                    op
                ]
            except TypeError:
                return False
            if not ok:
                return False
        if op == "version":
            try:
                if Version(str(value)) not in SpecifierSet(expected):
                    return False
            except (InvalidVersion, InvalidSpecifier):
                return False
    return True


def load_rules(path: str | Path | None = None) -> list[Rule]:
    """Read a rules TOML (default: the packaged rules.toml) and validate every rule's shape."""
    if path is None:
        text = resources.files("dflash_doctor.checks").joinpath("rules.toml").read_text(encoding="utf-8")
        where = "rules.toml"
    else:
        path = Path(path)
        if not path.is_file():
            raise UsageError(
                f"rules file {path} does not exist; pass an existing TOML file (see checks/rules.toml for the format)."
            )
        text, where = path.read_text(encoding="utf-8"), str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"rules file {where} is not valid TOML ({exc}); fix the file.") from None
    rules = []
    for entry in data.get("rule", []):
        rule_id = entry.get("id", "?")
        missing = [k for k in ("id", "severity", "message", "fix", "source", "when") if k not in entry]
        if missing:
            raise UsageError(f"rules file {where}: rule {rule_id!r} lacks {', '.join(missing)}; add them.")
        if entry["severity"] not in SEVERITIES:
            raise UsageError(
                f"rules file {where}: rule {rule_id!r} severity "
                f"{entry['severity']!r} is not one of {', '.join(SEVERITIES)}."
            )
        for fact, matcher in entry["when"].items():
            unknown = [op for op in matcher if op not in MATCHER_OPS] if isinstance(matcher, dict) else []
            if unknown:
                raise UsageError(
                    f"rules file {where}: rule {rule_id!r} condition on {fact} uses "
                    f"unknown operator {unknown[0]!r}; use one of {', '.join(MATCHER_OPS)}."
                )
        rules.append(Rule(**{k: entry[k] for k in ("id", "severity", "message", "fix", "source", "when")}))
    return rules


@register
@dataclass(frozen=True)
class EnvironmentCheck(Check):
    """The environment and the engine flags match no known incompatibility (rules.toml).

    Fails or warns per the matching rules' severities: SGLang trtllm_mha for a DFlash draft, K in the
    other engine's convention or beyond the block, FlashInfer non-causal under CUDA graphs, a
    transformers version other than the one the draft was saved with, and so on.
    """

    id = "environment"
    title = "Environment and engine flags"
    needs = ("environment",)

    extra_rules_file: str | None = None  # a TOML file of more rules, same format as checks/rules.toml

    def run(self, ctx: CheckContext) -> CheckResult:
        rules = load_rules()
        if self.extra_rules_file:
            rules += load_rules(self.extra_rules_file)
        facts = build_facts(ctx)
        matched = [rule for rule in rules if rule.applies(facts)]
        findings = [rule.finding(facts) for rule in matched]
        metrics = {"facts": facts, "num_rules": len(rules), "matched_rules": [rule.id for rule in matched]}
        env = ctx.environment or {}
        summary = (
            f"no known incompatibility ({len(rules)} rules; torch "
            f"{env.get('torch')}, transformers {env.get('transformers')})"
        )
        return CheckResult.from_findings(self.id, findings, metrics, summary)
