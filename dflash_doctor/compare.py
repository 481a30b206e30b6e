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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import math
from statistics import NormalDist

import numpy as np
import pandas as pd

from dflash_doctor import figures
from dflash_doctor.report.html import figure_html, plotly_js
from dflash_doctor.report.templating import html_env, markdown_env
from dflash_doctor.schema import Run, load_run

OVERALL = "overall"
CONFIDENCE_LEVEL = 0.95
NUM_BOOTSTRAP_RESAMPLES = 2000
DEFAULT_THRESHOLD_TAU = 0.2
DEFAULT_THRESHOLD_RATE = 0.05


@dataclass(frozen=True)
class RequestCounts:
    """Acceptance counts per request: the unit the bootstrap resamples.

    ``accepted_per_pos[n, i]`` is how many of request n's steps accepted at least ``i + 1`` draft
    tokens (vLLM's ``num_accepted_tokens_per_pos``), so pooled rates are sums over requests.
    """

    num_drafts: np.ndarray  # [N]
    accepted_per_pos: np.ndarray  # [N, K]

    @property
    def num_requests(self) -> int:
        return int(self.num_drafts.shape[0])


def request_counts(steps: pd.DataFrame, k_max: int | None = None) -> RequestCounts:
    """Reduce a steps table to per-request counts; ``k_max`` defaults to the largest K drafted."""
    if k_max is None:
        k_max = int(steps["num_drafted"].max()) if len(steps) else 0
    if not len(steps):
        return RequestCounts(np.zeros(0), np.zeros((0, k_max)))
    request_index, _ = pd.factorize(steps["request_id"])
    num_requests = int(request_index.max()) + 1
    num_accepted = steps["num_accepted"].to_numpy()
    num_drafts = np.bincount(request_index, minlength=num_requests).astype(float)
    # at_least[s, i] = step s accepted at least i + 1 tokens.                       # [S, K]
    at_least = (num_accepted[:, None] > np.arange(k_max)[None, :]).astype(float)
    accepted_per_pos = np.zeros((num_requests, k_max))
    np.add.at(accepted_per_pos, request_index, at_least)
    return RequestCounts(num_drafts, accepted_per_pos)


