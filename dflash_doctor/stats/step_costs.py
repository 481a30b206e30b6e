"""Step costs with their spread: timed until tight, fitted under the physics of a forward pass, resampled.

Why: every K and "deploy X" the doctor gives is a ratio of step times, and one noisy median decided it
before (a verify of 5 tokens "cost" 199 ms against 321 ms for a decode of one on a busy machine, and the
advice flipped from "speculation off" to "K=4, 2.3x" seven minutes later). So the costs are handled as
measurements, never as single numbers:

* **Timing** (:func:`time_steps`): every step kind - a plain decode (``("decode", 0)``), a verify of 1 + K
  tokens (``("verify", K)``) and a draft of K tokens (``("draft", K)``) at each probed K - runs once per
  round, in a fresh random order each round, so a busy spell of the machine spreads over every kind
  instead of landing on one. Rounds go on until the 95% interval of every kind's median is within
  ``target`` (5%) of it or the time budget is spent.
* **Model** (:func:`fit_step_costs`): a verify forwards 1 + K tokens and a decode forwards one, with the
  same weights and cache, so the cost never falls as tokens are added: decode, verify(K1), verify(K2)...
  are fitted non-decreasing (weighted isotonic regression, each median weighted by its precision). A
  block drafter (DFlash) drafts one block whatever K, so its draft cost is one constant; an
  autoregressive draft runs K steps, so its cost is non-decreasing in K.
* **Physics check** (:func:`physics_violations`): raw medians that break that order beyond their own noise
  (the more expensive kind's interval lies wholly below the cheaper one's) are re-timed once. A break the
  re-timing shows again on its own samples is a property of this machine's kernels, not noise (a CPU GEMM
  can run 16 rows faster than 9, every time): it is kept as a *shape effect*, the fit pools those kinds,
  and advice on the Ks they price is marked uncertain. So is a break the pooled samples still show where
  each kind's median sits where it sat in the first timing (the re-timing, with fewer samples, may lack
  the power to show it alone). A break whose kinds moved between the two timings (their medians' intervals
  do not overlap) means the machine changed under the timing: that is a *violation*, and no advice is
  built on it.
* **Replicates** (:func:`cost_replicates`): the timing bootstrap: each kind's samples resampled, the
  model refitted, so speedup intervals carry the timing's uncertainty next to the requests'.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from dflash_doctor.rundir.run_record import StepCosts

StepKey = tuple[str, int]  # ("decode", 0), ("verify", K), ("draft", K)
DECODE: StepKey = ("decode", 0)
TARGET_RELATIVE_HALF_WIDTH = 0.05  # a median known within +-5% prices a speedup within about +-7%
MIN_ROUNDS = 6  # the fewest samples whose order statistics give a 95% interval of the median
MAX_ROUNDS = 400
DEFAULT_TIMING_BUDGET_S = 20.0  # about a tenth of the demo check on two CPU cores; --timing-budget changes it
_Z95 = 1.959964


def median_interval(values: Sequence[float] | np.ndarray) -> tuple[float, float, float]:
    """The median and its distribution-free 95% interval, from order statistics.

    Step times are skewed (a preempted repeat is 10x the others), so no normal approximation: the
    interval is the pair of order statistics whose ranks a Binomial(n, 1/2) brackets with 95%. With fewer
    than :data:`MIN_ROUNDS` samples no such pair exists and the interval is the whole range.

    Args:
        values: the samples of one step kind, seconds, in any order.

    Returns:
        ``(median, low, high)``; all NaN for no samples.
    """
    x = np.sort(np.asarray(values, dtype=np.float64))
    n = len(x)
    if n == 0:
        return math.nan, math.nan, math.nan
    median = float(np.median(x))
    if n < MIN_ROUNDS:
        return median, float(x[0]), float(x[-1])
    half = _Z95 * math.sqrt(n) / 2.0
    low = max(int(math.floor(n / 2.0 - half)), 0)
    high = min(int(math.ceil(n / 2.0 + half)), n - 1)
    return median, float(x[low]), float(x[high])


def relative_half_width(values: Sequence[float] | np.ndarray) -> float:
    """How tightly a median is known: the stopping rule of :func:`time_steps` and the spread a report prints.

    Args:
        values: the samples of one step kind, seconds.

    Returns:
        Half the width of the median's 95% interval over the median; inf when the median is not positive.
    """
    median, low, high = median_interval(values)
    return (high - low) / 2.0 / median if median > 0 else math.inf


@dataclass(frozen=True)
class CostSamples:
    """The raw step times of one timing (seconds per ``(kind, K)``, in the order they were taken) and how
    they were taken: ``flat_draft`` for a block drafter, the budget and rounds, the kinds re-timed."""

    seconds: Mapping[StepKey, tuple[float, ...]]
    device: str
    flat_draft: bool
    budget_s: float = DEFAULT_TIMING_BUDGET_S
    retimed: tuple[StepKey, ...] = ()
    violations: tuple[str, ...] = field(default=())  # breaks the first timing and the re-timing disagree on
    shape_effects: tuple[str, ...] = field(default=())  # breaks the re-timing reproduced: the kernels' own order
    shape_effect_ks: tuple[int, ...] = field(default=())  # the Ks whose costs a shape effect pools

    def __post_init__(self) -> None:
        if DECODE not in self.seconds or not any(kind == "verify" for kind, _ in self.seconds):
            raise ValueError("cost samples need decode and at least one verify K")
        for key, values in self.seconds.items():
            if not values or not all(math.isfinite(v) and v >= 0 for v in values):
                raise ValueError(f"cost samples of {key} must be finite seconds >= 0, got {values!r}")

    def ks(self, kind: str) -> list[int]:
        return sorted(k for name, k in self.seconds if name == kind)

    def spread(self) -> dict[str, object]:
        """run.json ``summary.sweep.costs.spread``: each kind's median interval as a relative half-width,
        and the repeats behind it (the figures a report prints next to the costs)."""

        def half(key: StepKey) -> float:
            return relative_half_width(self.seconds[key])

        return {
            "target_relative_half_width": TARGET_RELATIVE_HALF_WIDTH,
            "budget_s": self.budget_s,
            "repeats": {_key_text(key): len(values) for key, values in sorted(self.seconds.items())},
            "decode": half(DECODE),
            "verify": {str(k): half(("verify", k)) for k in self.ks("verify")},
            "draft": {str(k): half(("draft", k)) for k in self.ks("draft")},
            "retimed": [_key_text(key) for key in self.retimed],
            "violations": list(self.violations),
            "shape_effects": list(self.shape_effects),
            "shape_effect_ks": list(self.shape_effect_ks),
            "flat_draft": self.flat_draft,  # the cost model: a block draft is one cost whatever K
        }

    def to_frame(self) -> pd.DataFrame:
        """The run directory's ``costs.parquet``: kind, K, repeat, seconds, device - every raw sample, so any
        report can re-derive the fitted costs and their intervals."""
        rows = [
            (kind, k, repeat, seconds, self.device)
            for (kind, k), values in sorted(self.seconds.items())
            for repeat, seconds in enumerate(values)
        ]
        return pd.DataFrame(rows, columns=["kind", "k", "repeat", "seconds", "device"])

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, *, flat_draft: bool) -> "CostSamples":
        """Inverse of :meth:`to_frame` (the model settings are not in the table: the run record has them)."""
        ordered = frame.sort_values("repeat")
        seconds: dict[StepKey, tuple[float, ...]] = {}
        for kind, k, value in zip(
            ordered["kind"].astype(str), ordered["k"].astype(int), ordered["seconds"].astype(float)
        ):
            seconds[(kind, k)] = (*seconds.get((kind, k), ()), value)
        device = str(frame["device"].iloc[0]) if len(frame) else "unknown"
        return cls(seconds=seconds, device=device, flat_draft=flat_draft)


def _key_text(key: StepKey) -> str:
    kind, k = key
    return kind if kind == "decode" else f"{kind}@{k}"


# ----------------------------------------------------------------------------- timing


def time_steps(
    steps: Mapping[StepKey, Callable[[], None]],
    *,
    budget_s: float,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    target: float = TARGET_RELATIVE_HALF_WIDTH,
    min_rounds: int = MIN_ROUNDS,
    max_rounds: int = MAX_ROUNDS,
    seed: int = 0,
) -> dict[StepKey, list[float]]:
    """Interleaved rounds of every step until each median is known within ``target`` or ``budget_s`` is spent.

    Each round runs the kinds still short of ``target`` (every kind for the first ``min_rounds``) once, in
    a fresh seeded random order, so a busy spell of the machine spreads over every kind instead of landing
    on one. The budget is checked between rounds, so at least ``min_rounds`` rounds run whatever it says.

    Args:
        steps: per step kind, a closure doing one step's work and nothing else.
        budget_s: seconds of timing after which no new round starts.
        sync: called before starting and after stopping each clock (CUDA kernels run asynchronously);
            None on a CPU.
        clock: seconds, monotonic (a fake one in tests).
        target: the relative half-width of a median's 95% interval that counts as tight (0 times until the
            budget is spent).
        min_rounds: rounds every kind runs whatever the budget says.
        max_rounds: the most rounds, whatever the budget and the spread.
        seed: seeds the order of each round.

    Returns:
        Per step kind, the seconds of each timed call, in the order taken.
    """
    rng = np.random.default_rng(seed)
    synchronize = sync or (lambda: None)
    samples: dict[StepKey, list[float]] = {key: [] for key in steps}
    keys = list(steps)
    began = clock()
    for round_index in range(max_rounds):
        if round_index >= min_rounds:
            if clock() - began >= budget_s:
                break
            keys = [key for key in steps if relative_half_width(samples[key]) > target]
            if not keys:
                break
        for i in rng.permutation(len(keys)):
            step = steps[keys[i]]
            synchronize()
            started = clock()
            step()
            synchronize()
            samples[keys[i]].append(clock() - started)
    return samples


def measure_step_samples(
    decode_step: Callable[[], None],
    verify_step: Callable[[int], None],
    draft_step: Callable[[int], None],
    ks: Sequence[int],
    *,
    flat_draft: bool,
    budget_s: float = DEFAULT_TIMING_BUDGET_S,
    warmup: int = 2,
    sync: Callable[[], None] | None = None,
    device: str = "cpu",
    clock: Callable[[], float] = time.perf_counter,
    seed: int = 0,
) -> CostSamples:
    """Time decode, verify at each K and draft at each K; re-time once what breaks the physics beyond its noise.

    Warm-up runs absorb one-off costs (allocator growth, autotuning, lazy init). A re-timing gets half
    the budget again and runs only the kinds a break names, interleaved as before. A break its own
    samples show again is a ``shape_effects`` entry (the kernels' order, priced pooled); one that only
    the pooled samples still show is a ``violations`` entry (the timings disagree: the ``timing`` check
    and the advice read both).

    Args:
        decode_step: one plain decode step of the target (one token).
        verify_step: one verify forward of 1 + K tokens, given K.
        draft_step: one draft of K tokens, given K.
        ks: the draft lengths to price, each >= 1.
        flat_draft: True for a block drafter (one cost whatever K), False for an autoregressive one.
        budget_s: seconds for the first timing; a re-timing gets half of it again.
        warmup: untimed calls of every step before the timing.
        sync: device synchronisation around each timed call (CUDA); None on a CPU.
        device: the device name kept with the samples.
        clock: seconds, monotonic (a fake one in tests).
        seed: seeds the order of the rounds (the re-timing uses ``seed + 1``).

    Returns:
        The samples of both timings, with the kinds re-timed, the shape effects and the violations.
    """
    ks = sorted(set(int(k) for k in ks))
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must hold integers >= 1, got {ks}")
    if warmup < 0 or not budget_s >= 0:
        raise ValueError(f"need warmup >= 0 and a budget >= 0, got {warmup}, {budget_s}")
    steps: dict[StepKey, Callable[[], None]] = {DECODE: decode_step}
    steps.update({("verify", k): (lambda k=k: verify_step(k)) for k in ks})
    steps.update({("draft", k): (lambda k=k: draft_step(k)) for k in ks})
    for _ in range(warmup):
        for step in steps.values():
            step()
    timed = time_steps(steps, budget_s=budget_s, sync=sync, clock=clock, seed=seed)
    samples = CostSamples(
        {key: tuple(v) for key, v in timed.items()}, device=device, flat_draft=flat_draft, budget_s=budget_s
    )
    broken = _violating_pairs(samples)
    if not broken:
        return samples
    suspects = sorted({key for pair in broken for key in pair})
    retimed = time_steps(
        {key: steps[key] for key in suspects},
        budget_s=budget_s / 2.0,
        sync=sync,
        clock=clock,
        seed=seed + 1,
        target=0.0,
    )
    return _judge_breaks(samples, {key: tuple(v) for key, v in retimed.items()})


def _judge_breaks(first: CostSamples, retimed: Mapping[StepKey, tuple[float, ...]]) -> CostSamples:
    """Pool a timing and its re-timing, and sort what still breaks the physics into shape effects and violations.

    A break is the machine's kernels (a shape effect) when the re-timing's samples alone break the order
    again, or when none of the pair's kinds moved between the two timings (each median's interval in the
    first timing overlaps its interval in the re-timing): consistent samples, pooled, still break it. It is
    a violation when a kind of the pair moved: the machine changed between the timings.

    Args:
        first: the first timing's samples.
        retimed: the re-timing's new samples of the kinds it ran.

    Returns:
        Both timings' samples pooled, the re-timed kinds, the shape effects (with the Ks whose costs they
        pool) and the violations.
    """
    merged = replace(
        first,
        seconds={key: values + retimed.get(key, ()) for key, values in first.seconds.items()},
        retimed=tuple(sorted(retimed)),
    )
    reproduced = set(_violating_pairs(replace(first, seconds={**first.seconds, **retimed})))
    effects, violations, ks = [], [], set()
    for pair in _violating_pairs(merged):
        sentence = _break_sentence(merged, pair)
        if pair in reproduced or not any(_moved(first.seconds[key], retimed.get(key, ())) for key in pair):
            effects.append(sentence)
            ks.update(k for _, k in pair if k)
        else:
            violations.append(sentence)
    return replace(
        merged, violations=tuple(violations), shape_effects=tuple(effects), shape_effect_ks=tuple(sorted(ks))
    )


# ----------------------------------------------------------------------------- the physics


def _moved(before: Sequence[float], after: Sequence[float]) -> bool:
    """Whether a step kind's median moved between two timings: their 95% intervals, each widened by the
    precision the timing aims for (+-:data:`TARGET_RELATIVE_HALF_WIDTH` of its median, below which two medians
    are not told apart), do not overlap. A kind not re-timed has not moved."""
    if not after:
        return False
    (median_before, low_before, high_before), (median_after, low_after, high_after) = (
        median_interval(before),
        median_interval(after),
    )
    slack_before, slack_after = (TARGET_RELATIVE_HALF_WIDTH * m for m in (median_before, median_after))
    return high_before + slack_before < low_after - slack_after or high_after + slack_after < low_before - slack_before


def _ordered_chains(samples: CostSamples) -> list[list[StepKey]]:
    """Chains of step kinds whose true costs are non-decreasing along the chain: the target's forwards by
    tokens (decode = 1 token, then verify of 1 + K), and an autoregressive draft by K. A block draft has
    no order (one block whatever K): its K are one cost, checked by :func:`_violating_pairs` as a group."""
    chains = [[DECODE, *(("verify", k) for k in samples.ks("verify"))]]
    if not samples.flat_draft:
        chains.append([("draft", k) for k in samples.ks("draft")])
    return chains


def _violating_pairs(samples: CostSamples) -> list[tuple[StepKey, StepKey]]:
    """Pairs (cheaper-by-physics, dearer-by-physics) whose median intervals do not overlap the wrong way
    round: the dearer kind's whole interval lies below the cheaper one's."""
    intervals = {key: median_interval(values) for key, values in samples.seconds.items()}
    pairs = []
    for chain in _ordered_chains(samples):
        for i, cheaper in enumerate(chain):
            for dearer in chain[i + 1 :]:
                if intervals[dearer][2] < intervals[cheaper][1]:
                    pairs.append((cheaper, dearer))
    return pairs


def physics_violations(samples: CostSamples) -> list[str]:
    """The breaks of the cost model's order in one timing, worded for a finding.

    Args:
        samples: one timing's samples.

    Returns:
        One sentence per pair of step kinds whose medians break the physics beyond both 95% intervals.
    """
    return [_break_sentence(samples, pair) for pair in _violating_pairs(samples)]


def _break_sentence(samples: CostSamples, pair: tuple[StepKey, StepKey]) -> str:
    """'a verify of 5 tokens timed 199 ms, below a decode step at 321 ms, beyond both medians' 95% intervals'."""
    cheaper, dearer = pair
    low, high = (float(np.median(samples.seconds[key])) * 1000.0 for key in (cheaper, dearer))
    return (
        f"{_describe(dearer)} timed {high:.3g} ms, below {_describe(cheaper)} at {low:.3g} ms, "
        "beyond both medians' 95% intervals"
    )


