"""tune's cost fit with intervals: injected cells with per-request step times drawn from known costs
(step(K) = t_decode + t_draft + slope * K) and a known noise, so the constrained fit, the width of its
intervals and their coverage of the true speedup can be held against the truth; and the advice's wording
read off the measured intervals."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from dflash_doctor.tune.advice import recommend_grid
from dflash_doctor.tune.analysis import cell
from dflash_doctor.tune.prediction import fit_costs, predict

T_DECODE, T_DRAFT, SLOPE = 0.020, 0.006, 0.002
ALPHA = 0.6  # per-position acceptance of the simulated draft


def true_tau(k: int) -> float:
    return 1.0 + sum(ALPHA**i for i in range(1, k + 1))


def true_step(k: int, slope: float = SLOPE) -> float:
    return T_DECODE + T_DRAFT + slope * k


def grid_cells(
    rng: random.Random,
    *,
    noise: float,
    ks=(2, 4, 8),
    num_requests: int = 12,
    slope: float = SLOPE,
    step_of=None,
    spike: tuple[int, float, int] | None = None,
    drift: float = 0.0,
) -> list[dict]:
    """Overall cells at concurrency 1 as :func:`dflash_doctor.tune.analysis.analyse` writes them (the figures
    the fit reads): each request's decode time is its steps times the true step cost times a lognormal
    factor of spread ``noise``; ``spike`` = (K, factor, requests): that many requests of K ran ``factor``
    slower (a burst of contention); ``drift``: the baseline's second pass ran that much slower."""
    step_of = step_of or (lambda k: true_step(k, slope))
    ids = [f"r{i}" for i in range(num_requests)]
    base = {"request_id": [], "repeat": [], "decode_s": [], "tokens": [], "drafts": [], "accepted": []}
    for repeat in (0, 1):
        for rid in ids:
            tokens = rng.randint(40, 60)
            base["request_id"].append(rid)
            base["repeat"].append(repeat)
            base["tokens"].append(tokens)
            base["decode_s"].append(tokens * T_DECODE * (1.0 + drift * repeat) * math.exp(rng.gauss(0.0, noise)))
            base["drafts"].append(0)
            base["accepted"].append(0)
    cells = [_cell(0, base)]
    cells[0]["tpot_s"] = sum(base["decode_s"]) / sum(base["tokens"])
    for k in ks:
        figures = {
            "request_id": list(ids),
            "repeat": [0] * num_requests,
            "decode_s": [],
            "tokens": [],
            "drafts": [],
            "accepted": [],
        }
        for i in range(num_requests):
            drafts = rng.randint(15, 30)
            accepted = round(drafts * (true_tau(k) - 1.0))
            slow = spike[1] if spike and spike[0] == k and i < spike[2] else 1.0
            figures["drafts"].append(drafts)
            figures["accepted"].append(accepted)
            figures["tokens"].append(drafts + accepted)
            figures["decode_s"].append(drafts * step_of(k) * slow * math.exp(rng.gauss(0.0, noise)))
        c = _cell(k, figures)
        c["step_s"] = sum(figures["decode_s"]) / sum(figures["drafts"])
        c["tau"] = 1.0 + sum(figures["accepted"]) / sum(figures["drafts"])
        tpot_k = sum(figures["decode_s"]) / sum(figures["tokens"])
        c["speedup"] = cells[0]["tpot_s"] / tpot_k
        c["speedup_ci"] = [c["speedup"] * 0.97, c["speedup"] * 1.03]
        cells.append(c)
    return cells


def _cell(k: int, figures: dict) -> dict:
    return {"concurrency": 1, "k": k, "scope": "overall", "per_request": figures}


def sweep(ks=(2, 4, 8), spread: float = 0.0, rng: random.Random | None = None) -> dict:
    """The teacher-forced taus: the truth, or an estimate off by a normal error of ``spread`` with its 95% interval."""
    taus = {}
    for k in ks:
        tau = true_tau(k) + (rng.gauss(0.0, spread) if rng else 0.0)
        taus[k] = (tau, [tau - 1.96 * spread, tau + 1.96 * spread])
    return {"overall": taus}


def held_out_row(cells: list[dict], taus: dict, fit_ks=(2, 4), k: int = 8, n_boot: int = 1000) -> tuple[object, dict]:
    fitted = fit_costs(cells, 1, fit_ks, n_boot=n_boot)
    rows = predict(cells, {1: fitted}, taus, n_boot=n_boot)
    return fitted, next(r for r in rows if r["k"] == k)


