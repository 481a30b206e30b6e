"""`dflash-doctor compare BASE NEW`: the regression gate between two runs (exit 1 on regression)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from dflash_doctor.cli.root import app
from dflash_doctor.rundir.run_record import OVERALL
from dflash_doctor.report.comparison import compare_runs, write_compare_reports
from dflash_doctor.report.sanitize import for_terminal
from dflash_doctor.stats.gate import DEFAULT_THRESHOLD_RATE, DEFAULT_THRESHOLD_TAU, MAX_TAU_DROP, Comparison
from dflash_doctor.cli import options as opt
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.validation import finite_number
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.cli.output import print_json
from dflash_doctor.report.templating import ci, fmt, signed

EXIT_REGRESSION = 1


def _nothing_compared(comparison: Comparison) -> str | None:
    """The sentence refusing a comparison in which no class has drafted steps in both runs (a run that
    finished no request, or drafted nothing), naming the empty side; None when something was compared.
    A gate that compared nothing must not say "no regression"."""
    if any(row.delta is not None for row in comparison.rows):
        return None
    tau = [row for row in comparison.rows if row.cls == OVERALL and row.slot is None]
    empty = [
        f"{label} ({path})"
        for label, path, value in (
            ("BASE", comparison.base_path, tau[0].base if tau else None),
            ("NEW", comparison.new_path, tau[0].new if tau else None),
        )
        if value is None
    ]
    return (
        f"{' and '.join(empty)} {'has' if len(empty) == 1 else 'have'} "
        "no drafted steps (no finished request), so nothing "
        f"was compared; compare two runs that both finished requests."
    )


def _table(comparison: Comparison) -> Table:
    """tau per class, then every regressed per-position rate (unchanged rates would drown the table)."""
    table = Table(
        title=(
            f"NEW {for_terminal(comparison.new_path.name)} vs BASE "
            f"{for_terminal(comparison.base_path.name)} (K={comparison.k_compared})"
        )
    )
    for column in ("class", "metric", "BASE", "BASE 95% CI", "NEW", "NEW 95% CI", "delta", "verdict"):
        table.add_column(column, justify="right" if column in ("BASE", "NEW", "delta") else "left")
    shown = [row for row in comparison.rows if row.slot is None or row.regression]
    for row in shown:
        digits = 2 if row.slot is None else 3
        verdict = "[bold red]REGRESSION[/]" if row.regression else (row.note or "[green]ok[/]")
        table.add_row(
            for_terminal(row.cls),
            row.label,
            fmt(row.base, digits),
            ci(row.base_ci, digits),
            fmt(row.new, digits),
            ci(row.new_ci, digits),
            signed(row.delta, digits),
            verdict,
        )
    return table


def _grown_table(comparison: Comparison) -> Table:
    """Rejection patterns whose lost tokens per draft grew (e.g. special tokens after a template change)."""
    table = Table(title="Rejection patterns that grew (lost tokens per draft step; informational)")
    for column in ("class", "kind", "pattern", "BASE", "NEW", "growth"):
        table.add_column(column, justify="right" if column in ("BASE", "NEW", "growth") else "left")
    for row in comparison.grown_patterns:
        table.add_row(
            for_terminal(row["class"]),
            row["kind"],
            for_terminal(row["pattern"]),
            fmt(row["lost_per_draft_base"], 3),
            fmt(row["lost_per_draft_new"], 3),
            signed(row["growth"], 3),
        )
    return table


@app.command(
    "compare",
    epilog="Example: dflash-doctor compare runs/check-before runs/check-after --threshold-tau 0.1 --json > gate.json",
)
def compare_command(
    base: Annotated[str, typer.Argument(help="Run directory before the change.")],
    new: Annotated[str, typer.Argument(help="Run directory after the change (same workload).")],
    threshold_tau: Annotated[
        float, typer.Option("--threshold-tau", help="Smallest drop in tau (tokens per step) that counts.")
    ] = DEFAULT_THRESHOLD_TAU,
    threshold_rate: Annotated[
        float, typer.Option("--threshold-rate", help="Smallest drop in a per-position acceptance rate that counts.")
    ] = DEFAULT_THRESHOLD_RATE,
    out: Annotated[
        Optional[str],
        typer.Option("--out", help="Folder for compare.html and compare.md.", show_default="NEW's run directory"),
    ] = None,
    plotly: opt.Plotly = None,
    json_output: opt.Json = False,
) -> None:
    """Per-class regression gate: exit 1 when tau or a per-position rate drops past its threshold
    with separated 95% intervals; exit 2 when a run has no drafted steps (nothing to compare).

    Also lists the rejection patterns (target or drafted token categories)
    whose lost tokens per draft grew; those never change the exit code.
    """
    # finite and in range: nan or inf would pass a plain ">= 0" and then no drop could ever exceed it
    threshold_tau = finite_number(
        threshold_tau, "--threshold-tau", minimum=0, maximum=MAX_TAU_DROP, fix="pass a drop in tau such as 0.2"
    )
    threshold_rate = finite_number(
        threshold_rate,
        "--threshold-rate",
        minimum=0,
        maximum=1,
        fix="pass a drop in acceptance rate between 0 and 1 such as 0.05",
    )
    plotly_source = plotly or DoctorConfig.plotly  # a choice Click checked
    comparison = compare_runs(base, new, threshold_tau=threshold_tau, threshold_rate=threshold_rate)
    refusal = _nothing_compared(comparison)
    if refusal is not None:
        raise UsageError(refusal)
    console = Console(stderr=json_output)
    console.print(_table(comparison))
    if comparison.grown_patterns:
        console.print(_grown_table(comparison))
    for note in comparison.notes:
        console.print(f"note: {for_terminal(note)}")
    reports = write_compare_reports(comparison, Path(out) if out else comparison.new_path, plotly_source)
    for path in reports:
        console.print(f"wrote {path}")
    code = EXIT_REGRESSION if comparison.has_regression else 0
    if comparison.has_regression:
        console.print(f"[bold red]REGRESSION[/]: {len(comparison.regressions)} metric(s) dropped past their threshold.")
    else:
        console.print("[green]OK[/]: no regression.")
    if json_output:
        print_json({**comparison.as_dict(), "reports": [str(path) for path in reports], "exit_code": code})
    if code:
        raise typer.Exit(code)