def _describe(key: StepKey) -> str:
    kind, k = key
    return {"decode": "a decode step", "verify": f"a verify of {k + 1} tokens", "draft": f"a draft of {k} tokens"}[kind]


def isotonic(values: Sequence[float], weights: Sequence[float]) -> np.ndarray:
    """Weighted least-squares non-decreasing fit (pool adjacent violators).

    A falling pair is replaced by its weighted mean, so the more precise measurement moves least.

    Args:
        values: the points in the order the fit must not fall along.
        weights: each point's weight (its precision), > 0.

    Returns:
        The fitted values, one per point, non-decreasing.
    """
    blocks: list[tuple[float, float, int]] = []  # (weighted mean, weight, count)
    for value, weight in zip(values, weights):
        blocks.append((float(value), float(weight), 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean2, w2, n2 = blocks.pop()
            mean1, w1, n1 = blocks.pop()
            blocks.append(((mean1 * w1 + mean2 * w2) / (w1 + w2), w1 + w2, n1 + n2))
    return np.array([mean for mean, _, count in blocks for _ in range(count)], dtype=np.float64)


def _precision(values: Sequence[float]) -> float:
    """1 / variance of a median, from its 95% interval (a floor keeps a zero-width interval finite)."""
    median, low, high = median_interval(values)
    half = max((high - low) / 2.0 / _Z95, 1e-3 * abs(median), 1e-12)
    return 1.0 / (half * half)


def fit_step_costs(
    medians: Mapping[StepKey, float], precisions: Mapping[StepKey, float], *, flat_draft: bool, device: str
) -> StepCosts:
    """The physical cost model through the medians, each weighted by its precision.

    Target forwards are non-decreasing in tokens (decode, then verify of 1 + K); the draft is one cost whatever
    K for a block drafter, non-decreasing in K for an autoregressive one.

    Args:
        medians: per step kind, the median seconds.
        precisions: per step kind, 1 / variance of its median (:func:`_precision`).
        flat_draft: True for a block drafter.
        device: the device name the costs were timed on.

    Returns:
        The fitted step costs (``source`` "measured").
    """
    verify_ks = sorted(k for kind, k in medians if kind == "verify")
    draft_ks = sorted(k for kind, k in medians if kind == "draft")
    target_keys = [DECODE, *(("verify", k) for k in verify_ks)]
    target = isotonic([medians[key] for key in target_keys], [precisions[key] for key in target_keys])
    draft_keys = [("draft", k) for k in draft_ks]
    draft_values = [medians[key] for key in draft_keys]
    draft_weights = [precisions[key] for key in draft_keys]
    if flat_draft:
        flat = float(np.average(draft_values, weights=draft_weights))
        draft = np.full(len(draft_keys), flat)
    else:
        draft = isotonic(draft_values, draft_weights)
    return StepCosts(
        t_decode_s=float(target[0]),
        t_verify_s={k: float(v) for k, v in zip(verify_ks, target[1:])},
        t_draft_s={k: float(v) for k, v in zip(draft_ks, draft)},
        source="measured",
        device=device,
    )


def fitted_costs(samples: CostSamples) -> StepCosts:
    """:func:`fit_step_costs` through a timing's medians: the point costs every speedup is priced with.

    Args:
        samples: one timing's samples.

    Returns:
        The fitted step costs.
    """
    medians = {key: float(np.median(values)) for key, values in samples.seconds.items()}
    precisions = {key: _precision(values) for key, values in samples.seconds.items()}
    return fit_step_costs(medians, precisions, flat_draft=samples.flat_draft, device=samples.device)


def resampled_medians(
    seconds: Mapping[StepKey, Sequence[float]], n_boot: int, rng: np.random.Generator
) -> dict[StepKey, np.ndarray]:
    """The medians of bootstrap resamples of each step kind: the timing's share of a speedup interval.

    Args:
        seconds: per step kind, its samples.
        n_boot: resamples per kind.
        rng: the random generator the resamples draw from.

    Returns:
        Per step kind, an array of ``n_boot`` medians.
    """
    medians = {}
    for key, values in sorted(seconds.items()):
        data = np.asarray(values, dtype=np.float64)
        medians[key] = np.median(data[rng.integers(0, len(data), size=(n_boot, len(data)))], axis=1)
    return medians


def cost_replicates(
    samples: CostSamples, n_boot: int, rng: np.random.Generator, *, shared: Mapping[StepKey, np.ndarray] | None = None
) -> list[StepCosts]:
    """The timing bootstrap: cost models fitted through resampled medians.

    Precisions are kept from the full sample: they weight the fit, they do not price.

    Args:
        samples: one timing's samples.
        n_boot: cost models to fit.
        rng: the random generator the resamples draw from.
        shared: resampled medians to use for those kinds instead of drawing (a head-to-head prices every
            speculator with one draw of the target's decode and verify times, so their ratio is paired).

    Returns:
        ``n_boot`` fitted step costs, one per resample.
    """
    precisions = {key: _precision(values) for key, values in samples.seconds.items()}
    own = {key: values for key, values in samples.seconds.items() if shared is None or key not in shared}
    medians = {**resampled_medians(own, n_boot, rng), **(shared or {})}
    return [
        fit_step_costs(
            {key: float(m[b]) for key, m in medians.items() if key in samples.seconds},
            precisions,
            flat_draft=samples.flat_draft,
            device=samples.device,
        )
        for b in range(n_boot)
    ]
