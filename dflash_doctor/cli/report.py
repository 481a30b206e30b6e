"""`dflash-doctor report RUN`: re-render a run directory as html / md / json / junit."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console

from dflash_doctor.cli.root import app
from dflash_doctor.cli import options as opt
from dflash_doctor.report import FORMATS, render_reports


def _complete_formats(incomplete: str) -> list[str]:
    """--format takes a comma-separated list: complete its last item."""
    done, _, last = incomplete.rpartition(",")
    return [
        f"{done},{name}" if done else name for name in FORMATS if name.startswith(last) and name not in done.split(",")
    ]


@app.command("report", epilog="Example: dflash-doctor report runs/check-demo --format md,junit --out ci-artefacts")
def report_command(
    run: Annotated[str, typer.Argument(help="Run directory written by check, replay or sweep.")],
    format: Annotated[
        str,
        typer.Option(
            "--format", help=f"Comma-separated reports to write: {','.join(FORMATS)}.", autocompletion=_complete_formats
        ),
    ] = ",".join(FORMATS),
    out: Annotated[
        Optional[str], typer.Option("--out", help="Folder for the reports (default: the run directory).")
    ] = None,
    plotly: opt.Plotly = None,
) -> None:
    """Re-render a run as report.html, report.md, report.json and junit.xml (no model is loaded)."""
    paths = render_reports(run, formats=format, out_dir=out, plotly=plotly or "inline")
    console = Console()
    for path in paths:
        console.print(f"wrote {path}")
