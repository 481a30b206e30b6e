"""Acceptance counts as engines report them, and the metrics of a window computed from them.

Every source is reduced to :class:`SpecCounts`: the vLLM counter set (``num_drafts``,
``num_draft_tokens``, ``num_accepted_tokens``, ``num_accepted_tokens_per_pos``) plus the output tokens
generated, for one :class:`SeriesKey` (a served model and, where the source has one, a request class).
A field an engine does not report is ``None``, never 0: "SGLang exports no per-position counter" and
"no draft was accepted at position 3" must stay different statements.

Cumulative snapshots (Prometheus counters) become windows by subtraction, :meth:`SpecCounts.since`,
which detects a counter reset (a server restart) and then counts from zero, as PromQL's ``increase``
does. Windows add up with :meth:`SpecCounts.plus`.

The interval of a window's tau comes from the counts, never from one ratio (:func:`tau_interval`):
the per-position counts give the whole acceptance-length histogram, hence its variance, so
``tau +- z * sd / sqrt(num_drafts)`` is exact for independent steps. Steps inside one request are
correlated, so when the window holds several scrape intervals, :func:`window_tau_interval` also
bootstraps over them with the project's one statistics module (:mod:`dflash_doctor.stats.metrics`) and
keeps the wider of the two intervals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from statistics import NormalDist
from typing import Iterable, Sequence

import numpy as np

from dflash_doctor.stats.metrics import CI_LEVEL, NUM_BOOTSTRAP_RESAMPLES, bootstrap_ratio, group_rng, interval

ALL_CLASSES = "all"  # the class of a series whose source has no request-class label
MIN_UNITS_FOR_BOOTSTRAP = 5  # fewer scrape intervals than this say nothing about their spread


@dataclass(frozen=True, order=True)
class SeriesKey:
    """One time series: a served model (``model_name`` label, or the source's name) and a request class."""

    model: str
    cls: str = ALL_CLASSES

    def __str__(self) -> str:
        return self.model if self.cls == ALL_CLASSES else f"{self.model} [{self.cls}]"


_COUNT_FIELDS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_generated_tokens")


@dataclass(frozen=True)
class SpecCounts:
    """Counts of one series: since server start (a counter snapshot) or over one window (a difference).

    ``num_accepted_tokens_per_pos[i]`` is how many drafts had at least ``i + 1`` tokens accepted (vLLM's
    unconditional per-position counter, 0-based position); ``None`` = the source does not report it.
    ``num_generated_tokens`` counts output tokens, with or without drafting; it tells an idle server
    (nothing generated) from one that stopped drafting (tokens generated, drafts frozen).
    """

    num_drafts: float | None = None
    num_draft_tokens: float | None = None
    num_accepted_tokens: float | None = None
    num_accepted_tokens_per_pos: tuple[float, ...] | None = None
    num_generated_tokens: float | None = None

    def impossible(self) -> str | None:
        """Why these counts cannot be an engine's (a corrupted or forged line), or None: negative counts,
        more tokens accepted than drafted, or more drafts accepting position i than drafts at all. Such
        counts are refused as data; they would give a tau or rate no engine can have."""
        values = [
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            *(self.num_accepted_tokens_per_pos or ()),
        ]
        if any(v is not None and v < 0 for v in values):
            return "a negative count"
        if (
            self.num_accepted_tokens is not None
            and self.num_draft_tokens is not None
            and self.num_accepted_tokens > self.num_draft_tokens
        ):
            return f"{self.num_accepted_tokens:g} tokens accepted of {self.num_draft_tokens:g} drafted"
        if self.num_drafts is not None and any(v > self.num_drafts for v in self.num_accepted_tokens_per_pos or ()):
            return f"a position accepted by more drafts than the {self.num_drafts:g} drafted"
        return None

    # ---- arithmetic -------------------------------------------------------------------------------

    def since(self, earlier: "SpecCounts") -> tuple["SpecCounts", bool]:
        """Counts accrued since ``earlier`` and whether the counters were reset in between.

        A reset (any counter went down: the server restarted) makes the difference meaningless, so the
        window then counts from zero - exactly what the restarted server has done since it came back.
        """
        reset = any(
            now is not None and before is not None and now < before
            for now, before in zip(self._flat(), earlier._flat())
        )
        if reset:
            return self, True
        values = {}
        for name in _COUNT_FIELDS:
            now, before = getattr(self, name), getattr(earlier, name)
            values[name] = None if now is None else now - (before or 0.0)
        values["num_accepted_tokens_per_pos"] = _subtract_per_pos(
            self.num_accepted_tokens_per_pos, earlier.num_accepted_tokens_per_pos
        )
        return SpecCounts(**values), False

    def plus(self, other: "SpecCounts") -> "SpecCounts":
        """Sum of two windows (or of two engines of one model); a field missing on both stays missing."""
        values = {}
        for name in _COUNT_FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            values[name] = None if a is None and b is None else (a or 0.0) + (b or 0.0)
        values["num_accepted_tokens_per_pos"] = _add_per_pos(
            self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos
        )
        return SpecCounts(**values)

    def _flat(self) -> list[float | None]:
        per_pos = list(self.num_accepted_tokens_per_pos or ())
        return [getattr(self, name) for name in _COUNT_FIELDS] + per_pos

    # ---- metrics (vLLM's definitions) ------------------------------------------------------------

    @property
    def k(self) -> int | None:
        """Draft length: the number of per-position series (vLLM does not export K), else draft tokens per draft."""
        if self.num_accepted_tokens_per_pos:
            return len(self.num_accepted_tokens_per_pos)
        if self.num_drafts and self.num_draft_tokens:
            ratio = self.num_draft_tokens / self.num_drafts
            return round(ratio) if abs(ratio - round(ratio)) < 1e-6 else None
        return None

    @property
    def accepted(self) -> float | None:
        """Accepted draft tokens: the counter, else the sum of the per-position counts (they are the same number)."""
        if self.num_accepted_tokens is not None:
            return self.num_accepted_tokens
        if self.num_accepted_tokens_per_pos is not None:
            return float(sum(self.num_accepted_tokens_per_pos))
        return None

    @property
    def mean_acceptance_length(self) -> float | None:
        """tau = 1 + accepted / drafts (bonus token included); None without drafts."""
        if not self.num_drafts or self.accepted is None:
            return None
        return 1.0 + self.accepted / self.num_drafts

    @property
    def draft_acceptance_rate(self) -> float | None:
        """accepted / drafted tokens (scales with K: a poor comparison metric, shown because engines print it)."""
        if not self.num_draft_tokens or self.accepted is None:
            return None
        return self.accepted / self.num_draft_tokens

    @property
    def acceptance_rate_per_pos(self) -> list[float] | None:
        """Unconditional per-position rates r_i = P(at least i + 1 accepted)."""
        if not self.num_drafts or self.num_accepted_tokens_per_pos is None:
            return None
        return [count / self.num_drafts for count in self.num_accepted_tokens_per_pos]

    def as_dict(self) -> dict[str, object]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}


