"""Acceptance metrics over the ``steps`` table, named and defined as vLLM defines them.

Every number in run.json ``summary`` comes from :func:`summarize`. The conventions (docs/definitions.md):

* ``num_drafts``: steps that drafted at least one token (plain decode steps, ``num_drafted == 0``, emit
  an output token but are not drafts); ``num_draft_tokens``: tokens drafted; ``num_accepted_tokens``:
  tokens accepted.
* ``num_accepted_tokens_per_pos[i]``: drafts that accepted more than ``i`` tokens, i.e. reached slot
  ``i + 1``. A draft token is only accepted while every earlier one in its block was, so
  ``r_i = per_pos[i] / num_drafts`` is the *unconditional* probability of accepting at least ``i + 1``
  tokens, and ``a_i = r_i / r_{i-1}`` is the *conditional* rate of slot ``i`` given it was reached.
* ``mean_acceptance_length`` (tau) ``= 1 + accepted / drafts``: tokens emitted per draft step, the bonus
  token included (DFlash, EAGLE, SGLang and vLLM print this; gpt-fast's "mean accepted" is tau - 1).
  Equivalently ``tau(K) = 1 + sum_{i<K} r_i``, which is why one run at a large K gives the truncated
  estimate for every smaller K (:func:`truncate_steps`).
* Pooled ratios, not means of per-request ratios: the two differ (vLLM #42690), so pooled numbers are
  the headline and the per-request tau distribution is reported next to them.
* Confidence intervals: percentile bootstrap over *requests* (steps inside a request are correlated, so
  resampling steps would be overconfident). Each resample pools its requests' counters, exactly as the
  point estimate does. Position-1 acceptance moves by several points between identical runs
  (speculators PR #793): an interval says whether a difference is real.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from dflash_doctor.rundir.run_record import OVERALL, Summary

CI_LEVEL = 0.95
NUM_BOOTSTRAP_RESAMPLES = 1000
_BOOTSTRAP_CELLS_PER_CHUNK = 1 << 22  # resample-weight cells held at once: bounds memory at ~32 MB
_REQUIRED_STEP_COLUMNS = ("request_id", "class", "k", "num_drafted", "num_accepted")


# ----------------------------------------------------------------------------- closed forms


def tau_from_rates(rates: np.ndarray | list[float]) -> float:
    """tau, tokens per draft step, from the unconditional per-slot rates (the bonus token is the 1).

    Args:
        rates: r_i, the unconditional probability of accepting at least i + 1 tokens, slot by slot.

    Returns:
        1 + sum of ``rates``.
    """
    return 1.0 + float(np.sum(np.asarray(rates, dtype=np.float64)))


def conditional_rates(rates: np.ndarray | list[float]) -> np.ndarray:
    """a_i = r_i / r_{i-1} with r_{-1} = 1: slot i's acceptance given it was reached.

    Args:
        rates: r_i, the unconditional per-slot rates.

    Returns:
        [len(rates)] float64 conditional rates; NaN where the previous slot was never reached.
    """
    rates = np.asarray(rates, dtype=np.float64)
    previous = np.concatenate([[1.0], rates[:-1]])
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(previous > 0, rates / np.where(previous > 0, previous, 1.0), np.nan)


def expected_tau_iid(alpha: float, k: int) -> float:
    """Leviathan et al. 2023: tokens per step with i.i.d. acceptance ``alpha`` and ``k`` drafted tokens.

    ``(1 - alpha^(k+1)) / (1 - alpha)``, which is ``1 + alpha + ... + alpha^k``: the general
    ``tau_from_rates`` with r_i = alpha^(i+1).

    Args:
        alpha: the per-token acceptance probability, in [0, 1].
        k: drafted tokens per step.

    Returns:
        The expected tokens per step, between 1 and k + 1 (k + 1 at alpha = 1: every token is accepted).

    Raises:
        ValueError: when ``alpha`` is outside [0, 1].
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be a probability, got {alpha}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


# ----------------------------------------------------------------------------- step tables


