"""Net speedup of speculative decoding: step costs, the K sweep table and the per-class K recommendation.

Acceptance alone does not say whether speculation pays: vLLM PR #26504 shows acceptance flat from batch 1
to 32 while the right decision flips from +23% to -16%. So the doctor prices every K with step times:

    speedup(K) = tau(K) * t_decode / (t_draft(K) + t_verify(K))

``t_decode`` is one plain target decode step, ``t_verify(K)`` the target's forward over the 1 + K block
tokens, ``t_draft(K)`` the draft's cost for K tokens (K sequential steps for an autoregressive draft, one
block pass for DFlash, which is why its draft term is nearly flat in K). The times come from
:mod:`dflash_doctor.stats.step_costs` on the current device (timed with their spread and fitted under the
physics of a forward pass), or from a profile a user measured in a serving engine (:func:`load_cost_profile`,
``--cost-profile FILE``, format in docs/cost-profile.md).
:func:`leviathan_speedup` is the i.i.d. closed form of Leviathan et al. 2023, kept as a cross-check.

Every speedup has an interval that resamples the requests and the step timings together
(:func:`build_sweep`), and the advice reads it (:func:`recommend`): a K is named outright only when its
interval lies above plain decoding's 1.0x, speculation is "off" only when it lies below, and the Ks whose
speedup cannot be told from the best one's are named with it.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.run_record import OVERALL, Recommendation, StepCosts, Sweep, SweepRow
from dflash_doctor.stats.metrics import (
    NUM_BOOTSTRAP_RESAMPLES,
    expected_tau_iid,
    group_rng,
    interval,
    resample_multiplicities,
    tau_with_ci,
)
from dflash_doctor.stats.step_costs import CostSamples, cost_replicates

ESTIMATES = ("exact", "truncated")


def leviathan_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. 2023 walltime speedup with i.i.d. acceptance: the textbook figure beside the measured one.

    ``(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))`` is the general form with t_draft(K) = K c t_decode and
    t_verify(K) = t_decode (verifying K + 1 tokens costs one decode step), which holds only while
    verification stays memory-bound.

    Args:
        alpha: the chance each draft token is accepted, in [0, 1].
        k: draft tokens per step, >= 1.
        c: one draft step's cost over one target decode step.

    Returns:
        The speedup over plain decoding (1.0 = as fast).
    """
    return expected_tau_iid(alpha, k) / (k * c + 1.0)


# ----------------------------------------------------------------------------- cost profiles

_PROFILE_KEYS = ("t_decode_s", "t_verify_s", "t_draft_s", "device", "source", "notes", "spread")


