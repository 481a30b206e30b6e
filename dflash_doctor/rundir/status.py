"""Check outcomes: the one status vocabulary, findings, results, and the one verdict rule.

A check ends in a :class:`CheckResult` with one :class:`Status`; a run's verdict is
:func:`overall_status` of its checks. The CLI exit code, report.json / .md / .html / junit, the
terminal and the dashboard all rank statuses through this module, so one run never shows two
verdicts. It has no dependencies, so the run record and light views (reports, the dashboard) use it
without loading the checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Iterable


class Status(StrEnum):
    """A check's outcome, declared in the order reports list status counts (pass, warn, fail, skip, error).

    :data:`STATUS_RANK` is the one order views sort and rank by, worst first. ``error`` (the check crashed) ranks just
    below ``fail``: a setup nobody could verify is not healthy. ``skip`` (inputs absent) never decides a verdict.
    ``VERDICT_NONE`` is not a check status; it is the verdict of a run
    that recorded no decided check (replay and sweep runs have none).
    """

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"


STATUSES = tuple(s.value for s in Status)
STATUS_RANK = (Status.FAIL, Status.ERROR, Status.WARN, Status.PASS, Status.SKIP)  # worst first
DECIDED = STATUS_RANK[:4]  # skip never decides a verdict
VERDICT_NONE = "none"


def overall_status(statuses: Iterable[str]) -> str:
    """The ONE verdict of a run: the worst decided status (fail > error > warn > pass), ``"none"`` when
    no check decided anything. The exit code, every report format, the terminal and the dashboard
    all call this; nothing else ranks statuses."""
    present = set(statuses)
    for status in DECIDED:
        if status in present:
            return status.value
    return VERDICT_NONE


def status_counts(statuses: Iterable[str]) -> dict[str, int]:
    """How many checks ended in each status, in :class:`Status` order (every status present, zeros included)."""
    statuses = list(statuses)
    return {status: statuses.count(status) for status in STATUSES}


SEVERITIES = ("info", "warn", "fail")


@dataclass
class Finding:
    """One observation: what is wrong (or worth knowing), the evidence, and how to fix it."""

    severity: str  # info | warn | fail
    message: str
    evidence: str = ""
    fix: str = ""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"finding severity {self.severity!r} is not one of {SEVERITIES}")

    def to_dict(self) -> dict[str, str]:
        return {"severity": self.severity, "message": self.message, "evidence": self.evidence, "fix": self.fix}


@dataclass
class CheckResult:
    """The outcome of one check, in the run.json ``checks`` form (see :meth:`to_dict`)."""

    id: str
    status: str
    summary: str
    metrics: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check status {self.status!r} is not one of {STATUSES}")

    @classmethod
    def from_findings(
        cls, check_id: str, findings: list[Finding], metrics: dict[str, Any], pass_summary: str
    ) -> "CheckResult":
        """Status = the worst finding's severity; summary = that finding's message (or ``pass_summary``).

        One rule for every check keeps verdicts comparable: any ``fail`` finding fails the check, any
        ``warn`` warns, ``info`` findings never change the status.
        """
        worst = worst_severity(findings)
        if worst in ("fail", "warn"):
            first = next(f for f in findings if f.severity == worst)
            others = sum(1 for f in findings if f.severity in ("fail", "warn")) - 1
            summary = first.message + (f" (+{others} more)" if others else "")
            return cls(check_id, worst, summary, metrics, findings)
        return cls(check_id, "pass", pass_summary, metrics, findings)

    @property
    def fix(self) -> str:
        """The fix of the most severe finding, for one-line views (the terminal table)."""
        for severity in ("fail", "warn", "info"):
            for finding in self.findings:
                if finding.severity == severity and finding.fix:
                    return finding.fix
        return ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": self.status,
            "summary": self.summary,
            "metrics": dict(self.metrics),
            "findings": [f.to_dict() for f in self.findings],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CheckResult":
        """Inverse of :meth:`to_dict` (run.json ``checks`` entries)."""
        findings = [Finding(**f) for f in data.get("findings") or []]
        return cls(data["id"], data["status"], data["summary"], dict(data.get("metrics") or {}), findings)


def worst_severity(findings: Iterable[Finding]) -> str | None:
    """The most severe severity among ``findings`` (fail > warn > info), None when there are none."""
    ranks = {"info": 0, "warn": 1, "fail": 2}
    worst = None
    for finding in findings:
        if worst is None or ranks[finding.severity] > ranks[worst]:
            worst = finding.severity
    return worst