def _subtract_per_pos(now: tuple[float, ...] | None, before: tuple[float, ...] | None) -> tuple[float, ...] | None:
    if now is None:
        return None
    before = before or ()
    return tuple(value - (before[i] if i < len(before) else 0.0) for i, value in enumerate(now))


def _add_per_pos(a: tuple[float, ...] | None, b: tuple[float, ...] | None) -> tuple[float, ...] | None:
    if a is None or b is None:
        return a if b is None else b
    length = max(len(a), len(b))
    return tuple((a[i] if i < len(a) else 0.0) + (b[i] if i < len(b) else 0.0) for i in range(length))


def total(counts: Iterable[SpecCounts]) -> SpecCounts:
    """The sum of several windows (an empty iterable gives empty counts)."""
    result: SpecCounts | None = None
    for item in counts:
        result = item if result is None else result.plus(item)
    return result or SpecCounts()


def scaled(counts: SpecCounts, factor: float) -> SpecCounts:
    """Counts times ``factor`` (PromQL ``rate`` times the window length gives counts back)."""
    per_pos = counts.num_accepted_tokens_per_pos
    return replace(
        counts,
        **{name: (None if getattr(counts, name) is None else getattr(counts, name) * factor) for name in _COUNT_FIELDS},
        num_accepted_tokens_per_pos=None if per_pos is None else tuple(v * factor for v in per_pos),
    )


# ---- intervals -------------------------------------------------------------------------------------