def load_cost_profile(path: Path | str) -> StepCosts:
    """Read step times a user measured in their serving engine (``--cost-profile FILE``).

    TOML or JSON, by extension; times in seconds (see docs/cost-profile.md)::

        device = "H200, vLLM 0.11, batch 8"    # optional, shown next to every speedup
        t_decode_s = 0.0079                   # one plain decode step of the target
        t_draft_s = 0.0011                    # a number: the same at every K (a DFlash block pass)
        [t_verify_s]                          # a table: K = seconds, interpolated between the Ks given
        1 = 0.0081
        4 = 0.0086
        16 = 0.0112

    ``t_verify_s`` and ``t_draft_s`` are each a number or a ``K -> seconds`` table. ``notes`` is free
    text; ``source`` and ``spread`` (the timing's spread, :mod:`dflash_doctor.stats.step_costs`) are accepted
    and ignored, so the ``summary.sweep.costs`` block of a run.json is a valid JSON profile.

    Args:
        path: the profile file, ``.toml`` or ``.json``.

    Returns:
        The step costs, ``source`` "profile", taken as exact.

    Raises:
        UsageError: the file is missing or unreadable, or holds a typo, a missing field or a negative time.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"cost profile {path} does not exist; pass an existing .toml or .json file to --cost-profile.")
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise UsageError(
            f"cost profile {path} must be a .toml or .json file; rename it or convert it (see docs/cost-profile.md)."
        )
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        kind = "TOML" if suffix == ".toml" else "JSON"
        raise UsageError(
            f"cost profile {path} is not valid {kind} ({exc}); fix the file (see docs/cost-profile.md)."
        ) from None
    if not isinstance(data, dict):
        raise UsageError(
            f"cost profile {path} must hold an object with t_decode_s, t_verify_s and t_draft_s; fix the file."
        )

    unknown = sorted(set(data) - set(_PROFILE_KEYS))
    if unknown:
        raise UsageError(f"cost profile {path} has unknown keys {unknown}; use only {', '.join(_PROFILE_KEYS)}.")
    missing = [key for key in ("t_decode_s", "t_verify_s", "t_draft_s") if key not in data]
    if missing:
        raise UsageError(
            f"cost profile {path} lacks {', '.join(missing)}; add the step times in seconds (see docs/cost-profile.md)."
        )

    t_decode_s = _profile_seconds(path, "t_decode_s", data["t_decode_s"], allow_zero=False)
    device = data.get("device", f"profile {path.name}")
    if not isinstance(device, str):
        raise UsageError(
            f"cost profile {path}: device must be a string describing where the times were measured; fix it."
        )
    return StepCosts(
        t_decode_s=t_decode_s,
        t_verify_s=_profile_table(path, "t_verify_s", data["t_verify_s"], allow_zero=False),
        t_draft_s=_profile_table(path, "t_draft_s", data["t_draft_s"], allow_zero=True),
        source="profile",
        device=device,
    )


def _profile_seconds(path: Path, key: str, value: Any, *, allow_zero: bool) -> float:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not is_number or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise UsageError(f"cost profile {path}: {key} = {value!r} is not a number of seconds {bound}; fix the value.")
    return float(value)


def _profile_table(path: Path, key: str, value: Any, *, allow_zero: bool) -> dict[int, float]:
    """A number (same at every K, stored as K=1: a one-entry table applies to all K) or ``{K: seconds}``."""
    if not isinstance(value, dict):
        return {1: _profile_seconds(path, key, value, allow_zero=allow_zero)}
    if not value:
        raise UsageError(f"cost profile {path}: {key} is an empty table; give seconds per K, e.g. 1 = 0.008.")
    table = {}
    for k_text, seconds in value.items():
        try:
            k = int(k_text)
        except ValueError:
            k = 0
        if k < 1:
            raise UsageError(
                f"cost profile {path}: {key} has key {k_text!r}, not a K >= 1; use integer keys like 1, 4, 16."
            )
        table[k] = _profile_seconds(path, f"{key}.{k_text}", seconds, allow_zero=allow_zero)
    return table


# ----------------------------------------------------------------------------- sweep


def sweep_row(
    k: int,
    tau: float,
    tau_ci: list[float],
    speedup: float,
    estimate: str,
    speedup_ci: Sequence[float | None] = (None, None),
) -> SweepRow:
    """One row of run.json ``summary.sweep``, its floats made plain for JSON.

    Args:
        k: draft tokens per step.
        tau: mean acceptance length (vLLM's, per drafted step).
        tau_ci: tau's 95% interval ``[low, high]``.
        speedup: net speedup over plain decoding at this K.
        estimate: ``"exact"`` when tau came from a run at this K, ``"truncated"`` when cut down from a larger K.
        speedup_ci: the speedup's 95% interval ``[low, high]`` (None where not known).

    Returns:
        The sweep row.
    """
    if estimate not in ESTIMATES:
        raise ValueError(f"estimate must be one of {ESTIMATES}, got {estimate!r}")
    return SweepRow(
        k=int(k),
        mean_acceptance_length=float(tau),
        mean_acceptance_length_ci=[float(x) for x in tau_ci],
        speedup=float(speedup),
        estimate=estimate,
        speedup_ci=[None if x is None or not math.isfinite(x) else float(x) for x in speedup_ci],
    )


@dataclass(frozen=True)
class PricedSweep:
    """The sweep for run.json and its bootstrap replicates: ``replicates[scope][K]`` holds the speedup of
    each resample (requests and timings drawn together, the same draw for every K of a scope), which the
    advice needs to tell two Ks apart (a paired ratio) and run.json does not keep."""

    sweep: Sweep
    replicates: dict[str, dict[int, np.ndarray]]


def conversation_ids(request_ids: np.ndarray) -> np.ndarray:
    """The bootstrap's unit: the conversation a turn belongs to.

    The turns of one conversation share its prompt and its history, so resampling them as separate requests
    would narrow every interval with draws that are not independent.

    Args:
        request_ids: request ids of steps, ``<id>#t<turn>`` for a later turn.

    Returns:
        The conversation id of each (``<id>``), same shape.
    """
    return np.array([str(r).split("#t", 1)[0] for r in request_ids], dtype=object)


# ----------------------------------------------------------------------------- pricing steps


@dataclass(frozen=True)
class StepPrices:
    """What one step costs under B cost models (one per timing resample, or the point costs alone): ``decode``
    [B]; ``draft`` [B, K] at each K of ``ks``; ``verify`` [B, N + 1] with the target's time for a step that drafted
    n tokens in column n (column 0: nothing drafted, a plain decode step).

    Every step is priced by what it *really* drafted: an n-gram lookup without a match costs a decode step, a
    request's shortened last block verifies fewer tokens. For a drafter that drafts K on every step this is
    exactly ``tau x t_decode / (t_draft(K) + t_verify(K))``. A verify of fewer tokens than a cost table's
    smallest K is priced at that smallest K (never cheaper: the table does not reach lower)."""

    ks: tuple[int, ...]
    decode: np.ndarray
    draft: np.ndarray
    verify: np.ndarray

    @classmethod
    def of(cls, models: Sequence[StepCosts], ks: Sequence[int], max_drafted: int) -> "StepPrices":
        def verify(model: StepCosts, n: int) -> float:
            return model.t_decode_s if n == 0 else model.verify_s(max(n, min(model.t_verify_s)))

        return cls(
            tuple(ks),
            np.array([m.t_decode_s for m in models]),
            np.array([[m.draft_s(k) for k in ks] for m in models]),
            np.array([[verify(m, n) for n in range(max_drafted + 1)] for m in models]),
        )

    def speedup(
        self, k: int, emitted: np.ndarray, steps: np.ndarray, by_drafted: np.ndarray, models: np.ndarray
    ) -> np.ndarray:
        """Tokens emitted x t_decode / seconds of the steps, for pooled counts ``[c]``, ``[c]``, ``[c, N + 1]``
        each priced by cost model ``models[c]``."""
        draft = self.draft[models, self.ks.index(k)]
        spent = np.einsum("cn,cn->c", by_drafted, self.verify[models, : by_drafted.shape[1]]) + steps * draft
        with np.errstate(divide="ignore", invalid="ignore"):
            return emitted * self.decode[models] / spent


@dataclass(frozen=True)
class UnitSteps:
    """The steps at one K summed per unit (conversation): tokens
    emitted, steps, steps by tokens drafted ``[U, N + 1]``."""

    emitted: np.ndarray
    steps: np.ndarray
    by_drafted: np.ndarray

    @classmethod
    def of(cls, frame: pd.DataFrame, units: pd.Index, max_drafted: int) -> "UnitSteps":
        codes = units.get_indexer(pd.Index(conversation_ids(frame["request_id"].to_numpy())))
        drafted = frame["num_drafted"].to_numpy(dtype=np.int64)
        accepted = frame["num_accepted"].to_numpy(dtype=np.int64)
        cells = np.bincount(codes * (max_drafted + 1) + drafted, minlength=len(units) * (max_drafted + 1))
        return cls(
            np.bincount(codes, weights=accepted + 1, minlength=len(units)),
            np.bincount(codes, minlength=len(units)).astype(np.float64),
            cells.reshape(len(units), max_drafted + 1).astype(np.float64),
        )

    def point_speedup(self, prices: StepPrices, k: int) -> float:
        """The speedup of every unit taken once, under the first cost model of ``prices``."""
        return float(
            prices.speedup(
                k,
                self.emitted.sum(keepdims=True),
                self.steps.sum(keepdims=True),
                self.by_drafted.sum(axis=0, keepdims=True),
                np.zeros(1, dtype=np.int64),
            )[0]
        )

    def replicates(self, prices: StepPrices, k: int, multiplicity: np.ndarray, rows: slice) -> np.ndarray:
        """Speedup of each resample in ``multiplicity`` ``[c, U]`` (resamples ``rows`` of the bootstrap), each
        priced by its own cost model (``rows`` modulo the models: one model = the costs taken as exact)."""
        models = np.arange(rows.start, rows.stop) % len(prices.decode)
        return prices.speedup(
            k, multiplicity @ self.emitted, multiplicity @ self.steps, multiplicity @ self.by_drafted, models
        )


def max_drafted(frames: Iterable[pd.DataFrame]) -> int:
    """The widest draft any step made: the Ks a timing must price.

    Args:
        frames: steps tables (``num_drafted`` per step).

    Returns:
        The largest ``num_drafted``, 0 when no step drafted.
    """
    return max([int(f["num_drafted"].max()) for f in frames if len(f)] + [0])


def units_of(frames: Iterable[pd.DataFrame]) -> pd.Index:
    """The bootstrap units (conversations) of some steps, in order of appearance.

    Args:
        frames: steps tables (``request_id`` per step).

    Returns:
        The distinct conversation ids.
    """
    return pd.Index(pd.unique(np.concatenate([conversation_ids(f["request_id"].to_numpy()) for f in frames])))


def build_sweep(
    steps_by_k: dict[int, pd.DataFrame],
    costs: StepCosts,
    estimate_by_k: dict[int, str],
    *,
    cost_samples: CostSamples | None = None,
    n_boot: int = NUM_BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> PricedSweep:
    """run.json ``summary.sweep``: tau and speedup with their intervals per K, overall and per class.

    tau is vLLM's (per drafted step); the speedup prices every step by what it drafted (:class:`StepPrices`).
    Each resample pairs one draw of conversations with one refit of the costs from resampled timings, so the
    intervals carry both the requests' and the timing's noise.

    Args:
        steps_by_k: per K, the steps of a run (live or teacher-forced) at K drafted tokens.
        costs: the step costs that price the points.
        estimate_by_k: per K, ``"exact"`` when its steps are the ones a live run at K takes, ``"truncated"``
            when they were cut down from a larger K (:func:`dflash_doctor.stats.metrics.truncate_steps`).
        cost_samples: the raw timings ``costs`` was fitted from; None takes the costs as exact.
        n_boot: bootstrap resamples.
        seed: seeds the resamples.

    Returns:
        The sweep and, per scope, the speedup replicates of every K (the paired draws :func:`recommend` compares).
    """
    missing = sorted(set(steps_by_k) - set(estimate_by_k))
    if missing:
        raise ValueError(f"estimate_by_k has no entry for K {missing}")
    ks = sorted(steps_by_k)
    largest = max_drafted(steps_by_k.values())
    point = StepPrices.of([costs], ks, largest)
    models = [costs] if cost_samples is None else cost_replicates(cost_samples, n_boot, group_rng(seed, "timing"))
    resampled = StepPrices.of(models, ks, largest)
    scopes: dict[str, dict[int, pd.DataFrame]] = {OVERALL: {k: steps_by_k[k] for k in ks}}
    for k in ks:
        for cls, class_steps in steps_by_k[k].groupby("class", sort=True):
            scopes.setdefault(str(cls), {})[k] = class_steps
    rows_by_scope: dict[str, list[SweepRow]] = {}
    replicates: dict[str, dict[int, np.ndarray]] = {}
    for scope, frames in scopes.items():
        group = OVERALL if scope == OVERALL else f"class:{scope}"
        units = units_of(frames.values())
        counts = {k: UnitSteps.of(frame, units, largest) for k, frame in frames.items()}
        replicates[scope] = {k: np.full(n_boot, np.nan) for k in frames}
        for rows, multiplicity in resample_multiplicities(len(units), n_boot, group_rng(seed, f"speedup:{group}")):
            for k, unit_steps in counts.items():
                replicates[scope][k][rows] = unit_steps.replicates(resampled, k, multiplicity, rows)
        rows_by_scope[scope] = []
        for k, frame in frames.items():
            tau, tau_ci = tau_with_ci(frame, n_boot=n_boot, seed=seed, group=group)
            speedup_ci = [float(x) for x in interval(replicates[scope][k])]
            rows_by_scope[scope].append(
                sweep_row(k, tau, tau_ci, counts[k].point_speedup(point, k), estimate_by_k[k], speedup_ci)
            )
    overall = rows_by_scope.pop(OVERALL)
    sweep = Sweep(overall=overall, by_class=rows_by_scope, costs=_costs_block(costs, cost_samples))
    return PricedSweep(sweep, replicates)


def _costs_block(costs: StepCosts, cost_samples: CostSamples | None) -> dict[str, Any]:
    """run.json ``summary.sweep.costs``: the fitted costs, plus their spread when they were timed here."""
    block = costs.as_dict()
    if cost_samples is not None:
        block["spread"] = cost_samples.spread()
    return block


# ----------------------------------------------------------------------------- recommendation


def recommend(
    sweep_rows_by_scope: Mapping[str, Sequence[SweepRow]],
    *,
    replicates: Mapping[str, Mapping[int, np.ndarray]] | None = None,
    timing_violations: Sequence[str] = (),
    shape_effect_ks: Iterable[int] = (),
    conservative_share: float = 0.95,
    strict_classes: Iterable[str] = (),
    strict_max_k: int = 4,
) -> dict[str, Recommendation]:
    """run.json ``recommendation``: per scope, the K to serve, a conservative K, the speedup and why.

    * ``k``: the K with the best point speedup (the smaller K on a tie), named with the interval of its
      speedup (:class:`dflash_doctor.rundir.run_record.Recommendation` says how ``confidence`` follows from
      it); 0 (speculation off) when the interval lies below 1.
    * ``ks_within_noise``: the Ks whose speedup the measurement cannot tell from the best.
    * ``conservative_k``: the smallest K whose speedup is within ``conservative_share`` of the best:
      fewer wasted verify tokens and less exposure if acceptance drops, for almost the same gain.
    * Strict classes (they must never risk a slowdown) only consider K <= ``strict_max_k``, rank each K by
      the low end of its speedup interval, and speculate only when that low end reaches 1.

    A row without a speedup interval (a sweep written before intervals) takes tau's: at fixed costs the
    speedup is proportional to tau.

    Args:
        sweep_rows_by_scope: the sweep's rows per scope (overall and each class; ``Sweep.scopes()``).
        replicates: per scope and K, the paired bootstrap speedups of :func:`build_sweep`; without them, the Ks
            within noise are those whose interval reaches the best point speedup.
        timing_violations: breaks of the cost model's physics the first timing and the re-timing disagreed
            on (:mod:`dflash_doctor.stats.step_costs`); no advice is given on them.
        shape_effect_ks: the Ks whose costs the fit pooled because the re-timing reproduced a break of the
            cost model's order (this machine's kernels price those shapes out of order); a best K among them is
            at most ``uncertain`` and the reason says why.
        conservative_share: the share of the best speedup the conservative K keeps, in (0, 1].
        strict_classes: the classes judged at the low end of their intervals.
        strict_max_k: the largest K a strict class may take, >= 1.

    Returns:
        Per scope, the recommendation.
    """
    if not 0.0 < conservative_share <= 1.0:
        raise ValueError(f"conservative_share must be in (0, 1], got {conservative_share}")
    if strict_max_k < 1:
        raise ValueError(f"strict_max_k must be >= 1, got {strict_max_k}")
    strict = set(strict_classes)
    return {
        name: _recommend_one(
            rows,
            (replicates or {}).get(name),
            tuple(timing_violations),
            frozenset(shape_effect_ks),
            conservative_share,
            strict_max_k if name in strict else None,
        )
        for name, rows in sweep_rows_by_scope.items()
    }


def speedup_interval(row: SweepRow) -> tuple[float, float] | None:
    """A row's speedup interval, tau's scaled when the row has none (a sweep written before intervals).

    Args:
        row: one sweep row.

    Returns:
        ``(low, high)``, or None when neither interval is known.
    """
    speedup = _point_speedup(row)
    low, high = (row.speedup_ci or [None, None])[:2]
    if low is not None and high is not None and math.isfinite(low) and math.isfinite(high):
        return float(low), float(high)
    tau = row.mean_acceptance_length
    tau_low, tau_high = (row.mean_acceptance_length_ci or [None, None])[:2]
    if (
        tau is None
        or not tau
        or tau_low is None
        or tau_high is None
        or not (math.isfinite(tau_low) and math.isfinite(tau_high))
    ):
        return None
    return speedup * min(tau_low, tau) / tau, speedup * max(tau_high, tau) / tau


def _pessimistic_speedup(row: SweepRow) -> float:
    """Speedup at the low end of its interval; the point speedup when the row has no usable interval."""
    bounds = speedup_interval(row)
    return _point_speedup(row) if bounds is None else bounds[0]


def _point_speedup(row: SweepRow) -> float:
    assert row.speedup is not None, "only priced rows (_is_priced) are ranked"
    return row.speedup


def _is_priced(row: SweepRow) -> bool:
    return row.speedup is not None and math.isfinite(row.speedup) and row.k >= 1


def priced_speedups(rows: Iterable[SweepRow]) -> dict[int, float]:
    """The speedups the advice may choose from: rows priced at a finite speedup and K >= 1.

    Args:
        rows: sweep rows of one scope.

    Returns:
        ``{K: speedup}`` in K order.
    """
    return {row.k: _point_speedup(row) for row in sorted(rows, key=lambda row: row.k) if _is_priced(row)}


def best_speedup(speedups: Mapping[int, float]) -> tuple[int, float]:
    """The best K of some priced speedups, the smallest K on a tie (fewer wasted verify tokens for the same gain).

    Args:
        speedups: ``{K: speedup}``, not empty.

    Returns:
        ``(K, speedup)`` of the best.
    """
    k = max(sorted(speedups), key=speedups.__getitem__)
    return k, speedups[k]


def k_that_pays(best: tuple[int, float], floor: float = 1.0) -> int:
    """The best K when its speedup reaches ``floor``, else 0: speculation off.

    The one rule behind run.json's ``recommendation``, the speculative-k check's suggested K and watch's
    fallback advice, so the three never name different Ks for the same prices.

    Args:
        best: ``(K, speedup)`` of the best K.
        floor: the speedup the K must reach (plain decoding runs at 1.0x).

    Returns:
        The K to serve, 0 for speculation off.
    """
    k, speedup = best
    return k if speedup >= floor else 0


def within_noise(best_k: int, candidates: Sequence[SweepRow], replicates: Mapping[int, np.ndarray] | None) -> list[int]:
    """The Ks whose speedup the measurement cannot tell from the best K's.

    A K is within the noise when the 95% interval of the paired ratio speedup(K) / speedup(best) reaches 1;
    without replicates, when the K's own interval reaches the best point speedup.

    Args:
        best_k: the best K, one of ``candidates``.
        candidates: the priced sweep rows of one scope.
        replicates: per K, the paired bootstrap speedups; None when the sweep has none.

    Returns:
        The Ks within the noise, the best among them, in the candidates' order.
    """
    best = next(row for row in candidates if row.k == best_k)
    ks = []
    for row in candidates:
        if row.k == best_k:
            ks.append(row.k)
        elif replicates is not None and row.k in replicates and best_k in replicates:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios = replicates[row.k] / replicates[best_k]
            finite = ratios[np.isfinite(ratios)]
            if len(finite) and interval(finite)[1] >= 1.0:
                ks.append(row.k)
        elif (bounds := speedup_interval(row)) is not None and bounds[1] >= _point_speedup(best):
            ks.append(row.k)
    return ks


def k_range_text(ks: Sequence[int]) -> str:
    """The Ks a measurement cannot tell apart, worded for a reason.

    Args:
        ks: the Ks, in any order.

    Returns:
        ``K 2-8`` for three or more consecutive Ks, ``K 2, 4, 8`` otherwise.
    """
    ks = sorted(ks)
    if len(ks) > 2 and ks == list(range(ks[0], ks[-1] + 1)):
        return f"K {ks[0]}-{ks[-1]}"
    return "K " + ", ".join(map(str, ks))


_POOLED = (
    "; its costs are pooled with its neighbours' (this machine's kernels break the cost model's order: "
    "see the timing check)"
)


def _recommend_one(
    rows: Sequence[SweepRow],
    replicates: Mapping[int, np.ndarray] | None,
    violations: tuple[str, ...],
    pooled_ks: frozenset[int],
    share: float,
    strict_max_k: int | None,
) -> Recommendation:
    candidates = sorted((row for row in rows if _is_priced(row)), key=lambda row: row.k)
    strict = strict_max_k is not None
    score = _point_speedup
    note = ""
    if strict_max_k is not None:
        candidates = [row for row in candidates if row.k <= strict_max_k]
        score = _pessimistic_speedup
        note = f" (strict class: K <= {strict_max_k}, judged at the low end of the speedup's 95% interval)"
    if violations:
        return Recommendation(
            k=0,
            conservative_k=0,
            speedup=None,
            confidence="unreliable",
            reason=f"No advice: the step timings changed while they were taken ({violations[0]}); "
            "rerun on a quiet machine, give the timing more time (--timing-budget) or price with "
            "--cost-profile.",
        )
    if not candidates:
        swept = f"no K <= {strict_max_k}" if strict else "no K"
        return _speculation_off(f"Speculation off: {swept} was priced (no draft steps or no sweep rows){note}.")

    best_k, best_score = best_speedup({row.k: score(row) for row in candidates})
    best = next(row for row in candidates if row.k == best_k)
    bounds = speedup_interval(best)
    noise_ks = within_noise(best_k, candidates, replicates)
    ci: list[float | None] = [bounds[0], bounds[1]] if bounds is not None else [None, None]
    described = _describe(best, bounds)
    if bounds is not None and bounds[1] < 1.0:
        return _speculation_off(
            f"Speculation off: even the best, K={best.k}, runs at {described}, slower than plain decoding{note}.", ci
        )
    pays = bounds is None or bounds[0] >= 1.0
    if (strict or k_that_pays((best_k, _point_speedup(best))) == 0) and not pays:
        return Recommendation(
            k=0,
            conservative_k=0,
            speedup=1.0,
            speedup_ci=ci,
            ks_within_noise=noise_ks,
            confidence="uncertain",
            reason=f"Speculation may not pay: the best, K={best.k}, runs at {described}, within the noise of "
            f"plain decoding{note}; off until more requests or a longer timing tell.",
        )
    conservative = next(row for row in candidates if score(row) >= share * best_score)
    if conservative.k == best.k:
        tail = f"no smaller K keeps {share:.0%} of it"
    else:
        tail = (
            f"K={conservative.k} keeps {score(conservative) / best_score:.0%} "
            f"of it at {_point_speedup(conservative):.2f}x"
        )
    noise = f"; {k_range_text(noise_ks)} within the noise" if len(noise_ks) > 1 else ""
    doubt = "" if pays else "; it may not pay: its interval includes plain decoding's 1.0x"
    pooled = best.k in pooled_ks
    doubt += _POOLED if pooled else ""
    return Recommendation(
        k=int(best.k),
        conservative_k=int(conservative.k),
        speedup=float(_point_speedup(best)),
        speedup_ci=ci,
        ks_within_noise=noise_ks,
        confidence="clear" if pays and not pooled else "uncertain",
        reason=f"K={best.k} is the best at {described}{noise}{doubt}; {tail}{note}.",
    )


def _speculation_off(reason: str, speedup_ci: list[float | None] | None = None) -> Recommendation:
    return Recommendation(k=0, conservative_k=0, speedup=1.0, reason=reason, speedup_ci=speedup_ci or [None, None])


def _describe(row: SweepRow, bounds: tuple[float, float] | None) -> str:
    """'2.31x [2.10, 2.52] (tau 4.10)' with a truncation note."""
    tau = row.mean_acceptance_length
    spread = f" [{bounds[0]:.2f}, {bounds[1]:.2f}]" if bounds is not None else ""
    text = f"{_point_speedup(row):.2f}x{spread} (tau {'not reported' if tau is None else f'{tau:.2f}'}"
    if row.estimate == "truncated":
        text += ", truncated estimate"
    return text + ")"
