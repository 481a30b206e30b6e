"""What every exported report says, computed once from a loaded run: the verdict, the per-class
table, the report.json payload. HTML and Markdown only lay these out differently."""

from __future__ import annotations

from typing import Any, Iterable

from dflash_doctor import deviations
from dflash_doctor.schema import Run
from dflash_doctor.status import CheckResult, overall_status, status_counts

OVERALL = "overall"
REPORT_JSON_VERSION = 1


def verdict(checks: Iterable[CheckResult]) -> str:
    """The run's verdict: :func:`dflash_doctor.status.overall_status` of its checks."""
    return overall_status(check.status for check in checks)


def check_counts(checks: Iterable[CheckResult]) -> dict[str, int]:
    return status_counts(check.status for check in checks)


def class_rows(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per class (name order) then overall: the metrics M plus that class's recommendation."""
    summary = meta.get("summary") or {}
    recommendation = meta.get("recommendation") or {}
    by_class = summary.get("by_class") or {}
    named = [(cls, by_class[cls]) for cls in sorted(by_class)] + [(OVERALL, summary.get("overall") or {})]
    rows = []
    for name, metrics in named:
        rates = metrics.get("acceptance_rate_per_pos") or []
        rows.append(
            {
                "class": name,
                "metrics": metrics,
                "rate_first_slot": rates[0] if rates else None,
                "rate_first_slot_ci": (metrics.get("acceptance_rate_per_pos_ci") or [None])[0],
                "recommendation": recommendation.get(name),
            }
        )
    return rows


def incomplete_note(run: Run) -> str | None:
    """The sentence every view shows for a run read from its journal (still going, or stopped hard)."""
    if run.complete:
        return None
    return (
        f"Incomplete run: {len(run.requests)} finished request(s) recorded; the run is still going or was stopped "
        "before it ended (checks, sweep and recommendation are written at the end)."
    )


def report_payload(run: Run) -> dict[str, Any]:
    """report.json: the run's verdict, checks, summary and recommendation with stable, sorted keys.

    It is what CI scripts read (``jq .verdict``), so keys only ever get added, and
    ``report_json_version`` changes if one is renamed or removed.
    """
    meta = run.meta  # the record in its run.json form: report.json repeats it
    return {
        "report_json_version": REPORT_JSON_VERSION,
        "schema_version": run.record.meta.schema_version,
        "tool_version": run.record.meta.tool_version,
        "created_at": run.record.meta.created_at,
        "run": run.name,
        "complete": run.complete,
        "verdict": verdict(run.record.checks),
        "check_counts": check_counts(run.record.checks),
        "checks": meta.get("checks") or [],
        "summary": meta.get("summary") or {},
        "recommendation": meta.get("recommendation") or {},
        "why_rejected": deviations.analyze_run(run),  # deviation patterns per class (dflash_doctor.deviations)
        "models": meta.get("models") or {},
        "environment": meta.get("environment") or {},
        "config": meta.get("config") or {},
    }
