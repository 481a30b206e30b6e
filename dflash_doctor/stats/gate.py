"""The regression gate between two runs (or two watches): did the draft's alignment with the target get worse?

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

Each side (:class:`Side`) carries one run's numbers as its own summary shows them; who builds the sides
(:mod:`dflash_doctor.report.comparison` for runs, :mod:`dflash_doctor.telemetry.canary` for watches) is
not the gate's business, so both apply this one rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dflash_doctor.stats.metrics import NUM_BOOTSTRAP_RESAMPLES, interval

DEFAULT_THRESHOLD_TAU = 0.2
#: The largest tau drop a threshold may name: no drafter proposes more than about a hundred tokens a step,
#: so a larger threshold can never be crossed and would only switch the gate off.
MAX_TAU_DROP = 100.0
COMPARE_JSON_VERSION = 1
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
    # informational, never a regression by itself (dflash_doctor.stats.deviations.grown_patterns)
    grown_patterns: list[dict[str, Any]] = field(default_factory=list)

    @property
    def regressions(self) -> list[MetricComparison]:
        return [row for row in self.rows if row.regression]

    @property
    def has_regression(self) -> bool:
        return bool(self.regressions)

    def as_dict(self) -> dict[str, Any]:
        """`compare --json` (docs/user-guide.md "Machine-readable output"): keys are only ever added;
        ``compare_json_version`` changes if one is renamed or removed."""
        return {
            "compare_json_version": COMPARE_JSON_VERSION,
            "base": str(self.base_path),
            "new": str(self.new_path),
            "k_compared": self.k_compared,
            "threshold_tau": self.threshold_tau,
            "threshold_rate": self.threshold_rate,
            "regression": self.has_regression,
            "rows": [row.as_dict() for row in self.rows],
            "regressions": [row.as_dict() for row in self.regressions],
            "grown_patterns": self.grown_patterns,
            "notes": self.notes,
        }


@dataclass(frozen=True)
class Side:
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


NO_SIDE = Side(
    0, None, None, [], [], np.full(NUM_BOOTSTRAP_RESAMPLES, np.nan), np.full((NUM_BOOTSTRAP_RESAMPLES, 0), np.nan)
)


def _ci(values: Any) -> tuple[float, float] | None:
    if values is None or len(values) != 2:
        return None
    lo, hi = (float("nan") if x is None else float(x) for x in values)
    return None if np.isnan(lo) or np.isnan(hi) else (lo, hi)


def _finite(value: Any) -> float | None:
    return None if value is None or np.isnan(value) else float(value)


def compare_slice(
    cls: str, base: Side, new: Side, k: int, threshold_tau: float, threshold_rate: float
) -> list[MetricComparison]:
    """tau and r_1..r_k of one class in both runs, each with base/new/delta intervals and the gate's verdict.

    A row regresses only when its drop exceeds the threshold and the two intervals separate (module
    docstring); a row missing a value or an interval on either side is not gated, and its note says so.

    Args:
        cls: the class's name, or ``overall``.
        base: the BASE run's numbers for the class (:data:`NO_SIDE` when the class is not in it).
        new: the NEW run's numbers for the class.
        k: the compared draft length: rates are compared at slots 1..k.
        threshold_tau: the smallest tau drop (tokens per step) that can regress.
        threshold_rate: the smallest per-slot rate drop (a probability) that can regress.

    Returns:
        k + 1 rows: tau first, then the rate at each slot 1..k.
    """
    note = ""
    if base.num_units == 0 or new.num_units == 0:
        note = f"only in {'NEW' if base.num_units == 0 else 'BASE'}: not compared"

    def at(values: Sequence[Any], i: int) -> Any:
        return values[i] if i < len(values) else None

    def samples(side: Side, i: int) -> np.ndarray:
        return side.rate_samples[:, i] if i < side.rate_samples.shape[1] else np.full(NUM_BOOTSTRAP_RESAMPLES, np.nan)

    # (metric, slot, base value, base ci, new value, new ci, base samples, new samples, threshold)
    metrics = [
        (
            "mean_acceptance_length",
            None,
            base.tau,
            base.tau_ci,
            new.tau,
            new.tau_ci,
            base.tau_samples,
            new.tau_samples,
            threshold_tau,
        )
    ]
    metrics += [
        (
            "acceptance_rate_per_pos",
            i + 1,
            at(base.rates, i),
            at(base.rate_cis, i),
            at(new.rates, i),
            at(new.rate_cis, i),
            samples(base, i),
            samples(new, i),
            threshold_rate,
        )
        for i in range(k)
    ]
    rows = []
    for metric, slot, base_value, base_ci, new_value, new_ci, base_samples, new_samples, threshold in metrics:
        base_value, new_value, base_ci, new_ci = _finite(base_value), _finite(new_value), _ci(base_ci), _ci(new_ci)
        delta = delta_ci = None
        regression = False
        row_note = note
        if not note and base_ci is not None and new_ci is not None and base_value is not None and new_value is not None:
            delta = new_value - base_value
            delta_ci = _ci(interval(new_samples - base_samples))
            regression = -delta > threshold and new_ci[1] < base_ci[0]
        elif not note:
            # the rule needs both intervals: without one a drop cannot be told from noise, so it is not
            # gated, and the row says so instead of reading like a pass
            missing = [
                label
                for label, value, ci in (("BASE", base_value, base_ci), ("NEW", new_value, new_ci))
                if value is None or ci is None
            ]
            row_note = f"no 95% interval in {' and '.join(missing)}: not gated"
        rows.append(
            MetricComparison(
                cls=cls,
                metric=metric,
                slot=slot,
                base=base_value,
                base_ci=base_ci,
                new=new_value,
                new_ci=new_ci,
                delta=delta,
                delta_ci=delta_ci,
                threshold=threshold,
                regression=regression,
                note=row_note,
            )
        )
    return rows