def truncate_steps(steps: pd.DataFrame, k: int) -> pd.DataFrame:
    """The steps a run at a larger K implies for drafting only ``k`` tokens: accepted counts capped at k.

    Exact for the *per-slot rates* of a chain (autoregressive) draft, whose first k proposals do not
    depend on K; an estimate for a DFlash draft, whose shorter block changes its own predictions
    (bidirectional attention inside the block). Either way the live schedule at k would visit other
    positions, so rows built this way carry ``estimate = "truncated"`` in a sweep.

    Args:
        steps: a steps table (``num_drafted``, ``num_accepted``, ``k`` columns among others).
        k: the smaller draft length, >= 1.

    Returns:
        A copy of ``steps`` with ``num_drafted``, ``num_accepted`` and ``k`` capped at ``k`` (dtypes kept).

    Raises:
        ValueError: when ``k`` < 1.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    truncated = steps.copy()
    drafted = truncated["num_drafted"].to_numpy()
    truncated["num_drafted"] = np.minimum(drafted, k).astype(truncated["num_drafted"].dtype)
    truncated["num_accepted"] = np.minimum(truncated["num_accepted"].to_numpy(), k).astype(
        truncated["num_accepted"].dtype
    )
    truncated["k"] = np.minimum(truncated["k"].to_numpy(), k).astype(truncated["k"].dtype)
    return truncated


class RequestCounters:
    """Per-request sums of one group of steps: the unit the bootstrap resamples.

    The one place drafts are counted (vLLM's definition: a step is a draft only when it drafted at
    least one token; the plain decode step a loop takes when one token of budget remains is not).
    The summary, ``compare``, the sweep and the dashboard all pool these counters.

    ``drafts``, ``accepted``, ``draft_tokens``, ``emitted`` are ``[R]``; ``per_pos`` is ``[R, S]``;
    ``histogram`` is ``[S + 1]`` pooled over all draft steps.
    """

    def __init__(self, steps: pd.DataFrame, request_ids: np.ndarray, num_slots: int):
        index = pd.Index(request_ids)
        codes = index.get_indexer(steps["request_id"].to_numpy())
        num_requests = len(index)
        drafted = steps["num_drafted"].to_numpy(dtype=np.int64)
        accepted = steps["num_accepted"].to_numpy(dtype=np.int64)
        is_draft = drafted > 0

        self.num_slots = num_slots
        self.drafts = np.bincount(codes, weights=is_draft, minlength=num_requests)
        self.accepted = np.bincount(codes, weights=accepted, minlength=num_requests)
        self.draft_tokens = np.bincount(codes, weights=drafted, minlength=num_requests)
        # tokens the steps committed: every accepted token plus the bonus (or the plain decode token)
        self.emitted = np.bincount(codes, weights=accepted + 1, minlength=num_requests)

        # per request, how many draft steps accepted exactly j tokens; per_pos[i] counts j > i
        cell = codes[is_draft] * (num_slots + 1) + accepted[is_draft]
        exact = np.bincount(cell, minlength=num_requests * (num_slots + 1)).reshape(num_requests, num_slots + 1)
        self.histogram = exact.sum(axis=0)
        at_least = np.cumsum(exact[:, ::-1], axis=1)[:, ::-1]  # at_least[:, j] = steps with >= j accepted
        self.per_pos = at_least[:, 1:].astype(np.float64)  # [R, S]

    def pooled_tau(self) -> float:
        drafts = self.drafts.sum()
        return 1.0 + self.accepted.sum() / drafts if drafts else float("nan")

    def bootstrap(self, n_boot: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Resample requests with replacement ``n_boot`` times; return tau ``[B]`` and rates ``[B, S]``.

        A resample is a vector of multiplicities over requests, so the pooled counters of all resamples
        are one matrix product; chunks keep the multiplicity matrix small for 10k+ requests.
        """
        taus = np.full(n_boot, np.nan)
        rates = np.full((n_boot, self.num_slots), np.nan)
        counters = np.column_stack([self.drafts, self.accepted, self.per_pos])  # [R, 2 + S]
        for rows, multiplicity in resample_multiplicities(len(self.drafts), n_boot, rng):
            pooled = multiplicity @ counters  # [rows, 2 + S]
            with np.errstate(divide="ignore", invalid="ignore"):
                drafts = np.where(pooled[:, 0] > 0, pooled[:, 0], np.nan)
                taus[rows] = 1.0 + pooled[:, 1] / drafts
                rates[rows] = pooled[:, 2:] / drafts[:, None]
        return taus, rates


