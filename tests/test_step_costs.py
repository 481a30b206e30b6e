"""Step costs with their spread (stats/step_costs.py) and advice that holds under timing noise.

Timings are injected through a fake clock: each test states what the machine did (a spike on one K, a
verify cheaper than a decode, a noisy but consistent table) and asserts what the doctor makes of it.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from dflash_doctor.checks import CheckContext, run_checks
from dflash_doctor.rundir.run_record import OVERALL, RunMeta, RunRecord, Summary
from dflash_doctor.stats.speedup import build_sweep, load_cost_profile, recommend
from dflash_doctor.stats.step_costs import (
    DECODE,
    CostSamples,
    cost_replicates,
    fitted_costs,
    isotonic,
    measure_step_samples,
    median_interval,
    physics_violations,
    relative_half_width,
)


class FakeMachine:
    """A clock and step closures: ``cost(kind, k, call)`` says how long the call-th call of a step takes."""

    def __init__(self, cost):
        self.now = 0.0
        self.calls: dict[tuple[str, int], int] = {}
        self.cost = cost
        self.syncs = 0

    def clock(self) -> float:
        return self.now

    def sync(self) -> None:
        self.syncs += 1

    def run(self, kind: str, k: int) -> None:
        call = self.calls.get((kind, k), 0) + 1
        self.calls[(kind, k)] = call
        self.now += self.cost(kind, k, call)

    def measure(self, ks, *, flat_draft=True, budget_s=60.0, seed=0) -> CostSamples:
        return measure_step_samples(
            lambda: self.run("decode", 0),
            lambda k: self.run("verify", k),
            lambda k: self.run("draft", k),
            ks,
            flat_draft=flat_draft,
            budget_s=budget_s,
            sync=self.sync,
            device="fake",
            clock=self.clock,
            seed=seed,
        )


def physical(kind: str, k: int) -> float:
    """A target whose forward costs 10 ms + 0.5 ms per token, a DFlash block draft of 2 ms."""
    return {"decode": 0.010, "verify": 0.010 + 0.0005 * (k + 1), "draft": 0.002}[kind]


def jittered(seed: int, scale: float = 0.02):
    rng = np.random.default_rng(seed)
    return lambda kind, k, call: physical(kind, k) * (1.0 + scale * abs(rng.standard_normal()))


# ----------------------------------------------------------------------------- the interval of a median


def test_median_interval_brackets_the_median_and_needs_six_samples():
    assert median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)  # too few: the whole range
    median, low, high = median_interval(np.arange(1.0, 101.0))
    assert median == 50.5 and 39 <= low < 50.5 < high <= 62
    assert relative_half_width([1.0] * 10) == 0.0


def test_the_median_interval_covers_the_true_median_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    hits = sum(
        low <= np.log(2) <= high for low, high in (median_interval(rng.exponential(1.0, 30))[1:] for _ in range(2000))
    )
    assert 0.93 <= hits / 2000 <= 0.99


# ----------------------------------------------------------------------------- timing until tight


def test_timing_stops_when_every_median_is_tight_and_syncs_around_each_sample():
    machine = FakeMachine(jittered(0))
    samples = machine.measure([1, 4])
    repeats = {key: len(v) for key, v in samples.seconds.items()}
    assert min(repeats.values()) >= 6 and max(repeats.values()) < 100  # 2% jitter: tight long before the budget
    assert all(relative_half_width(v) <= 0.05 for v in samples.seconds.values())
    assert machine.syncs == 2 * sum(repeats.values())
    assert machine.calls[DECODE] == repeats[DECODE] + 2  # two warm-up calls, never timed


def test_timing_gives_up_at_the_budget_and_says_how_loose_it_stayed():
    rng = np.random.default_rng(2)
    machine = FakeMachine(lambda kind, k, call: physical(kind, k) * rng.lognormal(0.0, 1.0))  # wildly noisy
    samples = machine.measure([1, 4], budget_s=0.5)
    assert machine.now < 0.5 + 10 * 0.05 + 1.0  # the budget plus one round plus a re-timing at most
    spread = samples.spread()
    assert spread["budget_s"] == 0.5 and spread["decode"] > 0.05


def test_a_busy_spell_lands_on_every_step_kind_not_on_one():
    """Interleaved rounds in a random order: a spell that makes the first 40 calls 3x slower spreads over
    every kind, so the fitted costs keep their true order."""
    count = [0]

    def cost(kind, k, call):
        count[0] += 1
        return physical(kind, k) * (3.0 if count[0] <= 40 else 1.0)

    costs = fitted_costs(FakeMachine(cost).measure([1, 2, 4, 8]))
    assert costs.t_decode_s == pytest.approx(0.010, rel=0.05)
    assert costs.verify_s(8) == pytest.approx(0.0145, rel=0.05)


# ----------------------------------------------------------------------------- the physics


def test_isotonic_fit_pools_a_falling_pair_toward_the_more_precise_point():
    assert isotonic([1.0, 3.0, 2.0, 4.0], [1, 1, 1, 1]).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert isotonic([1.0, 3.0, 2.0], [1, 1, 9]).tolist() == pytest.approx([1.0, 2.1, 2.1])


def table(seconds: dict[tuple[str, int], list[float]], flat_draft: bool = True) -> CostSamples:
    return CostSamples({key: tuple(v) for key, v in seconds.items()}, device="fake", flat_draft=flat_draft)


def test_a_verify_cheaper_than_a_decode_beyond_the_noise_is_named():
    tight = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0]
    samples = table(
        {
            DECODE: [0.321 * x for x in tight],
            ("verify", 2): [0.430 * x for x in tight],
            ("verify", 4): [0.199 * x for x in tight],
            ("draft", 2): [0.01] * 7,
            ("draft", 4): [0.01] * 7,
        }
    )
    (sentence,) = [v for v in physics_violations(samples) if "decode" in v]
    assert "a verify of 5 tokens timed 0.199 ms" not in sentence and "a verify of 5 tokens" in sentence
    costs = fitted_costs(samples)
    assert costs.t_decode_s <= costs.verify_s(2) <= costs.verify_s(4)  # the fit obeys the physics anyway


def test_a_noisy_but_consistent_table_breaks_nothing():
    rng = np.random.default_rng(3)
    noisy = {
        key: list(physical(*key) * rng.lognormal(0.0, 0.3, 12))
        for key in [DECODE, ("verify", 1), ("verify", 2), ("draft", 1), ("draft", 2)]
    }
    assert physics_violations(table(noisy)) == []


def test_a_block_draft_is_one_cost_whatever_k_and_an_autoregressive_one_grows():
    seconds = {
        DECODE: [1.0] * 6,
        ("verify", 1): [1.1] * 6,
        ("verify", 4): [1.4] * 6,
        ("draft", 1): [0.2] * 6,
        ("draft", 4): [0.3] * 6,
    }
    flat = fitted_costs(table(seconds, flat_draft=True)).t_draft_s
    assert flat[1] == flat[4] and 0.2 < flat[1] < 0.3  # one cost, the precision-weighted mean of both Ks
    assert fitted_costs(table(seconds, flat_draft=False)).t_draft_s == pytest.approx({1: 0.2, 4: 0.3})


def test_a_spike_on_one_k_is_retimed_and_forgotten():
    def transient(kind, k, call):  # verify@4 reads 0.2x for its first 12 calls, then the truth
        return physical(kind, k) * (0.2 if (kind, k) == ("verify", 4) and call <= 12 else 1.0)

    samples = FakeMachine(transient).measure([2, 4], budget_s=1.0)
    assert ("verify", 4) in samples.retimed
    assert samples.violations == () and samples.shape_effects == ()  # the re-timing saw the truth


def test_a_break_the_retiming_reproduces_is_the_kernels_and_is_priced_pooled():
    """A CPU GEMM that runs 16 rows faster than 9 does it every time: the re-timing shows the break again on
    its own samples, so it is a shape effect of the machine, not noise. The fit pools those costs, advice on
    the Ks they price is marked uncertain, and nothing is withheld."""

    def persistent(kind, k, call):
        return physical(kind, k) * (0.2 if (kind, k) == ("verify", 4) else 1.0)

    broken = FakeMachine(persistent).measure([2, 4], budget_s=1.0)
    assert broken.violations == ()
    assert broken.shape_effects and "a verify of 5 tokens" in broken.shape_effects[0]
    assert 4 in broken.shape_effect_ks
    assert broken.spread()["shape_effect_ks"] == list(broken.shape_effect_ks)
    costs = fitted_costs(broken)
    assert costs.t_decode_s <= costs.verify_s(2) <= costs.verify_s(4)  # priced pooled, in the physical order

    centres = {2: 1.3, 4: 1.6}
    replicates = hand_replicates(centres, 0.02)
    rows = rows_from(replicates, centres)
    clear = recommend({OVERALL: rows}, replicates={OVERALL: replicates})[OVERALL]
    pooled = recommend(
        {OVERALL: rows},
        replicates={OVERALL: replicates},
        shape_effect_ks=broken.shape_effect_ks,
    )[OVERALL]
    assert (clear.k, clear.confidence) == (4, "clear")
    assert (pooled.k, pooled.confidence) == (4, "uncertain") and "pooled" in pooled.reason
    unaffected = recommend({OVERALL: rows}, replicates={OVERALL: replicates}, shape_effect_ks=[2])[OVERALL]
    assert (unaffected.k, unaffected.confidence) == (4, "clear")  # the best K's costs were not pooled


def _timed_twice(first_factor, retimed_factor, retimed_noise: float = 0.3, seed: int = 7) -> CostSamples:
    """verify@4 at ``first_factor`` of its physical cost (times a 30% lognormal noise) while the first timing
    runs (the clock's first second), at ``retimed_factor`` of it (times a lognormal noise of ``retimed_noise``)
    in the re-timing."""
    rng = np.random.default_rng(seed)
    machine = FakeMachine(lambda kind, k, call: physical(kind, k))

    def cost(kind, k, call):
        if (kind, k) != ("verify", 4):
            return physical(kind, k)
        if machine.now < 1.0:
            return physical(kind, k) * first_factor * rng.lognormal(0.0, 0.3)
        return physical(kind, k) * retimed_factor * rng.lognormal(0.0, retimed_noise)

    machine.cost = cost
    return machine.measure([2, 4], budget_s=1.0)


def test_a_break_the_two_timings_disagree_on_withholds_the_advice():
    """The first timing saw verify@4 far below verify@2 over many rounds; in the re-timing, on a machine that
    changed, it costs what physics says. The pooled samples still break the order, but verify@4 moved between
    the timings: the timing is not one machine's, so no advice is built on it."""
    samples = _timed_twice(0.4, 1.0)
    assert samples.shape_effects == ()
    assert samples.violations and "a verify of 5 tokens" in samples.violations[0]


def test_a_break_the_retiming_is_too_short_to_show_alone_is_still_the_kernels():
    """The demo on a quiet CPU: verify@4 costs the same (low) in both timings, but the re-timing's samples
    are too few and too spread to break the order by themselves. Nothing moved, so the pooled break is the
    machine's kernels, not a changed machine: the costs are pooled and advice is given."""
    samples = _timed_twice(0.6, 0.6, retimed_noise=1.0)
    assert samples.violations == ()
    assert samples.shape_effects and 4 in samples.shape_effect_ks


# ----------------------------------------------------------------------------- intervals that include the timing


def steps_frame(k: int, accepted_by_request: dict[str, list[int]], cls: str = "chat") -> pd.DataFrame:
    rows = [
        {"request_id": rid, "class": cls, "step": i, "position": 0, "k": k, "num_drafted": k, "num_accepted": min(a, k)}
        for rid, accepted in accepted_by_request.items()
        for i, a in enumerate(accepted)
    ]
    return pd.DataFrame(rows)


def workload(ks=(1, 2, 4)) -> dict[int, pd.DataFrame]:
    rng = np.random.default_rng(4)
    accepted = {f"r{i}": list(rng.geometric(0.45, 30) - 1) for i in range(12)}
    return {k: steps_frame(k, accepted) for k in ks}


def test_speedup_intervals_widen_with_the_timing_noise_and_contain_the_point():
    steps = workload()
    rng = np.random.default_rng(5)
    keys = [DECODE, ("verify", 1), ("verify", 2), ("verify", 4), ("draft", 1), ("draft", 2), ("draft", 4)]
    widths = []
    for noise in (0.01, 0.3):
        samples = table({key: list(physical(*key) * rng.lognormal(0.0, noise, 20)) for key in keys})
        priced = build_sweep(
            steps, fitted_costs(samples), {k: "exact" for k in steps}, cost_samples=samples, n_boot=300
        )
        row = priced.sweep.overall[-1]
        assert row.speedup_ci[0] <= row.speedup <= row.speedup_ci[1]
        widths.append(row.speedup_ci[1] - row.speedup_ci[0])
        assert set(priced.replicates[OVERALL]) == set(steps) and priced.replicates[OVERALL][4].shape == (300,)
    assert widths[1] > 2 * widths[0]


def test_turns_of_one_conversation_are_resampled_together():
    one = {"r0": [1] * 20, "r0#t1": [1] * 20, "r0#t2": [1] * 20, "r1": [0] * 20}
    costs = fitted_costs(table({DECODE: [1.0] * 6, ("verify", 1): [1.0] * 6, ("draft", 1): [0.0] * 6}))
    priced = build_sweep({1: steps_frame(1, one)}, costs, {1: "exact"}, n_boot=400)
    low, high = priced.sweep.overall[0].speedup_ci
    assert low == pytest.approx(1.0) and high == pytest.approx(2.0)  # two units: all of r0, or all of r1


def hand_replicates(centres: dict[int, float], noise: float, seed: int = 0) -> dict[int, np.ndarray]:
    """Paired replicates: one shared factor per resample (the decode time) times a small K-specific one."""
    rng = np.random.default_rng(seed)
    shared = rng.lognormal(0.0, noise, 1000)
    return {k: c * shared * rng.lognormal(0.0, noise / 5, 1000) for k, c in centres.items()}


def rows_from(replicates: dict[int, np.ndarray], centres: dict[int, float]):
    from dflash_doctor.rundir.run_record import SweepRow

    return [
        SweepRow(
            k=k,
            mean_acceptance_length=2.0,
            mean_acceptance_length_ci=[1.9, 2.1],
            speedup=c,
            estimate="exact",
            speedup_ci=list(np.quantile(replicates[k], [0.025, 0.975])),
        )
        for k, c in centres.items()
    ]


def test_the_advice_names_the_ks_it_cannot_tell_apart_and_pays_only_above_one():
    centres = {1: 1.30, 2: 1.50, 4: 1.52, 8: 1.20}
    replicates = hand_replicates(centres, 0.05)
    result = recommend({OVERALL: rows_from(replicates, centres)}, replicates={OVERALL: replicates})[OVERALL]
    assert (result.k, result.confidence) == (4, "clear")
    assert result.ks_within_noise == [2, 4] and "K 2, 4 within the noise" in result.reason


@pytest.mark.parametrize(
    ("centres", "k", "confidence", "starts"),
    [
        ({1: 0.80, 2: 0.85}, 0, "clear", "Speculation off"),
        ({1: 0.95, 2: 0.98}, 0, "uncertain", "Speculation may not pay"),
        ({1: 1.00, 2: 1.04}, 2, "uncertain", "K=2 is the best"),
    ],
)
def test_speculation_is_off_only_when_the_whole_interval_lies_below_one(centres, k, confidence, starts):
    replicates = hand_replicates(centres, 0.06)
    result = recommend({"chat": rows_from(replicates, centres)}, replicates={"chat": replicates})["chat"]
    assert (result.k, result.confidence) == (k, confidence) and result.reason.startswith(starts)


def test_a_timing_that_breaks_the_physics_gets_no_advice_and_a_timing_warning():
    centres = {1: 1.3, 2: 1.5}
    replicates = hand_replicates(centres, 0.02)
    violation = "a verify of 5 tokens timed 199 ms, below a decode step at 321 ms, beyond both medians' 95% intervals"
    result = recommend(
        {OVERALL: rows_from(replicates, centres)}, replicates={OVERALL: replicates}, timing_violations=[violation]
    )[OVERALL]
    assert (result.k, result.confidence) == (0, "unreliable") and result.reason.startswith("No advice")

    samples = CostSamples(
        {DECODE: (0.321,) * 6, ("verify", 4): (0.199,) * 6, ("draft", 4): (0.01,) * 6},
        device="cpu",
        flat_draft=True,
        violations=(violation,),
    )
    priced = build_sweep(
        {4: steps_frame(4, {"r0": [2] * 10})}, fitted_costs(samples), {4: "exact"}, cost_samples=samples, n_boot=50
    )
    record = RunRecord(meta=RunMeta(command="check"), summary=Summary(sweep=priced.sweep))
    (check,) = run_checks(CheckContext(record=record), only=["timing"])
    assert check.status == "warn" and "changed while they were taken" in check.summary


def test_two_noisy_timings_of_one_machine_never_give_opposite_confident_advice():
    """The reported failure: seven minutes apart, 0.77x 'off' and 2.3x 'K=4'. Simulate many pairs of timings of
    one machine whose true best speedup is near 1 with heavy-tailed noise: whenever both runs are confident,
    they agree."""
    steps = workload((1, 2, 4))
    keys = [DECODE, ("verify", 1), ("verify", 2), ("verify", 4), ("draft", 1), ("draft", 2), ("draft", 4)]

    def near_one(kind, k):  # the demo pair on a CPU: verify barely dearer than decode, a costly draft
        return {"decode": 0.020, "verify": 0.020 + 0.002 * k, "draft": 0.015}[kind]

    def advice(seed: int) -> tuple[int, str]:
        rng = np.random.default_rng(seed)
        samples = table({key: list(near_one(*key) * rng.lognormal(0.0, 0.4, 8)) for key in keys})
        priced = build_sweep(
            steps, fitted_costs(samples), {k: "exact" for k in steps}, cost_samples=samples, n_boot=200
        )
        result = recommend(priced.sweep.scopes(), replicates=priced.replicates)[OVERALL]
        return result.k, result.confidence

    runs = [advice(seed) for seed in range(16)]
    confident = {k > 0 for k, confidence in runs if confidence == "clear"}
    assert len(confident) <= 1, runs


def test_costs_and_spread_round_trip_through_run_json_and_a_profile(tmp_path):
    samples = FakeMachine(jittered(6)).measure([1, 2])
    priced = build_sweep(
        {2: steps_frame(2, {"r0": [1] * 10, "r1": [2] * 10})},
        fitted_costs(samples),
        {2: "exact"},
        cost_samples=samples,
        n_boot=50,
    )
    block = json.loads(json.dumps(priced.sweep.costs))
    assert block["spread"]["flat_draft"] is True and block["spread"]["repeats"]["decode"] >= 6
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(block), encoding="utf-8")
    assert load_cost_profile(path).t_decode_s == pytest.approx(fitted_costs(samples).t_decode_s)
    again = CostSamples.from_frame(samples.to_frame(), flat_draft=True)
    assert again.seconds == samples.seconds
    replicas = cost_replicates(samples, 20, np.random.default_rng(0))
    assert all(m.t_decode_s <= m.verify_s(1) <= m.verify_s(2) for m in replicas)


