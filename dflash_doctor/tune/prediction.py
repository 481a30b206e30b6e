"""The engine's step-cost model fitted from some measured K, with intervals, and the other K predicted from it.

Model (per load level), in seconds per step, the same terms as :class:`dflash_doctor.rundir.run_record.StepCosts`:

    t_decode            one plain decode step: TPOT measured at K = 0
    step(K) = t_decode + t_draft + slope * K
              \\___ t_verify(K) ___/  verifying 1 + K tokens costs a decode step plus slope per extra token;
                                     t_draft is flat in K (a DFlash block is one draft pass)

``step(K)`` is measured on the engine as decode time per verify step at K (:mod:`.analysis`, ``step_s``).
The fit is weighted least squares over the fit K (``--fit-k``, default: the two smallest K > 0), each K
weighted by the inverse variance of its step time, under the physics: ``slope >= 0`` (verifying more
tokens never costs less) and ``t_draft >= 0``, so no verify step costs less than a decode step; a fit K
whose measured step is below a decode step beyond its noise is named in the note (a measuring problem,
not a cost). With one fit K the slope is 0 (verification taken as flat, the memory-bound case).
The prediction for K and a class is the sweep's formula with the fitted costs and the doctor's
teacher-forced tau of that class at K, from one replay of the same prompts:

    speedup(K) = tau_sweep(K) * t_decode / step(K)

**Intervals.** One bootstrap carries every uncertainty the prediction has: each replicate resamples the
requests (the same multiplicities at every K: the same prompts were sent to every server) and re-pools
t_decode and each fit K's step time from them; multiplies each cell's time by a factor drawn from the
machine's drift between runs (the K = 0 baseline is measured twice, before and after the grid: a
difference d between two runs of one setting is a spread of |d| / sqrt(2) per run); draws tau from the
sweep's 95% interval (independently: conservative, the same prompts make tau and step time correlate
positively in the ratio); and refits under the constraints. The 95% percentile intervals of the
replicates are the costs' and every predicted speedup's. The fit K themselves are re-predicted too, so
the fit's own error shows on them as well as on the held-out K.

**What the held-out error was.** The prediction's miss splits exactly into three factors, each on its
row: ``tau_relative_error`` (the sweep's tau against the engine's), ``step_relative_error`` (the fitted
step time against the measured one) and ``definition_gap`` (the measured speedup against
t_decode * tau / step_s, i.e. tokens after the first against drafts + accepted drafts: 0 when TPOT, tau
and step_s are defined consistently; vLLM's tau is 1 + accepted / drafts with the bonus token, and its
TPOT excludes the prefill token, as here). In the recorded vLLM runs tau agreed within 1-5% and the
definitions were consistent, so a held-out miss of 25% was the step time: the line through the step
times at K = 2 and 4, extrapolated to K = 8, is 3 * step(4) - 2 * step(2), whose noise is sqrt(13) = 3.6
times one cell's. A 5% timing noise per cell is an 18% miss at K = 8; the interval now says so. Fitting
more K (every K but the one held out) shortens the extrapolation; weighting by each cell's spread keeps
one noisy cell from deciding the line.

Each prediction row is held against the measured speedup (TPOT(0) / TPOT(K)) and tau at every K and
class, the K outside the fit marked ``held_out``: ``within_interval`` is whether the measured speedup
lies inside the predicted interval (the prediction's claim tested), ``prediction_within_measured_interval``
whether the predicted speedup lies inside the measured interval (the measurement's noise). The fitted
costs are written as a ``--cost-profile`` file (docs/cost-profile.md) so ``check``, ``sweep`` and
``watch`` price with the engine's own costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dflash_doctor.stats.metrics import NUM_BOOTSTRAP_RESAMPLES, group_rng, interval, resample_multiplicities
from dflash_doctor.tune.analysis import OVERALL, cell
from dflash_doctor.tune.loads import load_kind, load_label, load_of, load_text

Z_95 = 1.959963984540054  # the normal quantile of a 95% two-sided interval: a sweep interval back to a spread


@dataclass(frozen=True)
class FittedCosts:
    """The fitted step-cost model of one load level; ``*_ci`` the 95% bootstrap intervals (None: the cells
    carried no per-request figures, as a tune.json written before they did)."""

    load: str  # in words: "concurrency 8", "request rate 2/s"
    t_decode_s: float
    t_draft_s: float
    verify_slope_s: float  # extra verify time per drafted token
    fit_ks: tuple[int, ...]
    note: str
    t_decode_s_ci: list[float] | None = None
    t_draft_s_ci: list[float] | None = None
    verify_slope_s_ci: list[float] | None = None
    drift_spread: float | None = None  # one run's relative speed spread, from the baseline's two passes

    def step_s(self, k: int) -> float:
        return self.t_decode_s + self.t_draft_s + self.verify_slope_s * k

    def speedup(self, tau: float, k: int) -> float:
        return tau * self.t_decode_s / self.step_s(k)

    def as_profile(self, max_k: int, device: str) -> dict[str, Any]:
        """The ``--cost-profile`` JSON: the line sampled at K = 1 and ``max_k`` (StepCosts interpolates
        linearly between table entries, so two points carry it exactly)."""
        verify = {str(k): self.step_s(k) - self.t_draft_s for k in sorted({1, max_k})}
        return {
            "device": device,
            "notes": (
                f"fitted by dflash-doctor tune at {self.load} from K {', '.join(map(str, self.fit_ks))}: {self.note}"
            ),
            "t_decode_s": self.t_decode_s,
            "t_verify_s": verify,
            "t_draft_s": {"1": self.t_draft_s},
        }


def constrained_fit(ks: np.ndarray, extra: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(t_draft, slope) minimising sum(w * (extra - t_draft - slope * K)^2) with both >= 0, per row of
    ``extra`` ([B, K]). A convex problem in two unknowns: the optimum is the unconstrained one when it is
    feasible, else the best of the two faces (slope = 0: the weighted mean; t_draft = 0: a line through 0),
    each clipped at 0."""
    w = weights / weights.sum()
    mean_k, mean_y = float(w @ ks), extra @ w
    spread_k = float(w @ (ks - mean_k) ** 2)
    slope_free = ((extra - mean_y[:, None]) @ (w * (ks - mean_k))) / spread_k if spread_k > 0 else np.zeros(len(extra))
    draft_free = mean_y - slope_free * mean_k
    candidates = [
        (np.maximum(mean_y, 0.0), np.zeros(len(extra))),
        (np.zeros(len(extra)), np.maximum((extra @ (w * ks)) / float(w @ ks**2), 0.0)),
    ]

    def loss(draft: np.ndarray, slope: np.ndarray) -> np.ndarray:
        return ((extra - draft[:, None] - slope[:, None] * ks) ** 2) @ w

    best_draft, best_slope = candidates[0]
    best = loss(best_draft, best_slope)
    for draft, slope in candidates[1:]:
        better = loss(draft, slope) < best
        best_draft, best_slope = np.where(better, draft, best_draft), np.where(better, slope, best_slope)
        best = np.minimum(best, loss(draft, slope))
    feasible = (draft_free >= 0) & (slope_free >= 0)
    return np.where(feasible, draft_free, best_draft), np.where(feasible, slope_free, best_slope)