def resample_multiplicities(num_units: int, n_boot: int, rng: np.random.Generator):
    """The request-level bootstrap, in chunks: every bootstrap in the project pools per-request counters
    through this one generator, so one pooled sum is one matrix product.

    Args:
        num_units: R, the units (requests) resampled with replacement; 0 yields nothing.
        n_boot: the number of resamples in all.
        rng: the random generator the draws come from.

    Yields:
        ``(rows, multiplicity)``: ``rows`` the slice of resample indices in the chunk, ``multiplicity``
        ``[rows, R]`` how often unit r is drawn in resample b; chunks keep it near 4M cells.
    """
    if num_units == 0:
        return
    chunk = max(1, _BOOTSTRAP_CELLS_PER_CHUNK // num_units)
    for start in range(0, n_boot, chunk):
        count = min(chunk, n_boot - start)
        picks = rng.integers(0, num_units, size=(count, num_units))
        picks += (np.arange(count) * num_units)[:, None]
        multiplicity = np.bincount(picks.ravel(), minlength=count * num_units).reshape(count, num_units)
        yield slice(start, start + count), multiplicity


def ratio_of_sums(sums: np.ndarray) -> np.ndarray:
    """Each resample's pooled ratio from its column sums: the ``combine`` of :func:`bootstrap_ratio`.

    Args:
        sums: [B, 2+] per-resample column sums, numerator in column 0, denominator in column 1.

    Returns:
        [B] ``sums[:, 0] / sums[:, 1]``; NaN where the denominator is 0.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sums[:, 1] > 0, sums[:, 0] / np.where(sums[:, 1] > 0, sums[:, 1], 1.0), np.nan)


def bootstrap_pooled(
    columns: Sequence[np.ndarray], combine: Callable[[np.ndarray], np.ndarray], n_boot: int, rng: np.random.Generator
) -> np.ndarray:
    """Resamples over units (requests) of a pooled figure, every resample pooling its units' counters exactly
    as the point estimate does.

    Args:
        columns: C per-unit counters, each [R].
        combine: maps [B, C] column sums of a chunk of resamples to its [B] figures
            (:func:`ratio_of_sums`, a ratio of two such ratios...).
        n_boot: the number of resamples.
        rng: the random generator the resamples are drawn with.

    Returns:
        [n_boot] the figure of each resample; all NaN when there are no units.
    """
    counters = np.column_stack([np.asarray(column, dtype=np.float64) for column in columns])
    samples = np.full(n_boot, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        for rows, multiplicity in resample_multiplicities(len(counters), n_boot, rng):
            samples[rows] = combine(multiplicity @ counters)
    return samples


def bootstrap_ratio(
    numerator: np.ndarray, denominator: np.ndarray, n_boot: int, rng: np.random.Generator
) -> np.ndarray:
    """Resamples of the pooled ratio ``sum(numerator) / sum(denominator)`` over units (requests).

    Args:
        numerator: [R] per-unit numerator counts.
        denominator: [R] per-unit denominator counts.
        n_boot: the number of resamples.
        rng: the random generator the resamples are drawn with.

    Returns:
        [n_boot] pooled ratios; NaN where a resample's denominator is 0.
    """
    return bootstrap_pooled([numerator, denominator], ratio_of_sums, n_boot, rng)


def interval(samples: np.ndarray) -> np.ndarray:
    """The one confidence interval: the plain 95% percentile interval of bootstrap resamples.

    Args:
        samples: [B] or [B, S] resamples along axis 0 (NaN for an undefined resample).

    Returns:
        ``[2]`` or ``[S, 2]`` (lower, upper) bounds, NaN resamples ignored; NaN where every resample was
        undefined or there are none.
    """
    tail = (1.0 - CI_LEVEL) / 2.0
    if samples.shape[0] == 0 or np.isnan(samples).all(axis=0).all():
        shape = (2,) if samples.ndim == 1 else (samples.shape[1], 2)
        return np.full(shape, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: slots no resample reached
        bounds = np.nanquantile(samples, [tail, 1.0 - tail], axis=0)
    return bounds.T if samples.ndim == 2 else bounds


def summary_group(scope: str) -> str:
    """The bootstrap group name of a summary scope: it seeds that scope's resamples, so anyone recomputing a
    scope's interval draws the same resamples.

    Args:
        scope: ``overall`` or a workload class's name.

    Returns:
        ``overall`` for the overall scope, ``class:<name>`` for a class.
    """
    return OVERALL if scope == OVERALL else f"class:{scope}"


def group_rng(seed: int, group: str) -> np.random.Generator:
    """A generator per group that depends on the seed and the group's name, not on the group's order.

    Args:
        seed: the run's bootstrap seed.
        group: the group's name (:func:`summary_group`).

    Returns:
        A numpy generator seeded with the seed and the name's CRC-32.
    """
    return np.random.default_rng([seed, zlib.crc32(group.encode("utf-8"))])


def _metrics(
    steps: pd.DataFrame,
    request_ids: np.ndarray,
    num_output_tokens: int | None,
    num_slots: int,
    n_boot: int,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """One M block of the summary contract for the given steps and the requests they belong to."""
    counters = RequestCounters(steps, request_ids, num_slots)
    num_drafts = int(counters.drafts.sum())
    num_draft_tokens = int(counters.draft_tokens.sum())
    num_accepted = int(counters.accepted.sum())
    per_pos = counters.per_pos.sum(axis=0).astype(np.int64)
    if num_output_tokens is None:
        num_output_tokens = int(counters.emitted.sum())

    rates = per_pos / num_drafts if num_drafts else np.full(num_slots, np.nan)
    boot_tau, boot_rates = counters.bootstrap(n_boot, rng)

    has_drafts = counters.drafts > 0
    request_tau = 1.0 + counters.accepted[has_drafts] / counters.drafts[has_drafts]
    if request_tau.size:
        p10, p50, p90 = np.percentile(request_tau, [10, 50, 90])
        tau_distribution = {"mean": float(request_tau.mean()), "p10": float(p10), "p50": float(p50), "p90": float(p90)}
    else:
        tau_distribution = {"mean": float("nan"), "p10": float("nan"), "p50": float("nan"), "p90": float("nan")}

    return {
        "num_requests": int(len(request_ids)),
        "num_output_tokens": int(num_output_tokens),
        "num_drafts": num_drafts,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted,
        "num_accepted_tokens_per_pos": [int(x) for x in per_pos],
        "mean_acceptance_length": counters.pooled_tau(),
        "mean_acceptance_length_ci": [float(x) for x in interval(boot_tau)],
        "acceptance_rate_per_pos": [float(x) for x in rates],
        "acceptance_rate_per_pos_ci": [[float(lo), float(hi)] for lo, hi in interval(boot_rates)],
        "conditional_acceptance_rate_per_pos": [float(x) for x in conditional_rates(rates)],
        "draft_acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else float("nan"),
        "acceptance_histogram": [int(x) for x in counters.histogram],
        "request_tau": tau_distribution,
        "wasted_verify_tokens_per_output_token": (num_draft_tokens - num_accepted) / num_output_tokens
        if num_output_tokens
        else float("nan"),
    }


def _check_steps(steps: pd.DataFrame) -> None:
    missing = [c for c in _REQUIRED_STEP_COLUMNS if c not in steps.columns]
    if missing:
        raise ValueError(f"steps frame lacks columns {missing}; it must follow schema.STEPS_SCHEMA")
    drafted = steps["num_drafted"].to_numpy()
    accepted = steps["num_accepted"].to_numpy()
    if (accepted < 0).any() or (accepted > drafted).any():
        raise ValueError("steps has num_accepted outside 0..num_drafted")


def _resolve_num_slots(steps: pd.DataFrame, num_slots: int | None) -> int:
    observed = int(max(steps["k"].max(), steps["num_drafted"].max())) if len(steps) else 0
    if num_slots is None:
        return observed
    if num_slots < int(steps["num_accepted"].max() if len(steps) else 0):
        raise ValueError(f"num_slots={num_slots} is smaller than the largest accepted count in steps")
    return num_slots


def summarize(
    steps: pd.DataFrame,
    requests: pd.DataFrame | None = None,
    *,
    num_slots: int | None = None,
    n_boot: int = NUM_BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Summary:
    """run.json ``summary`` from a steps table: every number the summary holds comes from here.

    ``requests`` makes the counts exact where steps alone cannot: requests that never reached a step still
    count in ``num_requests``, and ``num_output_tokens`` is the real output length (the last step of a
    request may be cut by EOS or max-new-tokens, and the first token may come from prefill).

    Args:
        steps: the steps table (``request_id``, ``class``, ``k``, ``num_drafted``, ``num_accepted``).
        requests: the requests table (``request_id``, ``class``, ``num_output_tokens``), or None: output
            tokens are then estimated as accepted + 1 per step.
        num_slots: the length of the per-position lists; None: the largest K (or drafted count) in ``steps``.
        n_boot: bootstrap resamples per interval, >= 1.
        seed: the bootstrap seed (each scope draws from :func:`group_rng` of it).

    Returns:
        The typed summary, overall and per class
        (:class:`~dflash_doctor.rundir.run_record.Metrics`); undefined ratios (no drafts) are NaN, written
        as null in run.json.

    Raises:
        ValueError: when ``steps`` lacks a column, has an accepted count outside 0..num_drafted or above
            ``num_slots``, or ``n_boot`` < 1.
    """
    _check_steps(steps)
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    num_slots = _resolve_num_slots(steps, num_slots)

    request_class = pd.Series(steps["class"].to_numpy(), index=steps["request_id"].to_numpy())
    request_class = request_class[~request_class.index.duplicated()]
    output_tokens: pd.Series | None = None
    if requests is not None:
        known = pd.Series(requests["class"].to_numpy(), index=requests["request_id"].to_numpy())
        request_class = pd.concat([known, request_class[~request_class.index.isin(known.index)]])
        output_tokens = pd.Series(requests["num_output_tokens"].to_numpy(), index=requests["request_id"].to_numpy())

    def block(group: str, selected_steps: pd.DataFrame, request_ids: np.ndarray) -> dict[str, Any]:
        tokens = None
        if output_tokens is not None:
            tokens = int(output_tokens.reindex(request_ids).fillna(0).sum())
        return _metrics(selected_steps, request_ids, tokens, num_slots, n_boot, group_rng(seed, group))

    summary: dict[str, Any] = {
        OVERALL: block(summary_group(OVERALL), steps, request_class.index.to_numpy()),
        "by_class": {},
    }
    for cls in sorted(request_class.unique()):
        ids = request_class.index[request_class.to_numpy() == cls].to_numpy()
        summary["by_class"][str(cls)] = block(summary_group(str(cls)), steps[steps["class"] == cls], ids)
    return Summary.from_json(summary)


def tau_with_ci(
    steps: pd.DataFrame, *, n_boot: int = NUM_BOOTSTRAP_RESAMPLES, seed: int = 0, group: str = "overall"
) -> tuple[float, list[float]]:
    """Pooled tau and its bootstrap interval over requests, without the rest of the summary (for sweeps).

    Args:
        steps: the steps table of one group (``request_id``, ``class``, ``k``, ``num_drafted``,
            ``num_accepted``).
        n_boot: bootstrap resamples.
        seed: the bootstrap seed.
        group: the group's name, which with ``seed`` picks its resamples (:func:`group_rng`).

    Returns:
        (tau, [lower, upper]): NaN for tau when no step drafted, NaN bounds when no resample is defined.

    Raises:
        ValueError: when ``steps`` lacks a column or has an accepted count outside 0..num_drafted.
    """
    _check_steps(steps)
    request_ids = pd.unique(steps["request_id"].to_numpy())
    counters = RequestCounters(steps, request_ids, _resolve_num_slots(steps, None))
    boot_tau, _ = counters.bootstrap(n_boot, group_rng(seed, group))
    return counters.pooled_tau(), [float(x) for x in interval(boot_tau)]
