"""The terminal view of a run record: tau per class, the K sweep with the recommendation, why the draft
is rejected, the checks with their evidence, and the verdict (:func:`dflash_doctor.rundir.status.overall_status`)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dflash_doctor.rundir.run_record import RunRecord
from dflash_doctor.report.templating import fmt, pct
from dflash_doctor.report.sanitize import for_terminal
from dflash_doctor.rundir.status import VERDICT_NONE, CheckResult, overall_status
from dflash_doctor.stats.deviations import DeviationAnalysis

STATUS_STYLE = {
    "pass": "green",
    "warn": "yellow",
    "fail": "bold red",
    "skip": "dim",
    "error": "magenta",
    VERDICT_NONE: "dim",
}


def print_class_summary(record: RunRecord, k: int, console: Console) -> None:
    """tau per class with its interval at the replayed K: the first thing a user wants to see."""
    table = Table(title=f"Acceptance at K = {k} (tau = mean acceptance length, bonus included)")
    for column in ("class", "requests", "tau", "95% CI", "per-position acceptance (first 5)"):
        table.add_column(column)
    for name, metrics in record.summary.scopes().items():
        tau = metrics.mean_acceptance_length
        lo, hi = metrics.mean_acceptance_length_ci
        rates = ", ".join(f"{r:.2f}" for r in metrics.acceptance_rate_per_pos[:5] if r is not None)
        table.add_row(
            for_terminal(name),
            str(metrics.num_requests),
            f"{tau:.2f}" if tau else "-",
            f"[{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else "-",
            rates,
        )
    console.print(table)


def print_sweep(record: RunRecord, console: Console) -> None:
    """Per-class table: tau and speedup at each K, then the recommended K with its reason."""
    sweep = record.summary.sweep
    if sweep is not None:
        rows_by_group = sweep.scopes()
        table = Table(title="K sweep: tau (bonus included) / net speedup", show_lines=False)
        table.add_column("K", justify="right")
        for group in rows_by_group:
            table.add_column(for_terminal(group), justify="right")
        for row_k in [row.k for row in sweep.overall]:
            cells = []
            for rows in rows_by_group.values():
                row = next((r for r in rows if r.k == row_k), None)
                if row is None or row.mean_acceptance_length is None:
                    cells.append("-")
                    continue
                mark = "" if row.estimate == "exact" else "~"
                tau = row.mean_acceptance_length
                cells.append(f"{mark}{tau:.2f} / {row.speedup:.2f}x" if row.speedup is not None else f"{tau:.2f}")
            table.add_row(str(row_k), *cells)
        console.print(table)
        if any(row.estimate != "exact" for row in sweep.overall):
            console.print("~ = estimated from the largest block (block drafter); --exact-blocks runs each K.")
    rec_table = Table(title="Recommended num_speculative_tokens")
    for column in ("class", "K", "conservative K", "speedup", "why"):
        rec_table.add_column(column)
    for group, item in record.recommendation.items():
        speedup = f"{item.speedup:.2f}x" if item.speedup else "-"
        low, high = item.speedup_ci
        if (
            item.k and low is not None and high is not None
        ):  # off: 1.00x is plain decoding, the best K's interval is in why
            speedup += f" [{low:.2f}, {high:.2f}]"
        rec_table.add_row(
            for_terminal(group), str(item.k), str(item.conservative_k), speedup, for_terminal(item.reason)
        )
    console.print(rec_table)


def print_check_results(results: list[CheckResult], console: Console) -> None:
    """Print one row per check, the warn/fail findings with their evidence (never the info ones), then the verdict."""
    table = Table(show_lines=False)
    for column in ("status", "check", "summary", "fix"):
        table.add_column(column, overflow="fold")
    for result in results:
        style = STATUS_STYLE[result.status]
        table.add_row(
            f"[{style}]{result.status}[/]",
            for_terminal(result.id),
            for_terminal(result.summary),
            for_terminal(result.fix),
        )
    console.print(table)
    for result in results:
        for finding in result.findings:
            if finding.severity == "info":
                continue
            console.print(
                f"[{STATUS_STYLE[finding.severity]}]{finding.severity}[/] "
                f"{for_terminal(result.id)}: {for_terminal(finding.message)}"
            )
            if finding.evidence:
                console.print(f"    evidence: {for_terminal(finding.evidence)}", soft_wrap=True)
    verdict = overall_status(r.status for r in results)
    console.print(f"verdict: [{STATUS_STYLE[verdict]}]{verdict.upper()}[/]")


PATTERNS_PER_CLASS = 3


def _shown(text: str) -> str:
    """Token text with whitespace made visible and markup escaped (token text is untrusted)."""
    return escape(repr(text))


def print_why_rejected(
    analysis: DeviationAnalysis | None, console: Console, per_class: int = PATTERNS_PER_CLASS
) -> None:
    """Why rejected: the costliest first-rejection patterns of each class (:mod:`dflash_doctor.stats.deviations`),
    one line each, then per class the share of lost tokens at confident misses and the attainable tau
    upper bound. report.html / report.md show the full tables."""
    if analysis is None:
        return
    by_class = analysis.by_class
    if not any(summary.top_pairs for summary in by_class.values()):
        return
    table = Table(
        title=f"Why rejected: top {per_class} first-rejection patterns per class, by drafted tokens they threw away"
    )
    for column in (
        "class",
        "target token",
        "drafted instead",
        "category (target / drafted)",
        "times",
        "lost tokens",
        "confident",
    ):
        table.add_column(column, justify="right" if column in ("times", "lost tokens", "confident") else "left")
    for cls, summary in sorted(by_class.items()):
        for index, pair in enumerate(summary.top_pairs[:per_class]):
            table.add_row(
                for_terminal(cls) if index == 0 else "",
                _shown(pair.target_text),
                _shown(pair.draft_text),
                f"{pair.category} / {pair.draft_category}",
                str(pair.count),
                f"{pair.lost_tokens} ({pct(pair.share_of_lost, 0)})",
                f"{pair.num_confident}/{pair.count}",
            )
    console.print(table)
    for cls, summary in sorted(by_class.items()):
        worst = summary.costliest_category
        worst_text = (
            f"; costliest: {worst.category} ({pct(worst.share_of_lost, 0)} "
            f"of lost, {pct(worst.acceptance_rate, 0)} accepted)"
            if worst
            else ""
        )
        console.print(
            f"  {for_terminal(cls)}: tau {fmt(summary.tau)}, attainable <= {fmt(summary.attainable_tau)} "
            f"(confident misses {pct(summary.confident.share_of_lost, 0)} of lost){worst_text}"
        )


def print_server_comparison(record: RunRecord, console: Console) -> None:
    """Per class: the server's tau beside the embedded replay's on the same outputs (when it ran)."""
    data = record.probes.engine_agreement
    if not data:
        return
    table = Table(
        title=(
            f"Server ({record.source.details.get('kind')}) vs embedded replay on the same outputs (tau, bonus included)"
        )
    )
    for column in ("class", "turns", "server tau", "95% CI", "embedded tau", "95% CI", "difference [95% CI]"):
        table.add_column(column)
    blocks = [("overall", data.tau.overall), *data.tau.by_class.items()]
    for name, block in blocks:
        if not block:
            continue
        ci = lambda v: f"[{v[0]:.2f}, {v[1]:.2f}]"  # noqa: E731
        table.add_row(
            for_terminal(name),
            str(block.num_turns),
            f"{block.engine_tau:.3f}",
            ci(block.engine_tau_ci),
            f"{block.embedded_tau:.3f}",
            ci(block.embedded_tau_ci),
            f"{block.difference:+.3f} {ci(block.difference_ci)}",
        )
    console.print(table)
    shares = ", ".join(f"{name} {stats.share:.0%}" for name, stats in data.per_step.items() if stats.share is not None)
    console.print(f"per-step acceptance reproduced at the engine's own anchors: {shares}")
