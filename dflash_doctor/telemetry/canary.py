"""Canary: ``dflash-doctor compare BASE NEW`` on two watch runs (two sources, or the same source before and after),
or on two label values of one watch: ``compare RUN#stable RUN#canary`` compares the series of class
``stable`` with those of class ``canary`` (a watch with ``--class-label deployment``, say).

The rule is the one for runs (:mod:`dflash_doctor.compare`): a metric regresses when it drops by more
than its threshold AND the 95% intervals separate. A watch has no requests, so the resampled unit is
the scrape interval (``units.parquet``: non-overlapping counts; overlapping windows would be counted
twice). With fewer than :data:`MIN_UNITS_FOR_BOOTSTRAP` intervals a bootstrap has no spread to measure,
so that side's intervals come from the counts instead (:func:`tau_interval`, and a normal interval of
each per-position rate over the drafts) and a note says so.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pandas as pd

from dflash_doctor.compare import (
    CONFIDENCE_LEVEL, DEFAULT_THRESHOLD_RATE, DEFAULT_THRESHOLD_TAU, OVERALL, Comparison, MetricComparison, RequestCounts, compare_counts,
)
from dflash_doctor.errors import UsageError
from dflash_doctor.schema import RUN_JSON, read_run_meta
from dflash_doctor.telemetry.counts import MIN_UNITS_FOR_BOOTSTRAP, SpecCounts, tau_interval
from dflash_doctor.telemetry.record import is_watch_run, read_units


def split_spec(spec: str | Path) -> tuple[Path, str | None]:
    """``RUN`` or ``RUN#CLASS`` (one label value of a watch) -> (run directory, class or None)."""
    text = str(spec)
    if "#" in text and not Path(text).exists():
        run, cls = text.rsplit("#", 1)
        return Path(run), cls
    return Path(text), None


def is_watch_dir(spec: str | Path) -> bool:
    path, _ = split_spec(spec)
    return (path / RUN_JSON).is_file() and is_watch_run(read_run_meta(path))


def _unit_counts(units: pd.DataFrame, k: int) -> RequestCounts:
    """Scrape intervals with per-position counts as compare's per-unit arrays (drafts [N], per-pos [N, K])."""
    rows = units[units["num_drafts"].fillna(0) > 0]
    rows = rows[rows["num_accepted_tokens_per_pos"].map(lambda v: v is not None and len(v) >= k)]
    per_pos = np.array([list(v)[:k] for v in rows["num_accepted_tokens_per_pos"]], dtype=float).reshape(len(rows), k)
    return RequestCounts(rows["num_drafts"].to_numpy(dtype=float), per_pos)


def _count_interval(row: MetricComparison, counts: RequestCounts) -> tuple[float, float] | None:
    drafts = float(counts.num_drafts.sum())
    per_pos = counts.accepted_per_pos.sum(axis=0)
    if drafts <= 0:
        return None
    if row.slot is None:
        pooled = SpecCounts(num_drafts=drafts, num_accepted_tokens=float(per_pos.sum()), num_accepted_tokens_per_pos=tuple(per_pos))
        return tau_interval(pooled)
    rate = per_pos[row.slot - 1] / drafts
    half = NormalDist().inv_cdf((1 + CONFIDENCE_LEVEL) / 2) * math.sqrt(max(rate * (1 - rate), 0.0) / drafts)
    return (rate - half, rate + half)


def _with_count_intervals(rows: list[MetricComparison], base: RequestCounts, new: RequestCounts) -> list[MetricComparison]:
    """Replace bootstrap intervals by count intervals on a side with too few scrape intervals; re-decide."""
    fixed = []
    for row in rows:
        base_ci = _count_interval(row, base) if base.num_requests < MIN_UNITS_FOR_BOOTSTRAP else row.base_ci
        new_ci = _count_interval(row, new) if new.num_requests < MIN_UNITS_FOR_BOOTSTRAP else row.new_ci
        comparable = row.delta is not None and base_ci is not None and new_ci is not None
        regression = bool(comparable and -row.delta > row.threshold and new_ci[1] < base_ci[0])
        fixed.append(replace(row, base_ci=base_ci, new_ci=new_ci, regression=regression))
    return fixed


def compare_watch_runs(base: str | Path, new: str | Path, *, threshold_tau: float = DEFAULT_THRESHOLD_TAU, threshold_rate: float = DEFAULT_THRESHOLD_RATE, seed: int = 0) -> Comparison:
    """Per class (and overall) tau and per-position rates of two watch runs, compare's rule."""
    (base_path, base_cls), (new_path, new_cls) = split_spec(base), split_spec(new)
    base_units, new_units = read_units(base_path), read_units(new_path)
    for cls, units, spec in ((base_cls, base_units, base), (new_cls, new_units, new)):
        if cls is not None and not (units["class"] == cls).any():
            raise UsageError(f"{spec}: the watch has no series of class {cls!r}; its classes are {', '.join(sorted(set(units['class']))) or 'none'}.")
    if base_cls is not None or new_cls is not None:  # two label values: the two slices, compared as one
        base_units = base_units[base_units["class"] == base_cls] if base_cls else base_units
        new_units = new_units[new_units["class"] == new_cls] if new_cls else new_units
        base_units, new_units = base_units.assign(**{"class": "all"}), new_units.assign(**{"class": "all"})
    k_base, k_new = (_largest_k(u) for u in (base_units, new_units))
    k = min(k_base, k_new)
    comparison = Comparison(base_path, new_path, threshold_tau, threshold_rate, k)
    if base_cls is not None or new_cls is not None:
        comparison.notes.append(f"BASE = {base_cls or 'every series'} of {base_path.name}, NEW = {new_cls or 'every series'} of {new_path.name}.")
    if not k:
        comparison.notes.append("one of the watches has no scrape interval with per-position counts (needs an engine exporting them, e.g. vLLM): nothing compared.")
        return comparison
    if k_base != k_new:
        comparison.notes.append(f"BASE drafted K={k_base} and NEW K={k_new}: compared at K={k} by truncation.")
    classes = sorted(set(base_units["class"]) | set(new_units["class"]))
    slices = [(cls, base_units[base_units["class"] == cls], new_units[new_units["class"] == cls]) for cls in classes if cls != "all"]
    slices.append((OVERALL, base_units, new_units))
    few = False
    for cls, base_slice, new_slice in slices:
        base_counts, new_counts = _unit_counts(base_slice, k), _unit_counts(new_slice, k)
        few = few or min(base_counts.num_requests, new_counts.num_requests) < MIN_UNITS_FOR_BOOTSTRAP
        rows = compare_counts(cls, base_counts, new_counts, k, threshold_tau, threshold_rate, seed)
        comparison.rows += _with_count_intervals(rows, base_counts, new_counts)
    if few:
        comparison.notes.append(f"a side has fewer than {MIN_UNITS_FOR_BOOTSTRAP} scrape intervals: its intervals come from the counts (drafts treated as independent).")
    return comparison


def _largest_k(units: pd.DataFrame) -> int:
    lengths = [len(v) for v in units["num_accepted_tokens_per_pos"] if v is not None]
    if not lengths:
        return 0
    return max(lengths)
