"""What every exported report says, computed once from a loaded run: the verdict, the per-class
table, the report.json payload. HTML and Markdown only lay these out differently."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from dflash_doctor.rundir.run_record import Metrics, Recommendation, RunRecord
from dflash_doctor.rundir.load import Run
from dflash_doctor.rundir.status import CheckResult, overall_status, status_counts
from dflash_doctor.stats.deviations import DeviationAnalysis

REPORT_JSON_VERSION = 1


def verdict(checks: Iterable[CheckResult]) -> str:
    """The run's verdict: :func:`dflash_doctor.rundir.status.overall_status` of its checks."""
    return overall_status(check.status for check in checks)


def check_counts(checks: Iterable[CheckResult]) -> dict[str, int]:
    return status_counts(check.status for check in checks)


@dataclass(frozen=True)
class ClassRow:
    """One line of the reports' class table: a scope's metrics (None when nothing was summarized, so the
    line reads as zero requests) plus the K recommended for it."""

    name: str
    metrics: Metrics | None
    recommendation: Recommendation | None

    @property
    def rate_first_slot(self) -> float | None:
        """r_1: the share of drafts whose first token was accepted."""
        rates = self.metrics.acceptance_rate_per_pos if self.metrics else []
        return rates[0] if rates else None

    @property
    def rate_first_slot_ci(self) -> list[float | None] | None:
        intervals = self.metrics.acceptance_rate_per_pos_ci if self.metrics else []
        return intervals[0] if intervals else None


def class_rows(record: RunRecord) -> list[ClassRow]:
    """One row per class (name order) then overall: the summary's metrics plus that scope's recommendation."""
    return [
        ClassRow(name, metrics, record.recommendation.get(name))
        for name, metrics in record.summary.classes_then_overall()
    ]


def incomplete_note(run: Run) -> str | None:
    """The sentence every view shows for a run read from its journal (still going, or stopped hard) or
    interrupted (Ctrl-C, SIGTERM, SIGHUP)."""
    if run.complete:
        return None
    if run.record.meta.interrupted:
        return (
            f"Interrupted run: {len(run.requests)} finished request(s) recorded; it was stopped (Ctrl-C or a stop "
            "signal) before it ended, so what is written at the end (checks, sweep, recommendation) may be missing."
        )
    return (
        f"Incomplete run: {len(run.requests)} finished request(s) recorded; the run is still going or was stopped "
        "before it ended (checks, sweep and recommendation are written at the end)."
    )


def report_payload(run: Run, analysis: DeviationAnalysis) -> dict[str, Any]:
    """report.json: the run's verdict, checks, summary and recommendation with stable, sorted keys.

    It is what CI scripts read (``jq .verdict``), so keys only ever get added, and
    ``report_json_version`` changes if one is renamed or removed.
    """
    meta = run.meta  # the record in its run.json form (every section present): report.json repeats it
    return {
        "report_json_version": REPORT_JSON_VERSION,
        "schema_version": run.record.meta.schema_version,
        "tool_version": run.record.meta.tool_version,
        "created_at": run.record.meta.created_at,
        "run": run.name,
        "complete": run.complete,
        "verdict": verdict(run.record.checks),
        "check_counts": check_counts(run.record.checks),
        "checks": meta["checks"],
        "summary": meta["summary"],
        "recommendation": meta["recommendation"],
        "why_rejected": analysis.to_json(),  # deviation patterns per class (dflash_doctor.stats.deviations.analyze_run)
        "models": meta["models"],
        "environment": meta["environment"],
        "config": meta["config"],
    }