@dataclass(frozen=True)
class _Resampled:
    """The bootstrap of one load: t_decode and each fit K's step time, point [K] and replicates [B] / [B, K]."""

    ks: np.ndarray
    t_decode: float
    steps: np.ndarray
    t_decode_b: np.ndarray
    steps_b: np.ndarray
    drift_spread: float | None


def _by_request(
    figures: dict[str, list], ids: dict[str, int], denominator: str, step_s: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """Decode seconds and the denominator (tokens, or drafts) summed per request id over passes, as [R] columns.
    A cell whose drafts came only from /metrics counters (no per-request drafts) resamples its tokens,
    scaled so the pooled figure is the cell's ``step_s``."""
    index = np.array([ids[r] for r in figures["request_id"]], dtype=np.int64)
    decode = np.asarray(figures["decode_s"], dtype=np.float64)
    counts = np.asarray(figures[denominator], dtype=np.float64)
    if denominator == "drafts" and counts.sum():
        decode = np.where(counts > 0, decode, 0.0)  # step_s pools the requests that drafted (analysis)
    elif denominator == "drafts" and step_s:
        tokens = np.asarray(figures["tokens"], dtype=np.float64)
        counts = tokens * (decode.sum() / step_s) / tokens.sum()
    return np.bincount(index, weights=decode, minlength=len(ids)), np.bincount(
        index, weights=counts, minlength=len(ids)
    )


def _drift_spread(base: dict[str, list]) -> float | None:
    """The relative spread of one run's speed: |log(TPOT pass 2 / TPOT pass 1)| / sqrt(2); None with one pass."""
    passes = {}
    for repeat, decode, tokens in zip(base["repeat"], base["decode_s"], base["tokens"]):
        total = passes.setdefault(repeat, [0.0, 0])
        total[0] += decode
        total[1] += tokens
    tpots = [decode / tokens for decode, tokens in passes.values() if tokens and decode > 0]
    return abs(math.log(tpots[1] / tpots[0])) / math.sqrt(2.0) if len(tpots) == 2 else None


def _resample(cells: list[dict[str, Any]], load: Any, ks: list[int], seed: int, n_boot: int) -> _Resampled | None:
    """The bootstrap of t_decode and step(K) at ``ks`` (see the module doc); None without per-request figures."""
    found = [cell(cells, load, k) for k in (0, *ks)]
    complete = [c for c in found if c is not None and c.get("per_request") is not None]
    if len(complete) < len(found):
        return None
    base, measured = complete[0], complete[1:]
    figures = [base["per_request"]] + [c["per_request"] for c in measured]
    ids = {r: i for i, r in enumerate(sorted({r for f in figures for r in f["request_id"]}))}
    columns = [_by_request(base["per_request"], ids, "tokens", None)]
    columns += [_by_request(c["per_request"], ids, "drafts", c.get("step_s")) for c in measured]
    decode = np.column_stack([col[0] for col in columns])
    counts = np.column_stack([col[1] for col in columns])
    rng = group_rng(seed, f"cost-fit:{load_text(load)}")
    times = np.empty((n_boot, decode.shape[1]))
    for rows, multiplicity in resample_multiplicities(len(ids), n_boot, rng):
        with np.errstate(divide="ignore", invalid="ignore"):
            times[rows] = (multiplicity @ decode) / (multiplicity @ counts)
    spread = _drift_spread(base["per_request"])
    if spread:
        # the baseline pools two runs, so its speed wanders by 1/sqrt(2) of one run's
        scale = np.array([spread / math.sqrt(2.0)] + [spread] * len(ks))
        times *= np.exp(rng.standard_normal(times.shape) * scale)
    point = decode.sum(axis=0) / counts.sum(axis=0)
    return _Resampled(np.array(ks, dtype=np.float64), float(point[0]), point[1:], times[:, 0], times[:, 1:], spread)


def fit_costs(
    cells: list[dict[str, Any]],
    load: Any,
    fit_ks: tuple[int, ...],
    *,
    seed: int = 0,
    n_boot: int = NUM_BOOTSTRAP_RESAMPLES,
) -> FittedCosts | None:
    """The constrained weighted fit of step(K) - t_decode = t_draft + slope * K over the fit K measured at
    this load, with its bootstrap intervals; None when K = 0 or every fit K lacks a step time (the engine
    reported no drafts)."""
    base = cell(cells, load, 0)
    if base is None or not base.get("tpot_s"):
        return None
    step_times = [(k, c["step_s"]) for k in fit_ks if (c := cell(cells, load, k)) is not None and c.get("step_s")]
    ks = [k for k, _ in step_times]
    if not ks:
        return None
    sampled = _resample(cells, load, ks, seed, n_boot)
    if sampled is None:  # cells without per-request figures: the point fit alone, equal weights
        t_decode = float(base["tpot_s"])
        steps = np.array([step for _, step in step_times], dtype=np.float64)
        weights = np.ones(len(ks))
    else:
        t_decode, steps, weights = sampled.t_decode, sampled.steps, _weights(sampled)
    draft, slope = _fit(np.array(ks, dtype=np.float64), t_decode, steps[None, :], weights, len(ks))
    notes = [
        f"one fit K ({ks[0]}): verification taken as flat in K"
        if len(ks) == 1
        else f"weighted least squares over {len(ks)} K, slope and t_draft held at 0 or above"
    ]
    if len(ks) > 1 and _free_slope(np.array(ks, dtype=np.float64), steps - t_decode, weights) < 0:
        notes.append("the measured step times fall with K (timing noise): verification taken as flat")
    intervals: dict[str, Any] = {}
    if sampled is not None:
        drafts_b, slopes_b = _fit(sampled.ks, sampled.t_decode_b, sampled.steps_b, weights, len(ks))
        intervals = {
            "t_decode_s_ci": _bounds(sampled.t_decode_b),
            "t_draft_s_ci": _bounds(drafts_b),
            "verify_slope_s_ci": _bounds(slopes_b),
            "drift_spread": sampled.drift_spread,
        }
        below_share = (sampled.steps_b < sampled.t_decode_b[:, None]).mean(axis=0)
        below = [k for k, share in zip(ks, below_share) if share > 0.975]
        if below:
            notes.append(
                f"the step at K {', '.join(map(str, below))} measured below a plain decode step beyond its "
                "noise (a measuring problem: the fit holds it at a decode step; these costs are not reliable)"
            )
    return FittedCosts(
        load_label(load_kind(base), load),
        float(t_decode),
        float(draft[0]),
        float(slope[0]),
        tuple(ks),
        "; ".join(notes),
        **intervals,
    )


def _weights(sampled: _Resampled) -> np.ndarray:
    """Inverse variance of each fit K's step time over the replicates; equal weights where one has no spread."""
    variance = np.nanvar(sampled.steps_b - sampled.t_decode_b[:, None], axis=0)
    return 1.0 / variance if np.all(variance > 0) else np.ones(len(variance))


def _free_slope(ks: np.ndarray, extra: np.ndarray, weights: np.ndarray) -> float:
    w = weights / weights.sum()
    spread = float(w @ (ks - w @ ks) ** 2)
    return float(((extra - extra @ w) @ (w * (ks - w @ ks))) / spread) if spread > 0 else 0.0


def _fit(
    ks: np.ndarray, t_decode: float | np.ndarray, steps: np.ndarray, weights: np.ndarray, num_ks: int
) -> tuple[np.ndarray, np.ndarray]:
    """(t_draft, slope) per row of ``steps``; one fit K: the slope is 0 and t_draft what is left, at 0 or above."""
    extra = steps - np.reshape(t_decode, (-1, 1))
    if num_ks == 1:
        return np.maximum(extra[:, 0], 0.0), np.zeros(len(extra))
    return constrained_fit(ks, extra, weights)


def _bounds(samples: np.ndarray) -> list[float] | None:
    low, high = interval(samples)
    return None if math.isnan(low) or math.isnan(high) else [float(low), float(high)]


def sweep_taus(sweep: dict[str, Any]) -> dict[str, dict[int, tuple[float, list[float] | None]]]:
    """``{scope: {K: (tau, its 95% interval)}}`` from a run.json
    ``summary.sweep`` block (the teacher-forced prediction)."""

    def by_k(rows: list[dict[str, Any]]) -> dict[int, tuple[float, list[float] | None]]:
        return {int(r["k"]): (float(r["mean_acceptance_length"]), r.get("mean_acceptance_length_ci")) for r in rows}

    return {OVERALL: by_k(sweep["overall"]), **{cls: by_k(rows) for cls, rows in sweep["by_class"].items()}}


def _tau_draws(tau: float, tau_ci: Sequence[float | None] | None, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """Tau drawn from its 95% interval, one normal spread below and one above (a skewed interval stays skewed)."""
    if not tau_ci or tau_ci[0] is None or tau_ci[1] is None:
        return np.full(n_boot, tau)
    z = rng.standard_normal(n_boot)
    return tau + z * np.where(z < 0, tau - float(tau_ci[0]), float(tau_ci[1]) - tau) / Z_95


def predict(
    cells: list[dict[str, Any]],
    fits: dict[Any, FittedCosts],
    taus: dict[str, dict[int, tuple[float, list[float] | None]]],
    *,
    seed: int = 0,
    n_boot: int = NUM_BOOTSTRAP_RESAMPLES,
) -> list[dict[str, Any]]:
    """Predicted vs measured speedup and tau for every measured (load, K > 0, scope) the sweep covers.

    The predicted speedup's interval is the bootstrap of the module doc (requests, drift, tau, refit);
    ``None`` where the cells carry no per-request figures. ``predicted_pays`` / ``measured_pays``: the low
    end of each interval at or above 1, the rule the recommendation uses (:mod:`.advice`).
    """
    replicates = {}
    for load, fitted in fits.items():
        sampled = _resample(cells, load, list(fitted.fit_ks), seed, n_boot)
        if sampled is not None:
            drafts_b, slopes_b = _fit(
                sampled.ks, sampled.t_decode_b, sampled.steps_b, _weights(sampled), len(fitted.fit_ks)
            )
            replicates[load] = (sampled.t_decode_b, drafts_b, slopes_b)
    rows = []
    for measured in cells:
        load, k = load_of(measured), measured["k"]
        fitted = fits.get(load)
        sweep_row = taus.get(measured["scope"], {}).get(k)
        if fitted is None or k == 0 or sweep_row is None:
            continue
        tau_sweep, tau_ci = sweep_row
        predicted = fitted.speedup(tau_sweep, k)
        predicted_ci = None
        if load in replicates:
            t_decode_b, drafts_b, slopes_b = replicates[load]
            tau_rng = group_rng(seed, f"tau:{load_text(load)}:k{k}:{measured['scope']}")
            tau_b = _tau_draws(tau_sweep, tau_ci, tau_rng, len(t_decode_b))
            with np.errstate(divide="ignore", invalid="ignore"):
                predicted_ci = _bounds(tau_b * t_decode_b / (t_decode_b + drafts_b + slopes_b * k))
        speedup, tau, step = measured.get("speedup"), measured.get("tau"), measured.get("step_s")
        rows.append(
            {
                load_kind(measured): load,
                "k": k,
                "scope": measured["scope"],
                "held_out": k not in fitted.fit_ks,
                "predicted_tau": tau_sweep,
                "measured_tau": tau,
                "measured_tau_ci": measured.get("tau_ci"),
                "predicted_speedup": predicted,
                "predicted_speedup_ci": predicted_ci,
                "measured_speedup": speedup,
                "measured_speedup_ci": measured.get("speedup_ci"),
                "speedup_error": predicted - speedup if speedup is not None else None,
                "speedup_relative_error": predicted / speedup - 1.0 if speedup else None,
                "tau_error": tau_sweep - tau if tau is not None else None,
                "tau_relative_error": tau_sweep / tau - 1.0 if tau else None,
                "predicted_step_s": fitted.step_s(k),
                "measured_step_s": step,
                "step_relative_error": fitted.step_s(k) / step - 1.0 if step else None,
                "definition_gap": (
                    speedup * step / (fitted.t_decode_s * tau) - 1.0
                    if measured["scope"] == OVERALL and speedup and step and tau
                    else None
                ),
                "within_interval": _inside(speedup, predicted_ci),
                "prediction_within_measured_interval": _inside(predicted, measured.get("speedup_ci")),
                "predicted_pays": shown_to_pay(predicted_ci),
                "measured_pays": shown_to_pay(measured.get("speedup_ci")),
            }
        )
    return rows


def shown_to_pay(bounds: Sequence[float | None] | None) -> bool | None:
    """Shown to pay: the interval's low end at or above 1 (None: no interval)."""
    return None if not bounds or bounds[0] is None else bounds[0] >= 1.0


def _inside(value: float | None, bounds: Sequence[float | None] | None) -> bool | None:
    if value is None or not bounds or bounds[0] is None or bounds[1] is None:
        return None
    return bounds[0] <= value <= bounds[1]


def held_out_error(rows: list[dict[str, Any]]) -> float | None:
    """Mean absolute relative speedup error over the held-out K, overall scope: the prediction's one score."""
    errors = [
        abs(r["speedup_relative_error"])
        for r in rows
        if r["held_out"] and r["scope"] == OVERALL and r["speedup_relative_error"] is not None
    ]
    return float(np.mean(errors)) if errors else None
