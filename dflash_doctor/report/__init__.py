"""Exported reports of a run directory: report.html, report.md, report.json and junit.xml.

Each is a view of the same run (the run record + tables); none recomputes model outputs. ``check``
renders the run it holds in memory; ``dflash-doctor report RUN`` loads a run directory and re-renders it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

from dflash_doctor.stats import deviations
from dflash_doctor.stats.deviations import DeviationAnalysis
from dflash_doctor.errors import UsageError
from dflash_doctor.report.content import check_counts, class_rows, incomplete_note, report_payload, verdict
from dflash_doctor.inputs.config import PLOTLY_SOURCES, parse_plotly_source
from dflash_doctor.report.html import render_html
from dflash_doctor.report.junit import render_junit
from dflash_doctor.report.templating import markdown_env
from dflash_doctor.rundir.load import Run, load_run
from dflash_doctor.rundir.writer import json_safe, write_text_atomic

FORMATS = ("html", "md", "json", "junit")
FILENAMES = {"html": "report.html", "md": "report.md", "json": "report.json", "junit": "junit.xml"}

__all__ = [
    "FORMATS",
    "FILENAMES",
    "PLOTLY_SOURCES",
    "parse_formats",
    "parse_plotly_source",
    "render_reports",
    "render_markdown",
    "render_json",
    "render_html",
    "render_junit",
]


def parse_formats(value: str | Iterable[str]) -> tuple[str, ...]:
    """``html,md`` (or a list) -> ("html", "md"); an unknown name is a UsageError naming the choices."""
    names = [part.strip().lower() for part in (value.split(",") if isinstance(value, str) else value) if part.strip()]
    unknown = [name for name in names if name not in FORMATS]
    if unknown or not names:
        raise UsageError(
            f"--format {','.join(unknown) or repr(value)} is not a report "
            f"format; use a comma-separated list of {','.join(FORMATS)}."
        )
    return tuple(dict.fromkeys(names))


def render_markdown(run: Run, analysis: DeviationAnalysis | None = None) -> str:
    """report.md: tables only, no scripts or raw HTML, for pull-request comments (``analysis``: as for
    :func:`render_html`)."""
    record = run.record
    text = (
        markdown_env()
        .get_template("report.md")
        .render(
            run_name=run.name,
            incomplete=incomplete_note(run),
            record=record,
            verdict=verdict(record.checks),
            counts=check_counts(record.checks),
            checks=record.checks,
            rows=class_rows(record),
            why=analysis if analysis is not None else deviations.analyze_run(run),
        )
    )
    return text.rstrip("\n") + "\n"


def render_json(run: Run, analysis: DeviationAnalysis | None = None) -> str:
    """report.json with sorted keys (stable diffs) and NaN
    written as null (``analysis``: as for :func:`render_html`)."""
    payload = report_payload(run, analysis if analysis is not None else deviations.analyze_run(run))
    return json.dumps(json_safe(payload), indent=2, sort_keys=True) + "\n"


_RENDERERS: dict[str, Callable[[Run, DeviationAnalysis, str], str]] = {
    "html": render_html,
    "md": lambda run, analysis, _plotly: render_markdown(run, analysis),
    "json": lambda run, analysis, _plotly: render_json(run, analysis),
    "junit": lambda run, _analysis, _plotly: render_junit(run),
}


def render_reports(
    run: Run | Path | str,
    formats: Iterable[str] = FORMATS,
    out_dir: Path | str | None = None,
    analysis: DeviationAnalysis | None = None,
    plotly: str = "inline",
) -> list[Path]:
    """Write the requested reports of ``run`` (a loaded run, or a run directory to load) into
    ``out_dir`` (default: the run directory) and return their paths in the order asked. The deviation
    analysis is computed once for all of them (``analysis``: the caller's, when it has it); ``plotly``:
    where report.html loads plotly.js from (``inline`` or ``cdn``, :data:`PLOTLY_SOURCES`)."""
    formats = parse_formats(formats)
    parse_plotly_source(plotly)
    run = run if isinstance(run, Run) else load_run(run)
    analysis = analysis if analysis is not None else deviations.analyze_run(run)
    target_dir = Path(out_dir) if out_dir is not None else run.path
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {target_dir} cannot be created ({exc.strerror}); pass a writable folder.") from None
    written = []
    for name in formats:
        path = target_dir / FILENAMES[name]
        write_text_atomic(path, _RENDERERS[name](run, analysis, plotly))
        written.append(path)
    return written