# ----------------------------------------------------------------------------- the head-to-head's verdict


def _contender(name: str, steps: dict[int, pd.DataFrame], samples: CostSamples):
    from dflash_doctor.rundir.run_record import ModelInfo
    from dflash_doctor.stats.head_to_head import Contender
    from dflash_doctor.stats.metrics import summarize

    summary = summarize(steps[max(steps)])
    summary.sweep = build_sweep(
        steps, fitted_costs(samples), {k: "exact" for k in steps}, cost_samples=samples, n_boot=200
    ).sweep
    models = {
        "target": ModelInfo("t", "0", "float32", "cpu", "target"),
        "draft": ModelInfo(name, "0", "float32", "cpu", name),
    }
    return Contender(name, RunRecord(meta=RunMeta(command="check"), models=models, summary=summary), steps, samples)


def test_a_head_to_head_names_no_winner_on_one_conversation_and_pairs_the_timing():
    """The probe's case: a class verdict drawn from one drafted step of one conversation (its two turns were
    resampled as two requests). Now the unit is the conversation, and too few of them give no winner."""
    from dflash_doctor.stats.head_to_head import build_head_to_head

    keys = [DECODE, ("verify", 4), ("draft", 4)]
    rng = np.random.default_rng(7)
    timing = {key: list(physical(*key) * rng.lognormal(0.0, 0.05, 12)) for key in keys}
    good = {"r0": [4] * 3, "r0#t1": [4] * 3}
    poor = {"r0": [0] * 3, "r0#t1": [1] * 3}
    first = _contender("good", {4: steps_frame(4, good)}, table(timing))
    second = _contender("poor", {4: steps_frame(4, poor)}, table({**timing, ("draft", 4): [0.0001] * 12}))
    verdict = build_head_to_head([first, second], n_boot=200).scopes[OVERALL].verdict
    assert not verdict.decisive and "too few requests to decide (1 conversation(s)" in verdict.text

    many = {f"r{i}": [4] * 12 for i in range(8)}
    few = {f"r{i}": [0] * 12 for i in range(8)}
    result = build_head_to_head(
        [
            _contender("good", {4: steps_frame(4, many)}, table(timing)),
            _contender("poor", {4: steps_frame(4, few)}, table(timing)),
        ],
        n_boot=200,
    )
    verdict = result.scopes[OVERALL].verdict
    assert verdict.decisive and verdict.text.startswith("overall: deploy good at K=4")
    spread = result.costs.spread
    assert spread is not None and len(spread.t_decode_s_ci) == 2 and set(spread.t_draft_s_ci) == {"good", "poor"}


