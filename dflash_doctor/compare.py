"""Regression gate between two run directories: did the draft's alignment with the target get worse?

Typical use is the same workload before and after a target or draft update. For every request class
and overall we compare the mean acceptance length tau (bonus included, vLLM's convention) and the
unconditional per-position acceptance rates ``r_i``, each with a 95% bootstrap interval over
*requests* (not steps: steps inside one request are correlated, and position-1 acceptance alone
varies by several points between identical runs, speculators PR #793).

A metric regresses only when BOTH hold:

* the drop is larger than the threshold (``--threshold-tau`` in tau units, ``--threshold-rate`` in
  rate units), so tiny but statistically clear changes do not fail CI, and
* the two intervals separate (NEW's upper bound below BASE's lower bound), so noise from a different
  seed or request sample does not fail CI either.

The numbers and intervals are each run's own summary (:mod:`dflash_doctor.metrics`), so BASE and NEW
read exactly as the run's report and dashboard show them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from dflash_doctor import deviations, figures
from dflash_doctor.metrics import NUM_BOOTSTRAP_RESAMPLES, OVERALL, RequestCounters, group_rng, interval, summarize, summary_group, truncate_steps
from dflash_doctor.record import Summary
from dflash_doctor.report.html import figure_html, plotly_script
from dflash_doctor.report.templating import html_env, markdown_env
from dflash_doctor.schema import Run, load_run

DEFAULT_THRESHOLD_TAU = 0.2
DEFAULT_THRESHOLD_RATE = 0.05


@dataclass(frozen=True)
class MetricComparison:
    """One compared number: tau or the rate at one draft slot, for one class (or overall)."""

    cls: str
    metric: str  # "mean_acceptance_length" or "acceptance_rate_per_pos"
    slot: int | None  # 1-based draft slot for per-position rates, None for tau
    base: float | None
    base_ci: tuple[float, float] | None
    new: float | None
    new_ci: tuple[float, float] | None
    delta: float | None  # new - base
    delta_ci: tuple[float, float] | None
    threshold: float
    regression: bool
    note: str = ""

    @property
    def label(self) -> str:
        return "tau" if self.slot is None else f"r_{self.slot}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "class": self.cls,
            "metric": self.metric,
            "slot": self.slot,
            "label": self.label,
            "base": self.base,
            "base_ci": list(self.base_ci) if self.base_ci else None,
            "new": self.new,
            "new_ci": list(self.new_ci) if self.new_ci else None,
            "delta": self.delta,
            "delta_ci": list(self.delta_ci) if self.delta_ci else None,
            "threshold": self.threshold,
            "regression": self.regression,
            "note": self.note,
        }


@dataclass
class Comparison:
    """The result of comparing two runs; ``rows`` hold every class x metric pair."""

    base_path: Path
    new_path: Path
    threshold_tau: float
    threshold_rate: float
    k_compared: int
    rows: list[MetricComparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # rejection patterns (target category or token pair) that cost more lost tokens per draft in NEW;
    # informational, never a regression by itself (dflash_doctor.deviations.grown_patterns)
    grown_patterns: list[dict[str, Any]] = field(default_factory=list)

    @property
    def regressions(self) -> list[MetricComparison]:
        return [row for row in self.rows if row.regression]

    @property
    def has_regression(self) -> bool:
        return bool(self.regressions)


def _steps_at_largest_k(run: Run) -> tuple[pd.DataFrame, int]:
    """A run may hold steps at several K (a live sweep); only steps at one K pool into one tau,
    so keep the largest K, which is also the one every smaller K can be truncated from."""
    steps = run.steps
    if steps.empty:
        return steps, 0
    k_max = int(steps["k"].max())
    return steps[steps["k"] == k_max], k_max


@dataclass(frozen=True)
class _Side:
    """One run's numbers for one class at the compared K: tau and the per-slot rates with their
    intervals as the run's own summary shows them (``summary_group``; a watch's from its scrape
    intervals), and the bootstrap resamples behind the interval of the difference."""

    num_units: int  # resampled units: requests of a run, scrape intervals of a watch; 0 = not in this run
    tau: float | None
    tau_ci: Sequence[float | None] | None
    rates: Sequence[float | None]
    rate_cis: Sequence[Sequence[float | None]]
    tau_samples: np.ndarray  # [n_boot]
    rate_samples: np.ndarray  # [n_boot, k]


def _sides(run: Run, k: int) -> dict[str, _Side]:
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
        summary = Summary.from_json(summarize(steps, requests, num_slots=k, seed=seed))
    sides = {}
    for cls, metrics in summary.scopes().items():
        chosen = steps if cls == OVERALL else steps[steps["class"] == cls]
        request_ids = pd.unique(chosen["request_id"].to_numpy())
        counters = RequestCounters(chosen, request_ids, k)
        tau_samples, rate_samples = counters.bootstrap(NUM_BOOTSTRAP_RESAMPLES, group_rng(seed, summary_group(cls)))
        sides[cls] = _Side(metrics.num_requests, metrics.mean_acceptance_length, metrics.mean_acceptance_length_ci,
                           metrics.acceptance_rate_per_pos, metrics.acceptance_rate_per_pos_ci, tau_samples, rate_samples)
    return sides


_NO_SIDE = _Side(0, None, None, [], [], np.full(NUM_BOOTSTRAP_RESAMPLES, np.nan), np.full((NUM_BOOTSTRAP_RESAMPLES, 0), np.nan))


def _ci(values: Any) -> tuple[float, float] | None:
    if values is None or len(values) != 2:
        return None
    lo, hi = (float("nan") if x is None else float(x) for x in values)
    return None if np.isnan(lo) or np.isnan(hi) else (lo, hi)


def _finite(value: Any) -> float | None:
    return None if value is None or np.isnan(value) else float(value)


def _compare_slice(cls: str, base: _Side, new: _Side, k: int, threshold_tau: float, threshold_rate: float) -> list[MetricComparison]:
    """tau and r_1..r_k of one class in both runs, each with base/new/delta intervals and a verdict."""
    note = ""
    if base.num_units == 0 or new.num_units == 0:
        note = f"only in {'NEW' if base.num_units == 0 else 'BASE'}: not compared"

    def at(values: Sequence[Any], i: int) -> Any:
        return values[i] if i < len(values) else None

    def samples(side: _Side, i: int) -> np.ndarray:
        return side.rate_samples[:, i] if i < side.rate_samples.shape[1] else np.full(NUM_BOOTSTRAP_RESAMPLES, np.nan)

    # (metric, slot, base value, base ci, new value, new ci, base samples, new samples, threshold)
    metrics = [(
        "mean_acceptance_length", None, base.tau, base.tau_ci, new.tau, new.tau_ci,
        base.tau_samples, new.tau_samples, threshold_tau,
    )]
    metrics += [(
        "acceptance_rate_per_pos", i + 1,
        at(base.rates, i), at(base.rate_cis, i), at(new.rates, i), at(new.rate_cis, i),
        samples(base, i), samples(new, i), threshold_rate,
    ) for i in range(k)]
    rows = []
    for metric, slot, base_value, base_ci, new_value, new_ci, base_samples, new_samples, threshold in metrics:
        base_value, new_value, base_ci, new_ci = _finite(base_value), _finite(new_value), _ci(base_ci), _ci(new_ci)
        delta = delta_ci = None
        regression = False
        if not note and base_ci is not None and new_ci is not None and base_value is not None and new_value is not None:
            delta = new_value - base_value
            delta_ci = _ci(interval(new_samples - base_samples))
            regression = -delta > threshold and new_ci[1] < base_ci[0]
        rows.append(
            MetricComparison(
                cls=cls, metric=metric, slot=slot,
                base=base_value, base_ci=base_ci, new=new_value, new_ci=new_ci,
                delta=delta, delta_ci=delta_ci, threshold=threshold,
                regression=regression,
                note=note,
            )
        )
    return rows


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
        from dflash_doctor.telemetry.canary import compare_watch_runs, is_watch_dir

        if is_watch_dir(base) and is_watch_dir(new):  # production windows: scrape intervals are the units
            return compare_watch_runs(base, new, threshold_tau=threshold_tau, threshold_rate=threshold_rate)
    base_run = base if isinstance(base, Run) else load_run(base)  # tokens too: the rejection patterns that grew
    new_run = new if isinstance(new, Run) else load_run(new)
    _, k_base = _steps_at_largest_k(base_run)
    _, k_new = _steps_at_largest_k(new_run)
    k = min(k_base, k_new) if k_base and k_new else max(k_base, k_new)
    comparison = Comparison(base_run.path, new_run.path, threshold_tau, threshold_rate, k)
    comparison.grown_patterns = deviations.grown_patterns(deviations.run_tables(base_run), deviations.run_tables(new_run))
    for label, run in (("BASE", base_run), ("NEW", new_run)):
        if not run.complete:
            comparison.notes.append(f"{label} is an incomplete run (still going or stopped before it ended): only the requests it finished are compared.")
    if k_base and k_new and k_base != k_new:
        comparison.notes.append(f"BASE drafted K={k_base} and NEW K={k_new}: compared at K={k} by truncation (an estimate for DFlash drafts).")
    if not k:
        comparison.notes.append("Neither run has drafted steps: nothing to compare.")
        return comparison
    base_sides = _sides(base_run, k) if k_base else {}
    new_sides = _sides(new_run, k) if k_new else {}
    classes = sorted((set(base_sides) | set(new_sides)) - {OVERALL})
    for cls in [*classes, OVERALL]:
        comparison.rows += _compare_slice(cls, base_sides.get(cls, _NO_SIDE), new_sides.get(cls, _NO_SIDE), k, threshold_tau, threshold_rate)
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
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
