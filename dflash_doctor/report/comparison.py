"""``dflash-doctor compare BASE NEW`` on run directories: each run's sides for the gate
(:mod:`dflash_doctor.stats.gate`), the rejection patterns that grew, and compare.html / compare.md.

The numbers and intervals are each run's own summary (:mod:`dflash_doctor.stats.metrics`), so BASE and NEW
read exactly as the run's report and dashboard show them. Two watch runs go to
:mod:`dflash_doctor.telemetry.canary`, which applies the same gate to scrape intervals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from dflash_doctor.report import figures
from dflash_doctor.report.html import figure_html, plotly_script
from dflash_doctor.report.templating import html_env, markdown_env
from dflash_doctor.rundir.load import Run, load_run
from dflash_doctor.rundir.run_record import OVERALL
from dflash_doctor.rundir.writer import write_text_atomic
from dflash_doctor.stats import deviations
from dflash_doctor.stats.gate import (
    DEFAULT_THRESHOLD_RATE,
    DEFAULT_THRESHOLD_TAU,
    NO_SIDE,
    Comparison,
    Side,
    compare_slice,
)
from dflash_doctor.stats.metrics import (
    NUM_BOOTSTRAP_RESAMPLES,
    RequestCounters,
    group_rng,
    summarize,
    summary_group,
    truncate_steps,
)
from dflash_doctor.telemetry.canary import compare_watch_runs, is_watch_dir


def _steps_at_largest_k(run: Run) -> tuple[pd.DataFrame, int]:
    """A run may hold steps at several K (a live sweep); only steps at one K pool into one tau,
    so keep the largest K, which is also the one every smaller K can be truncated from."""
    steps = run.steps
    if steps.empty:
        return steps, 0
    k_max = int(steps["k"].max())
    return steps[steps["k"] == k_max], k_max


def _sides(run: Run, k: int) -> dict[str, Side]:
    """Every class's (and overall's) side of ``run`` at ``k``.

    At the run's own K these are the very numbers of its ``summary`` (the one statistics module made
    them); at a smaller K the summary is recomputed on truncated steps by the same code.
    """
    steps, k_run = _steps_at_largest_k(run)
    seed = run.record.seed
    requests = run.requests if run.requests is not None and not run.requests.empty else None
    if k == k_run and run.record.summary.overall is not None:
        summary = run.record.summary
    else:
        steps = truncate_steps(steps, k)
        summary = summarize(steps, requests, num_slots=k, seed=seed)
    sides = {}
    for cls, metrics in summary.scopes().items():
        chosen = steps if cls == OVERALL else steps[steps["class"] == cls]
        request_ids = pd.unique(chosen["request_id"].to_numpy())
        counters = RequestCounters(chosen, request_ids, k)
        tau_samples, rate_samples = counters.bootstrap(NUM_BOOTSTRAP_RESAMPLES, group_rng(seed, summary_group(cls)))
        sides[cls] = Side(
            metrics.num_requests,
            metrics.mean_acceptance_length,
            metrics.mean_acceptance_length_ci,
            metrics.acceptance_rate_per_pos,
            metrics.acceptance_rate_per_pos_ci,
            tau_samples,
            rate_samples,
        )
    return sides


def different_inputs(base_run: Run, new_run: Run) -> list[str]:
    """Warnings when BASE and NEW did not measure the same thing: another target (its id or file hash) or
    another workload (file, classes, request cap, tokens per request, temperature). A drop between such
    runs is not a regression of the draft, so the comparison says so before its numbers."""
    warnings = []
    base_target, new_target = base_run.record.models.get("target"), new_run.record.models.get("target")
    if base_target is not None and new_target is not None:
        if base_target.id != new_target.id:
            warnings.append(
                f"WARNING: the runs have different targets (BASE {base_target.id}, NEW {new_target.id}): "
                "a change in tau may come from the target, not the draft."
            )
        elif base_target.revision_or_hash != new_target.revision_or_hash:
            warnings.append(
                f"WARNING: the target {new_target.id} has different weights in the two runs (hash "
                f"{base_target.revision_or_hash[:12]} vs {new_target.revision_or_hash[:12]})."
            )
    keys = ("workload", "classes", "max_requests", "max_new_tokens", "temperature")
    differing = [key for key in keys if base_run.record.config.get(key) != new_run.record.config.get(key)]
    if differing:
        shown = "; ".join(
            f"{key} {base_run.record.config.get(key)!r} vs {new_run.record.config.get(key)!r}" for key in differing
        )
        warnings.append(f"WARNING: the runs have different workloads ({shown}): compare runs of the same requests.")
    return warnings


def compare_runs(
    base: Run | Path | str,
    new: Run | Path | str,
    *,
    threshold_tau: float = DEFAULT_THRESHOLD_TAU,
    threshold_rate: float = DEFAULT_THRESHOLD_RATE,
) -> Comparison:
    """Compare NEW against BASE per class and overall (see the module docstring for the rule).

    BASE and NEW show the numbers of each run's own summary (tau, rates and their intervals, as the
    report and the dashboard show them). When the two runs drafted different K, both are compared at
    the smaller one by truncation (tau(K) = 1 + sum_{i<K} r_i), which is exact for chain drafts and an
    estimate for DFlash blocks, and a note says so.
    """
    if not isinstance(base, Run) and not isinstance(new, Run):
        if is_watch_dir(base) and is_watch_dir(new):  # production windows: scrape intervals are the units
            return compare_watch_runs(base, new, threshold_tau=threshold_tau, threshold_rate=threshold_rate)
    base_run = base if isinstance(base, Run) else load_run(base)  # tokens too: the rejection patterns that grew
    new_run = new if isinstance(new, Run) else load_run(new)
    _, k_base = _steps_at_largest_k(base_run)
    _, k_new = _steps_at_largest_k(new_run)
    k = min(k_base, k_new) if k_base and k_new else max(k_base, k_new)
    comparison = Comparison(base_run.path, new_run.path, threshold_tau, threshold_rate, k)
    comparison.grown_patterns = deviations.grown_patterns(
        deviations.run_tables(base_run), deviations.run_tables(new_run)
    )
    for label, run in (("BASE", base_run), ("NEW", new_run)):
        if not run.complete:
            comparison.notes.append(
                f"{label} is an incomplete run (still going or stopped before "
                "it ended): only the requests it finished are compared."
            )
    comparison.notes.extend(different_inputs(base_run, new_run))
    if k_base and k_new and k_base != k_new:
        comparison.notes.append(
            f"BASE drafted K={k_base} and NEW K={k_new}: compared at "
            f"K={k} by truncation (an estimate for DFlash drafts)."
        )
    if not k:
        comparison.notes.append("Neither run has drafted steps: nothing to compare.")
        return comparison
    base_sides = _sides(base_run, k) if k_base else {}
    new_sides = _sides(new_run, k) if k_new else {}
    classes = sorted((set(base_sides) | set(new_sides)) - {OVERALL})
    for cls in [*classes, OVERALL]:
        comparison.rows += compare_slice(
            cls, base_sides.get(cls, NO_SIDE), new_sides.get(cls, NO_SIDE), k, threshold_tau, threshold_rate
        )
    return comparison


COMPARE_FILENAMES = {"html": "compare.html", "md": "compare.md"}


def _template_context(comparison: Comparison) -> dict[str, Any]:
    rows = [row.as_dict() for row in comparison.rows]
    return {
        "comparison": comparison,
        "base_name": comparison.base_path.name,
        "new_name": comparison.new_path.name,
        "tau_rows": [r for r in rows if r["slot"] is None],
        "rate_rows": [r for r in rows if r["slot"] is not None],
        "regressions": [row.as_dict() for row in comparison.regressions],
        "grown_patterns": comparison.grown_patterns,
        "growth_threshold": deviations.GROWTH_MIN_LOST_PER_DRAFT,
    }


def render_compare_markdown(comparison: Comparison) -> str:
    """compare.md: verdict, tau per class, regressed per-position rates; no HTML, for PR comments."""
    return markdown_env().get_template("compare.md").render(**_template_context(comparison)).rstrip("\n") + "\n"


def render_compare_html(comparison: Comparison, plotly: str = "inline") -> str:
    """compare.html: the same tables plus BASE-vs-NEW charts, self-contained like report.html (``plotly``:
    where it loads plotly.js from, as report.html)."""
    context = _template_context(comparison)
    rows = context["tau_rows"] + context["rate_rows"]
    charts = [
        figure_html(figures.compare_tau_figure(rows), "chart-compare-tau"),
        figure_html(figures.compare_rates_figure(rows), "chart-compare-rates"),
    ]
    return html_env().get_template("compare.html").render(charts=charts, plotly_script=plotly_script(plotly), **context)


def write_compare_reports(comparison: Comparison, out_dir: Path | str, plotly: str = "inline") -> list[Path]:
    """Write compare.html and compare.md into ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, text in (("html", render_compare_html(comparison, plotly)), ("md", render_compare_markdown(comparison))):
        path = out_dir / COMPARE_FILENAMES[kind]
        write_text_atomic(path, text)
        written.append(path)
    return written
