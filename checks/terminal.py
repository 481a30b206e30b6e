"""The terminal view of check results: one table (status, check, summary, fix), then the evidence."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dflash_doctor.checks.base import CheckResult
from dflash_doctor.status import VERDICT_NONE, overall_status

STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim", "error": "magenta", VERDICT_NONE: "dim"}


def print_check_results(results: list[CheckResult], console: Console) -> None:
    """Print one row per check, the warn/fail findings with their evidence (never the info ones), then the verdict."""
    table = Table(show_lines=False)
    for column in ("status", "check", "summary", "fix"):
        table.add_column(column, overflow="fold")
    for result in results:
        style = STATUS_STYLE[result.status]
        table.add_row(f"[{style}]{result.status}[/]", result.id, escape(result.summary), escape(result.fix))
    console.print(table)
    for result in results:
        for finding in result.findings:
            if finding.severity == "info":
                continue
            console.print(f"[{STATUS_STYLE[finding.severity]}]{finding.severity}[/] {result.id}: {escape(finding.message)}")
            if finding.evidence:
                console.print(f"    evidence: {escape(finding.evidence)}", soft_wrap=True)
    verdict = overall_status(r.status for r in results)
    console.print(f"verdict: [{STATUS_STYLE[verdict]}]{verdict.upper()}[/]")
