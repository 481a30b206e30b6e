"""Canary: ``dflash-doctor compare BASE NEW`` on two watch runs (two sources, or the same source before and after),
or on two label values of one watch: ``compare RUN#stable RUN#canary`` compares the series of class
``stable`` with those of class ``canary`` (a watch with ``--class-label deployment``, say).

The rule is the one for runs, applied by the same code (``compare.compare_slice``): a metric regresses
when it drops by more than its threshold AND the 95% intervals separate. A watch has no requests, so the
resampled unit (the project's bootstrap, :mod:`dflash_doctor.stats.metrics`) is the scrape interval
(``units.parquet``: non-overlapping counts; overlapping windows would be counted twice). With fewer than
:data:`MIN_UNITS_FOR_BOOTSTRAP` intervals a bootstrap has no spread to measure, so that side's
intervals come from the counts instead and a note says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dflash_doctor.stats.gate import DEFAULT_THRESHOLD_RATE, DEFAULT_THRESHOLD_TAU, Comparison, compare_slice, Side
from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.run_record import OVERALL
from dflash_doctor.stats.metrics import NUM_BOOTSTRAP_RESAMPLES, bootstrap_ratio, group_rng, interval
from dflash_doctor.rundir.run_record import RunRecord
from dflash_doctor.rundir.load import read_run_meta
from dflash_doctor.rundir.tables import RUN_JSON
from dflash_doctor.telemetry.counts import MIN_UNITS_FOR_BOOTSTRAP, SpecCounts, rate_intervals, tau_interval
from dflash_doctor.telemetry.watch_record import is_watch_run, read_units


def split_spec(spec: str | Path) -> tuple[Path, str | None]:
    """``RUN`` or ``RUN#CLASS`` (one label value of a watch) -> (run directory, class or None)."""
    text = str(spec)
    if "#" in text and not Path(text).exists():
        run, cls = text.rsplit("#", 1)
        return Path(run), cls
    return Path(text), None


def is_watch_dir(spec: str | Path) -> bool:
    path, _ = split_spec(spec)
    return (path / RUN_JSON).is_file() and is_watch_run(RunRecord.from_json(read_run_meta(path)))


def _positions(per_pos: Any) -> int:
    """How many positions a unit's per-position counts cover (None: the source reports none)."""
    return 0 if per_pos is None else len(per_pos)


def _side(units: pd.DataFrame, k: int, group: str) -> Side:
    """One watch's numbers for one class at K, in the shape compare's rule reads: pooled tau and rates with
    their intervals, and bootstrap resamples over scrape intervals (the same resamples for every metric).

    With fewer than :data:`MIN_UNITS_FOR_BOOTSTRAP` intervals the intervals come from the counts instead
    (:func:`tau_interval`; a normal interval of each rate over the drafts)."""
    rows = units[units["num_drafts"].fillna(0) > 0]
    rows = rows[rows["num_accepted_tokens_per_pos"].map(lambda v: _positions(v) >= k)]
    drafts = rows["num_drafts"].to_numpy(dtype=float)  # [N]
    per_pos = np.array([list(v)[:k] for v in rows["num_accepted_tokens_per_pos"]], dtype=float).reshape(
        len(rows), k
    )  # [N, K]
    if not len(rows):
        return Side(
            0,
            None,
            None,
            [],
            [],
            np.full(NUM_BOOTSTRAP_RESAMPLES, np.nan),
            np.full((NUM_BOOTSTRAP_RESAMPLES, k), np.nan),
        )
    total_drafts, total_per_pos = drafts.sum(), per_pos.sum(axis=0)
    resample = lambda numerator: bootstrap_ratio(numerator, drafts, NUM_BOOTSTRAP_RESAMPLES, group_rng(0, group))  # noqa: E731
    tau_samples = 1.0 + resample(per_pos.sum(axis=1))  # [B]
    rate_samples = np.column_stack([resample(per_pos[:, i]) for i in range(k)])  # [B, K]
    rates = total_per_pos / total_drafts
    if len(rows) >= MIN_UNITS_FOR_BOOTSTRAP:
        tau_ci = list(interval(tau_samples))
        rate_cis = [list(ci) for ci in interval(rate_samples)]
    else:
        pooled = SpecCounts(
            num_drafts=total_drafts,
            num_accepted_tokens=float(total_per_pos.sum()),
            num_accepted_tokens_per_pos=tuple(total_per_pos),
        )
        pooled_tau_ci = tau_interval(pooled)
        tau_ci, rate_cis = list(pooled_tau_ci) if pooled_tau_ci is not None else None, rate_intervals(pooled)
    return Side(
        len(rows),
        1.0 + float(rates.sum()),
        tau_ci,
        [float(r) for r in rates],
        rate_cis or [],
        tau_samples,
        rate_samples,
    )