def test_a_head_to_head_shares_the_timing_of_the_speculator_that_verified_the_largest_k():
    """A block drafter of 8 slots times verification up to K = 7, an n-gram lookup up to 8: the lookup's K = 8 is
    priced from the wider timing's samples (the GPU lane's head-to-head failed with "K=8 was asked")."""
    from dflash_doctor.stats.head_to_head import build_head_to_head

    rng = np.random.default_rng(8)
    block = {key: list(physical(*key) * rng.lognormal(0.0, 0.05, 8)) for key in [DECODE, ("verify", 7), ("draft", 7)]}
    lookup = {key: list(physical(*key) * rng.lognormal(0.0, 0.05, 8)) for key in [DECODE, ("verify", 8), ("draft", 8)]}
    conversations = {f"r{i}": [3] * 10 for i in range(6)}
    result = build_head_to_head(
        [
            _contender("block", {7: steps_frame(7, conversations)}, table(block)),
            _contender("lookup", {8: steps_frame(8, conversations)}, table(lookup)),
        ],
        n_boot=100,
    )
    spread = result.costs.spread
    assert result.costs.t_verify_s.keys() == {8} and spread is not None and spread.t_verify_s_ci.keys() == {8}
    assert all(np.isfinite(row.speedup) for row in result.scopes[OVERALL].rows)