def pooled_rates(num_drafts: np.ndarray, accepted_per_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pooled tau and per-position rates; works on one sample ([N], [N, K]) or on a batch of
    resample totals ([B], [B, K]) once summed. Returns (tau [...], rates [..., K]); NaN with no drafts."""
    with np.errstate(invalid="ignore", divide="ignore"):
        rates = accepted_per_pos / num_drafts[..., None]
    tau = 1.0 + rates.sum(axis=-1)
    return tau, rates


def bootstrap_rates(counts: RequestCounts, *, seed: int = 0, num_resamples: int = NUM_BOOTSTRAP_RESAMPLES) -> tuple[np.ndarray, np.ndarray]:
    """Resample requests with replacement; returns tau [B] and rates [B, K] of each resample."""
    n = counts.num_requests
    if n == 0:
        k = counts.accepted_per_pos.shape[1]
        return np.full(num_resamples, np.nan), np.full((num_resamples, k), np.nan)
    rng = np.random.default_rng(seed)
    # weights[b, n] = how often request n is drawn in resample b                      # [B, N]
    weights = rng.multinomial(n, np.full(n, 1.0 / n), size=num_resamples).astype(float)
    return pooled_rates(weights @ counts.num_drafts, weights @ counts.accepted_per_pos)


def _student_t_quantile(p: float, dof: int) -> float:
    """Student-t quantile by the Cornish-Fisher expansion around the normal one (error < 1e-3 for
    dof >= 3 at the 97.5% level; numpy has no t quantile and scipy is not a dependency)."""
    z = NormalDist().inv_cdf(p)
    return (
        z
        + (z**3 + z) / (4 * dof)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * dof**3)
    )


def expanded_level(level: float, num_units: int) -> float:
    """Coverage to ask of the percentile bootstrap so that it really covers ``level`` with few units.

    The plain percentile interval is too narrow for small samples (it uses z where t belongs, and
    the plug-in variance is biased by (n-1)/n); Hesterberg's expanded percentile interval fixes both
    by widening the tail to z' = sqrt(n / (n-1)) * t_{n-1}. With 8 requests a 95% interval becomes a
    98.9% percentile interval; with hundreds of requests nothing changes.
    """
    if num_units < 2:
        return level
    upper = (1.0 + level) / 2.0
    z_expanded = math.sqrt(num_units / (num_units - 1)) * _student_t_quantile(upper, max(num_units - 1, 3))
    return 2.0 * NormalDist().cdf(z_expanded) - 1.0


def percentile_interval(samples: np.ndarray, level: float = CONFIDENCE_LEVEL, num_units: int | None = None) -> np.ndarray:
    """Percentile interval along axis 0: [2, ...] (lo, hi); NaN where every sample is NaN.

    Pass ``num_units`` (the number of requests resampled) to get the small-sample expanded interval.
    """
    if num_units is not None:
        level = expanded_level(level, num_units)
    tail = (1.0 - level) / 2.0 * 100.0
    if np.all(np.isnan(samples)):
        return np.full((2,) + samples.shape[1:], np.nan)
    return np.nanpercentile(samples, [tail, 100.0 - tail], axis=0)


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


def _interval(values: np.ndarray) -> tuple[float, float] | None:
    lo, hi = (float(x) for x in values)
    return None if np.isnan(lo) or np.isnan(hi) else (lo, hi)


def _finite(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def _compare_slice(cls: str, base_steps: pd.DataFrame, new_steps: pd.DataFrame, k: int, threshold_tau: float, threshold_rate: float, seed: int) -> list[MetricComparison]:
    """tau and r_1..r_k of one class in both runs, each with base/new/delta intervals and a verdict."""
    sides = []
    for offset, steps in enumerate((base_steps, new_steps)):
        counts = request_counts(steps, k)
        tau, rates = pooled_rates(np.array(counts.num_drafts.sum()), counts.accepted_per_pos.sum(axis=0))
        tau_samples, rate_samples = bootstrap_rates(counts, seed=seed + offset)
        sides.append((counts.num_requests, tau, rates, tau_samples, rate_samples))
    (n_base, tau_b, rates_b, tau_bs, rates_bs), (n_new, tau_n, rates_n, tau_ns, rates_ns) = sides
    note = ""
    if n_base == 0 or n_new == 0:
        note = f"only in {'NEW' if n_base == 0 else 'BASE'}: not compared"
    # (metric, slot, base value, new value, base samples, new samples, threshold)
    metrics = [("mean_acceptance_length", None, float(tau_b), float(tau_n), tau_bs, tau_ns, threshold_tau)]
    metrics += [("acceptance_rate_per_pos", i + 1, float(rates_b[i]), float(rates_n[i]), rates_bs[:, i], rates_ns[:, i], threshold_rate) for i in range(k)]
    rows = []
    for metric, slot, base_value, new_value, base_samples, new_samples, threshold in metrics:
        base_ci = _interval(percentile_interval(base_samples, num_units=n_base))
        new_ci = _interval(percentile_interval(new_samples, num_units=n_new))
        comparable = not note and base_ci is not None and new_ci is not None
        delta = new_value - base_value if comparable else None
        delta_ci = _interval(percentile_interval(new_samples - base_samples, num_units=min(n_base, n_new))) if comparable else None
        separated = comparable and new_ci[1] < base_ci[0]
        rows.append(
            MetricComparison(
                cls=cls, metric=metric, slot=slot,
                base=_finite(base_value), base_ci=base_ci, new=_finite(new_value), new_ci=new_ci,
                delta=delta, delta_ci=delta_ci, threshold=threshold,
                regression=bool(comparable and -delta > threshold and separated),
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
    seed: int = 0,
) -> Comparison:
    """Compare NEW against BASE per class and overall (see the module docstring for the rule).

    Both runs are reduced to steps at their largest K; when the two K differ, tau is compared at the
    smaller one by truncation (tau(K) = 1 + sum_{i<K} r_i), which is exact for chain drafts and an
    estimate for DFlash blocks, and a note says so.
    """
    base_run = base if isinstance(base, Run) else load_run(base, tables=("steps",))
    new_run = new if isinstance(new, Run) else load_run(new, tables=("steps",))
    base_steps, k_base = _steps_at_largest_k(base_run)
    new_steps, k_new = _steps_at_largest_k(new_run)
    k = min(k_base, k_new) if k_base and k_new else max(k_base, k_new)
    comparison = Comparison(base_run.path, new_run.path, threshold_tau, threshold_rate, k)
    for label, run in (("BASE", base_run), ("NEW", new_run)):
        if not run.complete:
            comparison.notes.append(f"{label} is an incomplete run (still going or stopped before it ended): only the requests it finished are compared.")
    if k_base and k_new and k_base != k_new:
        comparison.notes.append(f"BASE drafted K={k_base} and NEW K={k_new}: compared at K={k} by truncation (an estimate for DFlash drafts).")
    if not k:
        comparison.notes.append("Neither run has drafted steps: nothing to compare.")
        return comparison
    classes = sorted(set(base_steps["class"]) | set(new_steps["class"]))
    for cls in classes:
        comparison.rows += _compare_slice(cls, base_steps[base_steps["class"] == cls], new_steps[new_steps["class"] == cls], k, threshold_tau, threshold_rate, seed)
    comparison.rows += _compare_slice(OVERALL, base_steps, new_steps, k, threshold_tau, threshold_rate, seed)
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
    }


def render_compare_markdown(comparison: Comparison) -> str:
    """compare.md: verdict, tau per class, regressed per-position rates; no HTML, for PR comments."""
    return markdown_env().get_template("compare.md").render(**_template_context(comparison)).rstrip("\n") + "\n"


def render_compare_html(comparison: Comparison) -> str:
    """compare.html: the same tables plus BASE-vs-NEW charts, self-contained like report.html."""
    context = _template_context(comparison)
    rows = context["tau_rows"] + context["rate_rows"]
    charts = [
        figure_html(figures.compare_tau_figure(rows), "chart-compare-tau"),
        figure_html(figures.compare_rates_figure(rows), "chart-compare-rates"),
    ]
    return html_env().get_template("compare.html").render(charts=charts, plotly_js=plotly_js(), **context)


def write_compare_reports(comparison: Comparison, out_dir: Path | str) -> list[Path]:
    """Write compare.html and compare.md into ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, render in (("html", render_compare_html), ("md", render_compare_markdown)):
        path = out_dir / COMPARE_FILENAMES[kind]
        path.write_text(render(comparison), encoding="utf-8")
        written.append(path)
    return written
