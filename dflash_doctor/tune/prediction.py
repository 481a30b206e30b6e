"""The engine's step-cost model fitted from some measured K, and the other K predicted from it.

Model (per load level), in seconds per step, the same terms as :class:`dflash_doctor.rundir.run_record.StepCosts`:

    t_decode            one plain decode step: TPOT measured at K = 0
    step(K) = t_decode + t_draft + slope * K
              \\___ t_verify(K) ___/  verifying 1 + K tokens costs a decode step plus slope per extra token;
                                     t_draft is flat in K (a DFlash block is one draft pass)

``step(K)`` is measured on the engine as decode time per verify step at K (:mod:`.analysis`, ``step_s``).
The fit is least squares over the fit K (``--fit-k``, default: the two smallest K > 0) with the slope held
at 0 or above (a falling verify cost is noise); with one fit K the slope is 0 (verification taken as flat,
the memory-bound case) and the prediction says so.
The prediction for K and a class is the sweep's formula with the fitted costs and the doctor's
teacher-forced tau of that class at K, from one replay of the same prompts:

    speedup(K) = tau_sweep(K) * t_decode / step(K)

and it is held against the measured speedup (TPOT(0) / TPOT(K)) and tau at every K and class, the K
outside the fit marked ``held_out``. The fitted costs are written as a ``--cost-profile`` file
(docs/cost-profile.md) so ``check``, ``sweep`` and ``watch`` price with the engine's own costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dflash_doctor.tune.analysis import OVERALL, cell
from dflash_doctor.tune.loads import load_kind, load_label, load_of


@dataclass(frozen=True)
class FittedCosts:
    """The fitted step-cost model of one load level."""

    load: str  # in words: "concurrency 8", "request rate 2/s"
    t_decode_s: float
    t_draft_s: float
    verify_slope_s: float  # extra verify time per drafted token
    fit_ks: tuple[int, ...]
    note: str

    def step_s(self, k: int) -> float:
        return self.t_decode_s + self.t_draft_s + self.verify_slope_s * k

    def speedup(self, tau: float, k: int) -> float:
        return tau * self.t_decode_s / self.step_s(k)

    def as_profile(self, max_k: int, device: str) -> dict[str, Any]:
        """The ``--cost-profile`` JSON: the line sampled at K = 1 and ``max_k`` (StepCosts interpolates
        linearly between table entries, so two points carry it exactly); a negative fitted draft time
        (noise) is folded into verification, whose sum is all the speedup formula uses."""
        draft = max(self.t_draft_s, 0.0)
        verify = {str(k): self.step_s(k) - draft for k in sorted({1, max_k})}
        return {
            "device": device,
            "notes": f"fitted by dflash-doctor tune at {self.load} from K {', '.join(map(str, self.fit_ks))}: {self.note}",
            "t_decode_s": self.t_decode_s, "t_verify_s": verify, "t_draft_s": {"1": draft},
        }


def fit_costs(cells: list[dict[str, Any]], load: Any, fit_ks: tuple[int, ...]) -> FittedCosts | None:
    """Least squares of step(K) - t_decode = t_draft + slope * K over the fit K measured at this load;
    None when K = 0 or every fit K lacks a step time (the engine reported no drafts)."""
    base = cell(cells, load, 0)
    if base is None or not base.get("tpot_s"):
        return None
    t_decode = float(base["tpot_s"])
    points = [(k, c["step_s"]) for k in fit_ks if (c := cell(cells, load, k)) is not None and c.get("step_s")]
    if not points:
        return None
    ks = np.array([p[0] for p in points], dtype=np.float64)
    extra = np.array([p[1] for p in points], dtype=np.float64) - t_decode
    slope, draft = (float(x) for x in np.polyfit(ks, extra, 1)) if len(points) > 1 else (0.0, float(extra[0]))
    if len(points) == 1:
        note = f"one fit K ({points[0][0]}): verification taken as flat in K"
    elif slope < 0:
        # verifying more tokens never costs less: a falling line is timing noise, the flat fit is the least-squares one under slope >= 0
        slope, draft = 0.0, float(extra.mean())
        note = f"least squares over {len(points)} K gave a verify cost falling with K (timing noise); taken as flat"
    else:
        note = f"least squares over {len(points)} K"
    return FittedCosts(load_label(load_kind(base), load), t_decode, draft, slope, tuple(int(p[0]) for p in points), note)


def sweep_taus(sweep: dict[str, Any]) -> dict[str, dict[int, tuple[float, list[float] | None]]]:
    """``{scope: {K: (tau, its 95% interval)}}`` from a run.json ``summary.sweep`` block (the teacher-forced prediction)."""
    def by_k(rows: list[dict[str, Any]]) -> dict[int, tuple[float, list[float] | None]]:
        return {int(r["k"]): (float(r["mean_acceptance_length"]), r.get("mean_acceptance_length_ci")) for r in rows}

    return {OVERALL: by_k(sweep["overall"]), **{cls: by_k(rows) for cls, rows in sweep["by_class"].items()}}


def predict(cells: list[dict[str, Any]], fits: dict[Any, FittedCosts],
            taus: dict[str, dict[int, tuple[float, list[float] | None]]]) -> list[dict[str, Any]]:
    """Predicted vs measured speedup and tau for every measured (load, K > 0, scope) the sweep covers.

    The predicted speedup's interval is tau's (speedup is proportional to tau at fixed costs; the cost
    fit's own error is not in it). ``predicted_pays`` / ``measured_pays``: the low end of each interval at
    or above 1, the rule the recommendation uses (:mod:`.advice`), so the two verdicts compare directly.
    """
    rows = []
    for measured in cells:
        fitted = fits.get(load_of(measured))
        k = measured["k"]
        sweep_row = taus.get(measured["scope"], {}).get(k)
        if fitted is None or k == 0 or sweep_row is None:
            continue
        tau_sweep, tau_ci = sweep_row
        predicted = fitted.speedup(tau_sweep, k)
        predicted_ci = [predicted * bound / tau_sweep for bound in tau_ci] if tau_ci and None not in tau_ci else None
        speedup = measured.get("speedup")
        tau = measured.get("tau")
        rows.append({
            load_kind(measured): load_of(measured), "k": k, "scope": measured["scope"], "held_out": k not in fitted.fit_ks,
            "predicted_tau": tau_sweep, "measured_tau": tau, "measured_tau_ci": measured.get("tau_ci"),
            "predicted_speedup": predicted, "predicted_speedup_ci": predicted_ci,
            "measured_speedup": speedup, "measured_speedup_ci": measured.get("speedup_ci"),
            "speedup_error": predicted - speedup if speedup is not None else None,
            "speedup_relative_error": predicted / speedup - 1.0 if speedup else None,
            "tau_error": tau_sweep - tau if tau is not None else None,
            "within_interval": _inside(predicted, measured.get("speedup_ci")),
            "predicted_pays": shown_to_pay(predicted_ci), "measured_pays": shown_to_pay(measured.get("speedup_ci")),
        })
    return rows


def shown_to_pay(bounds: Sequence[float | None] | None) -> bool | None:
    """Shown to pay: the interval's low end at or above 1 (None: no interval)."""
    return None if not bounds or bounds[0] is None else bounds[0] >= 1.0


def _inside(value: float, bounds: Sequence[float | None] | None) -> bool | None:
    if not bounds or bounds[0] is None or bounds[1] is None:
        return None
    return bounds[0] <= value <= bounds[1]


def held_out_error(rows: list[dict[str, Any]]) -> float | None:
    """Mean absolute relative speedup error over the held-out K, overall scope: the prediction's one score."""
    errors = [abs(r["speedup_relative_error"]) for r in rows if r["held_out"] and r["scope"] == OVERALL and r["speedup_relative_error"] is not None]
    return float(np.mean(errors)) if errors else None