def tau_interval(counts: SpecCounts, level: float = CI_LEVEL) -> tuple[float, float] | None:
    """Normal interval of tau from the counts alone, treating drafts as independent.

    With per-position counts the acceptance-length distribution is known exactly: P(A >= i + 1) = r_i,
    so E[A] = sum r_i and E[A^2] = sum (2i + 1) r_i. Without them (K known, only totals) the variance
    is bounded by mean * (K - mean), the largest any variable on [0, K] with that mean can have, which
    keeps the interval honest rather than narrow.
    """
    tau = counts.mean_acceptance_length
    if tau is None or not counts.num_drafts or counts.num_drafts < 1:
        return None
    mean = tau - 1.0
    rates = counts.acceptance_rate_per_pos
    if rates:
        second_moment = sum((2 * i + 1) * r for i, r in enumerate(rates))
        variance = max(second_moment - mean * mean, 0.0)
    elif counts.k:
        variance = max(mean * (counts.k - mean), 0.0)
    else:
        return None
    z = NormalDist().inv_cdf((1.0 + level) / 2.0)
    # Never narrower than the rule of three: with every draft rejected (or all accepted) the sample
    # variance is 0, yet 3/n is still a 95% bound on the mean accepted per draft.
    half = max(z * math.sqrt(variance / counts.num_drafts), 3.0 / counts.num_drafts)
    upper_limit = 1.0 + counts.k if counts.k else math.inf
    return (max(tau - half, 1.0), min(tau + half, upper_limit))


def rate_intervals(counts: SpecCounts, level: float = CI_LEVEL) -> list[list[float]] | None:
    """Normal interval of each per-position rate over the drafts (never narrower than the rule of three)."""
    rates = counts.acceptance_rate_per_pos
    if not rates:
        return None
    z = NormalDist().inv_cdf((1.0 + level) / 2.0)
    n = counts.num_drafts or 0.0  # rates exist only with drafts
    halves = [max(z * math.sqrt(r * (1 - r) / n), 3.0 / n) for r in rates]
    return [[max(r - h, 0.0), min(r + h, 1.0)] for r, h in zip(rates, halves)]


def bootstrap_tau_interval(units: Sequence[SpecCounts], *, seed: int = 0) -> tuple[float, float] | None:
    """The project's bootstrap (:func:`dflash_doctor.stats.metrics.bootstrap_ratio`, percentile interval) of the
    pooled tau, resampling scrape intervals instead of requests.

    Scrape intervals carry the correlation between steps of one request that :func:`tau_interval`
    ignores; with fewer than :data:`MIN_UNITS_FOR_BOOTSTRAP` intervals there is no spread to measure.
    """
    usable = [u for u in units if u.num_drafts and u.accepted is not None]
    if len(usable) < MIN_UNITS_FOR_BOOTSTRAP:
        return None
    drafts = np.array([u.num_drafts for u in usable], dtype=float)  # [N]
    accepted = np.array([u.accepted for u in usable], dtype=float)  # [N]
    ratios = bootstrap_ratio(accepted, drafts, NUM_BOOTSTRAP_RESAMPLES, group_rng(seed, "telemetry"))  # [B]
    lo, hi = interval(1.0 + ratios)
    return (float(lo), float(hi))


def window_tau_interval(
    counts: SpecCounts, units: Sequence[SpecCounts] = (), num_units: int | None = None
) -> tuple[float, float] | None:
    """The wider of the count-based and the scrape-interval bootstrap intervals (either may be absent).

    ``units``: every unit of ``counts``, or a uniform sample of its ``num_units`` (a days-long watch keeps
    a bounded sample): the sample's bootstrap spread is then narrowed by sqrt(sample / num_units), the
    rate at which a ratio of sums tightens with its number of terms, around the tau of ``counts``.
    """
    boot = bootstrap_tau_interval(units)
    tau = counts.mean_acceptance_length
    if boot is not None and tau is not None and num_units is not None and num_units > len(units):
        center = total(units).mean_acceptance_length or tau
        shrink = math.sqrt(len(units) / num_units)
        boot = (tau - (center - boot[0]) * shrink, tau + (boot[1] - center) * shrink)
    intervals = [ci for ci in (tau_interval(counts), boot) if ci is not None]
    if not intervals:
        return None
    return (min(ci[0] for ci in intervals), max(ci[1] for ci in intervals))