def test_exact_cells_give_the_true_costs_and_a_prediction_without_error():
    cells = grid_cells(random.Random(0), noise=0.0)
    measured_taus = {"overall": {k: (cell(cells, 1, k)["tau"], None) for k in (2, 4, 8)}}
    fitted, row = held_out_row(cells, measured_taus)
    assert (fitted.t_decode_s, fitted.t_draft_s, fitted.verify_slope_s) == pytest.approx((T_DECODE, T_DRAFT, SLOPE))
    assert row["held_out"] and row["speedup_relative_error"] == pytest.approx(0.0, abs=1e-9)
    assert row["tau_relative_error"] == 0.0 and row["definition_gap"] == pytest.approx(0.0, abs=1e-9)
    assert row["within_interval"] and row["prediction_within_measured_interval"]


def test_a_falling_verify_cost_is_fitted_flat_and_no_cost_goes_negative():
    """step(4) < step(2) well beyond the noise: the free line's slope is negative; the fit holds it at 0
    (verifying more tokens never costs less) in the point fit and in every replicate."""
    falling = {2: 0.032, 4: 0.029, 8: 0.030}
    fitted = fit_costs(grid_cells(random.Random(1), noise=0.02, step_of=falling.get), 1, (2, 4))
    assert fitted.verify_slope_s == 0.0 and fitted.t_draft_s > 0
    assert fitted.verify_slope_s_ci[0] == 0.0 and fitted.t_draft_s_ci[0] >= 0.0
    assert "fall with K" in fitted.note
    assert fitted.step_s(8) == pytest.approx(fitted.step_s(2)) and fitted.step_s(2) > fitted.t_decode_s


def test_a_verify_step_cheaper_than_a_decode_is_held_at_a_decode_and_named():
    """A step at K = 4 timed below a plain decode step beyond its noise (the reported 199 ms against 321 ms):
    no cost goes below a decode step and the note says the costs are not reliable."""
    cheap = {2: 0.030, 4: 0.012, 8: 0.040}
    fitted = fit_costs(grid_cells(random.Random(2), noise=0.02, step_of=cheap.get), 1, (2, 4))
    assert fitted.t_draft_s >= 0.0 and fitted.verify_slope_s >= 0.0 and fitted.step_s(4) >= fitted.t_decode_s
    assert "K 4 measured below a plain decode step beyond its noise" in fitted.note and "not reliable" in fitted.note


def test_the_interval_widens_with_the_noise():
    widths = []
    for noise in (0.02, 0.08):
        _, row = held_out_row(grid_cells(random.Random(3), noise=noise), sweep())
        low, high = row["predicted_speedup_ci"]
        widths.append((high - low) / row["predicted_speedup"])
    assert widths[1] > 2.5 * widths[0] > 0


def test_the_baseline_drift_widens_the_interval():
    """The same requests, the baseline's second pass 20% slower: the machine's drift between runs is in the interval."""
    widths = []
    for drift in (0.0, 0.2):
        fitted, row = held_out_row(grid_cells(random.Random(4), noise=0.02, drift=drift), sweep())
        widths.append(row["predicted_speedup_ci"][1] - row["predicted_speedup_ci"][0])
    assert fitted.drift_spread == pytest.approx(math.log(1.2) / math.sqrt(2.0), rel=0.1)
    assert widths[1] > 2 * widths[0]


def test_the_interval_carries_the_sweeps_tau_uncertainty():
    cells = grid_cells(random.Random(5), noise=0.02)
    narrow = held_out_row(cells, sweep(spread=0.0))[1]["predicted_speedup_ci"]
    wide = held_out_row(cells, sweep(spread=0.1))[1]["predicted_speedup_ci"]
    assert wide[1] - wide[0] > 1.5 * (narrow[1] - narrow[0])


def test_a_spike_at_one_k_is_weighted_down():
    """Fit from K = 1..4, three of twelve requests at K = 3 ran 3x slow: the inverse-variance weights give K = 3
    little say, so the held-out K = 8 is predicted closer than an equal-weight line through the same points,
    and its interval covers the true speedup."""
    ks, fit_ks = (1, 2, 3, 4, 8), (1, 2, 3, 4)
    cells = grid_cells(random.Random(6), noise=0.02, ks=ks, spike=(3, 3.0, 3))
    fitted, row = held_out_row(cells, sweep(ks), fit_ks=fit_ks)
    truth = true_tau(8) * T_DECODE / true_step(8)
    steps = np.array([cell(cells, 1, k)["step_s"] for k in fit_ks])
    equal_slope, equal_intercept = np.polyfit(np.array(fit_ks, dtype=float), steps, 1)
    equal = true_tau(8) * T_DECODE / (equal_intercept + 8 * equal_slope)
    assert abs(row["predicted_speedup"] / truth - 1) < 0.5 * abs(equal / truth - 1)
    assert row["predicted_speedup_ci"][0] <= truth <= row["predicted_speedup_ci"][1]