def compare_watch_runs(
    base: str | Path,
    new: str | Path,
    *,
    threshold_tau: float = DEFAULT_THRESHOLD_TAU,
    threshold_rate: float = DEFAULT_THRESHOLD_RATE,
) -> Comparison:
    """Per class (and overall) tau and per-position rates of two watch runs, compare's rule."""
    (base_path, base_cls), (new_path, new_cls) = split_spec(base), split_spec(new)
    base_units, new_units = read_units(base_path), read_units(new_path)
    for cls, units, spec in ((base_cls, base_units, base), (new_cls, new_units, new)):
        if cls is not None and not (units["class"] == cls).any():
            raise UsageError(
                f"{spec}: the watch has no series of class {cls!r}; its classes "
                f"are {', '.join(sorted(set(units['class']))) or 'none'}."
            )
    if base_cls is not None or new_cls is not None:  # two label values: the two slices, compared as one
        base_units = base_units[base_units["class"] == base_cls] if base_cls else base_units
        new_units = new_units[new_units["class"] == new_cls] if new_cls else new_units
        base_units, new_units = base_units.assign(**{"class": "all"}), new_units.assign(**{"class": "all"})
    k_base, k_new = (_largest_k(u) for u in (base_units, new_units))
    k = min(k_base, k_new)
    comparison = Comparison(base_path, new_path, threshold_tau, threshold_rate, k)
    if base_cls is not None or new_cls is not None:
        comparison.notes.append(
            f"BASE = {base_cls or 'every series'} of {base_path.name}, "
            f"NEW = {new_cls or 'every series'} of {new_path.name}."
        )
    if not k:
        comparison.notes.append(
            "one of the watches has no scrape interval with per-position counts "
            "(needs an engine exporting them, e.g. vLLM): nothing compared."
        )
        return comparison
    if k_base != k_new:
        comparison.notes.append(f"BASE drafted K={k_base} and NEW K={k_new}: compared at K={k} by truncation.")
    classes = sorted(set(base_units["class"]) | set(new_units["class"]))
    slices = [
        (cls, base_units[base_units["class"] == cls], new_units[new_units["class"] == cls])
        for cls in classes
        if cls != "all"
    ]
    slices.append((OVERALL, base_units, new_units))
    few = False
    for cls, base_slice, new_slice in slices:
        base_side, new_side = _side(base_slice, k, f"base:{cls}"), _side(new_slice, k, f"new:{cls}")
        few = few or 0 < min(base_side.num_units, new_side.num_units) < MIN_UNITS_FOR_BOOTSTRAP
        comparison.rows += compare_slice(cls, base_side, new_side, k, threshold_tau, threshold_rate)
    if few:
        comparison.notes.append(
            f"a side has fewer than {MIN_UNITS_FOR_BOOTSTRAP} scrape intervals: "
            "its intervals come from the counts (drafts treated as independent)."
        )
    return comparison


def _largest_k(units: pd.DataFrame) -> int:
    lengths = [len(v) for v in units["num_accepted_tokens_per_pos"] if v is not None]
    if not lengths:
        return 0
    return max(lengths)