def test_the_interval_covers_the_true_speedup_in_most_simulated_grids():
    """200 seeded grids (12 requests, 5% per-request timing noise, tau estimated with a 3% error): the held-out
    K = 8's 95% interval covers the true speedup in at least 85% of them, and stays informative (median
    half-width under 20% of the prediction)."""
    rng = random.Random(7)
    covered, half_widths = 0, []
    for _ in range(200):
        cells = grid_cells(rng, noise=0.05)
        _, row = held_out_row(cells, sweep(spread=0.03 * true_tau(8), rng=rng), n_boot=300)
        low, high = row["predicted_speedup_ci"]
        covered += low <= true_tau(8) * T_DECODE / true_step(8) <= high
        half_widths.append((high - low) / 2 / row["predicted_speedup"])
    assert covered >= 170, covered
    assert float(np.median(half_widths)) < 0.20


def test_within_interval_asks_whether_the_measurement_lies_in_the_prediction():
    """The measured speedup far off the prediction: ``within_interval`` is False, and the miss splits into
    tau, step time and definitions whose product is the whole miss."""
    cells = grid_cells(random.Random(8), noise=0.01)
    measured8 = cell(cells, 1, 8)
    measured8["speedup"] *= 1.5
    measured8["speedup_ci"] = [measured8["speedup"] * 0.6, measured8["speedup"] * 1.4]
    _, row = held_out_row(cells, sweep())
    assert row["within_interval"] is False and row["prediction_within_measured_interval"] is True
    parts = (1 + row["tau_relative_error"]) / (1 + row["step_relative_error"]) / (1 + row["definition_gap"])
    assert parts == pytest.approx(1 + row["speedup_relative_error"])
    assert row["definition_gap"] == pytest.approx(0.5, rel=1e-6)


def test_cells_without_per_request_figures_get_a_point_fit_and_no_interval():
    cells = [
        {"concurrency": 1, "k": 0, "scope": "overall", "tpot_s": 0.010},
        {"concurrency": 1, "k": 2, "scope": "overall", "step_s": 0.020, "tau": 2.0, "speedup": 1.0},
        {"concurrency": 1, "k": 4, "scope": "overall", "step_s": 0.024, "tau": 2.4, "speedup": 1.0},
    ]
    fitted = fit_costs(cells, 1, (2, 4))
    assert fitted.verify_slope_s == pytest.approx(0.002) and fitted.t_decode_s_ci is None
    row = predict(cells, {1: fitted}, {"overall": {4: (2.4, [2.3, 2.5])}})[0]
    assert row["predicted_speedup_ci"] is None and row["within_interval"] is None


def _measured(k: int, speedup: float, low: float, high: float) -> dict:
    return {
        "concurrency": 1,
        "k": k,
        "scope": "overall",
        "tau": 2.0,
        "tau_ci": [1.8, 2.2],
        "speedup": speedup,
        "speedup_ci": [low, high],
    }


def test_the_advice_says_pays_does_not_pay_or_within_the_noise_from_the_intervals():
    pays = recommend_grid(
        [
            _measured(2, 1.20, 1.05, 1.35),
            _measured(4, 1.25, 1.10, 1.40),
            _measured(8, 1.00, 0.70, 1.30),
            _measured(16, 0.80, 0.75, 0.85),
        ]
    )["1"]["overall"]
    assert pays["verdict"] == "pays" and pays["k"] == 4 and pays["ks_within_noise"] == [2, 4, 8]
    assert "K 2, 4, 8 within the noise" in pays["reason"]

    off = recommend_grid([_measured(2, 0.90, 0.85, 0.97), _measured(4, 0.80, 0.70, 0.95)])["1"]["overall"]
    assert off["verdict"] == "does not pay" and off["k"] == 0 and off["reason"].startswith("Speculation off")

    noise = recommend_grid([_measured(2, 1.05, 0.90, 1.25), _measured(4, 0.94, 0.79, 1.17)])["1"]["overall"]
    assert noise["verdict"] == "within the noise" and noise["k"] == 0 and noise["confidence"] == "uncertain"
    assert noise["reason"].startswith("Within the noise") and "Speculation off" not in noise["reason"]
    assert "K=2, ran at 1.05x [0.90, 1.25]; K 2, 4 within the noise" in noise["reason"]


def test_a_strict_class_is_judged_on_the_k_it_may_serve():
    """Only K = 8 pays, beyond the strict class's K <= 4; its K 2 and 4 lie below 1: the class does not pay."""
    cells = [_measured(2, 0.90, 0.85, 0.95), _measured(4, 0.92, 0.88, 0.97), _measured(8, 1.30, 1.20, 1.40)]
    strict = recommend_grid([c | {"scope": "math"} for c in cells], strict_classes=("math",))["1"]["math"]
    assert strict["k"] == 0 and strict["verdict"] == "does not pay"
