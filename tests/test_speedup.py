"""Cost model, timing harness, cost profiles, sweep rows and the K recommendation."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from dflash_doctor.errors import UsageError
from dflash_doctor.stats.metrics import expected_tau_iid, tau_with_ci
from dflash_doctor.checks import CheckContext, run_checks
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.rundir.run_record import OVERALL, RunMeta, RunRecord, StepCosts, Summary, Sweep, SweepRow
from dflash_doctor.stats.speedup import (
    best_speedup,
    build_sweep,
    k_that_pays,
    leviathan_speedup,
    load_cost_profile,
    priced_speedups,
    recommend,
    sweep_row,
)


def costs_flat_draft() -> StepCosts:
    return StepCosts(
        t_decode_s=0.010, t_verify_s={1: 0.011, 5: 0.015}, t_draft_s={1: 0.002}, source="profile", device="test"
    )


# ----------------------------------------------------------------------------- cost model


def test_leviathan_matches_the_general_form_for_iid_acceptance():
    t_decode_s = 0.02
    for alpha in (0.5, 0.8, 0.95):
        for c in (0.05, 0.3):
            for k in (1, 3, 8):
                costs = StepCosts(t_decode_s=t_decode_s, t_verify_s={k: t_decode_s}, t_draft_s={k: k * c * t_decode_s})
                general = costs.speedup(expected_tau_iid(alpha, k), k)
                assert leviathan_speedup(alpha, k, c) == pytest.approx(general)


def test_speedup_interpolates_between_measured_k_and_refuses_outside():
    costs = costs_flat_draft()
    assert costs.verify_s(3) == pytest.approx(0.013)  # halfway between K=1 and K=5
    assert costs.draft_s(9) == pytest.approx(0.002)  # one entry: the same at every K
    assert costs.speedup(3.0, 3) == pytest.approx(3.0 * 0.010 / (0.002 + 0.013))
    assert costs.speedup(3.0, 0) == 1.0  # speculation off
    with pytest.raises(UsageError, match="K=7"):
        costs.verify_s(7)


def test_step_costs_round_trip_through_the_run_json_block():
    costs = costs_flat_draft()
    block = json.loads(json.dumps(costs.as_dict()))
    assert block["t_verify_s"] == {"1": 0.011, "5": 0.015}
    assert StepCosts.from_dict(block) == costs


# ----------------------------------------------------------------------------- cost profiles


def test_toml_profile_with_a_flat_draft_and_a_verify_table(tmp_path):
    path = tmp_path / "h200.toml"
    path.write_text(
        'device = "H200 vLLM batch 8"\nt_decode_s = 0.008\nt_draft_s = 0.001\n[t_verify_s]\n1 = 0.0081\n16 = 0.0112\n',
        encoding="utf-8",
    )
    costs = load_cost_profile(path)
    assert (costs.source, costs.device) == ("profile", "H200 vLLM batch 8")
    assert costs.t_verify_s == {1: 0.0081, 16: 0.0112}
    assert costs.draft_s(12) == 0.001


def test_run_json_costs_block_is_a_valid_json_profile(tmp_path):
    measured = StepCosts(t_decode_s=0.01, t_verify_s={1: 0.012, 2: 0.013}, t_draft_s={1: 0.001, 2: 0.002}, device="cpu")
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(measured.as_dict()), encoding="utf-8")
    loaded = load_cost_profile(path)
    assert loaded.t_verify_s == measured.t_verify_s and loaded.t_draft_s == measured.t_draft_s
    assert loaded.source == "profile"


@pytest.mark.parametrize(
    ("name", "text", "named"),
    [
        ("broken.toml", "t_decode_s = = 1", "not valid TOML"),
        ("broken.json", "{t_decode_s: 1}", "not valid JSON"),
        ("missing.toml", "t_decode_s = 0.01\nt_draft_s = 0.001\n", "lacks t_verify_s"),
        ("typo.toml", "t_decode_s = 0.01\nt_draft_s = 0.001\nt_verfy_s = 0.01\n", "unknown keys"),
        ("negative.toml", "t_decode_s = -0.01\nt_draft_s = 0\nt_verify_s = 0.01\n", "t_decode_s = -0.01"),
        ("zero_verify.toml", "t_decode_s = 0.01\nt_draft_s = 0\nt_verify_s = 0\n", "t_verify_s = 0"),
        ("text.toml", 't_decode_s = "fast"\nt_draft_s = 0\nt_verify_s = 0.01\n', "not a number"),
        ("bad_k.toml", "t_decode_s = 0.01\nt_draft_s = 0\n[t_verify_s]\nfour = 0.01\n", "'four'"),
        ("list.json", "[1, 2]", "must hold an object"),
        ("costs.yaml", "t_decode_s: 0.01", ".toml or .json"),
    ],
)
def test_bad_cost_profiles_name_the_file_and_the_fix(tmp_path, name, text, named):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(UsageError) as caught:
        load_cost_profile(path)
    message = caught.value.message
    assert str(path) in message and named in message
    assert caught.value.exit_code == 2


def test_missing_cost_profile_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_cost_profile(tmp_path / "nope.toml")


# ----------------------------------------------------------------------------- sweep and recommendation


def steps_at(k: int, accepted_by_class: dict[str, list[int]]) -> pd.DataFrame:
    rows = []
    for cls, accepted in accepted_by_class.items():
        for i, count in enumerate(accepted):
            rows.append({"request_id": f"{cls}{i % 3}", "class": cls, "step": i, "position": 0, "k": k,
                         "num_drafted": k, "num_accepted": count})  # fmt: skip
    return pd.DataFrame(rows)


def test_build_sweep_prices_every_k_per_class_with_the_costs():
    costs = costs_flat_draft()
    steps_by_k = {
        1: steps_at(1, {"math": [1, 1, 1, 0, 1, 1], "chat": [0, 1, 0, 0, 1, 0]}),
        5: steps_at(5, {"math": [5, 4, 5, 2, 5, 3], "chat": [0, 1, 0, 2, 1, 0]}),
    }
    sweep = build_sweep(steps_by_k, costs, {1: "exact", 5: "truncated"}, n_boot=100).sweep
    assert [row.k for row in sweep.overall] == [1, 5]
    assert sweep.costs == costs.as_dict()
    math_k5 = sweep.by_class["math"][1]
    assert math_k5.mean_acceptance_length == pytest.approx(1 + 24 / 6)
    assert math_k5.speedup == pytest.approx((1 + 24 / 6) * 0.010 / (0.002 + 0.015))
    assert math_k5.estimate == "truncated"
    tau, ci = tau_with_ci(steps_by_k[5], n_boot=100, seed=0)
    assert sweep.overall[1].mean_acceptance_length == pytest.approx(tau)
    assert sweep.overall[1].mean_acceptance_length_ci == pytest.approx(ci)
    json.dumps(RunRecord(meta=RunMeta(command="sweep"), summary=Summary(sweep=sweep)).to_json())  # run.json-ready
    recommendation = recommend(sweep.scopes())
    assert set(recommendation) == {"overall", "math", "chat"}
    assert recommendation["math"].k == 5
    with pytest.raises(ValueError, match="estimate"):
        build_sweep(steps_by_k, costs, {1: "exact"})


def hand_sweep(speedups: dict[int, float], *, tau_low_share: float = 0.97) -> list[SweepRow]:
    """Rows with tau = speedup (unit costs) and a tau interval whose low end is tau_low_share of tau."""
    return [
        SweepRow(
            k=k,
            mean_acceptance_length=s,
            mean_acceptance_length_ci=[s * tau_low_share, s * 1.02],
            speedup=s,
            estimate="exact",
        )
        for k, s in speedups.items()
    ]


def test_recommend_picks_the_best_k_and_the_smallest_k_within_the_share():
    rows = hand_sweep({1: 1.5, 2: 2.0, 3: 2.4, 4: 2.5, 5: 2.45, 6: 2.3})
    result = recommend({"math": rows})["math"]
    assert (result.k, result.conservative_k, result.speedup) == (4, 3, 2.5)
    assert "K=4" in result.reason and "2.50x" in result.reason and "K=3" in result.reason
    assert recommend({"math": rows}, conservative_share=0.5)["math"].conservative_k == 1


def test_recommend_breaks_ties_toward_the_smaller_k():
    result = recommend({"code": hand_sweep({2: 1.8, 3: 2.2, 4: 2.2})})["code"]
    assert (result.k, result.conservative_k) == (3, 3)
    assert "no smaller K" in result.reason


def test_strict_class_gets_a_capped_k():
    rows = hand_sweep({1: 1.5, 2: 2.0, 4: 2.4, 8: 3.0})
    result = recommend({"code": rows, "chat": rows}, strict_classes=["chat"], strict_max_k=4)
    assert result["code"].k == 8
    assert result["chat"].k == 4
    assert "strict class: K <= 4" in result["chat"].reason


def test_strict_class_turns_speculation_off_when_speedup_is_below_one():
    slow = hand_sweep({1: 0.9, 2: 0.8, 4: 0.6})
    result = recommend({"chat": slow}, strict_classes=["chat"])["chat"]
    assert (result.k, result.conservative_k, result.speedup) == (0, 0, 1.0)
    assert result.reason.startswith("Speculation off") and "0.90x" in result.reason


def test_strict_class_is_off_when_the_low_end_of_tau_could_be_a_slowdown():
    marginal = hand_sweep({1: 1.03, 2: 1.05}, tau_low_share=0.9)  # point speedup > 1, low end < 1
    assert recommend({"chat": marginal})["chat"].k == 2
    assert recommend({"chat": marginal}, strict_classes=["chat"])["chat"].k == 0


def test_any_class_is_off_when_every_k_is_a_slowdown():
    result = recommend({"chat": hand_sweep({1: 0.95, 2: 0.7})})["chat"]
    assert result.k == 0
    assert result.reason.startswith("Speculation off")


def test_rows_without_a_price_are_ignored():
    rows = hand_sweep({1: 1.4, 2: 1.6})
    rows.append(
        SweepRow(
            k=3, mean_acceptance_length=None, mean_acceptance_length_ci=[None, None], speedup=None, estimate="exact"
        )
    )
    assert recommend({"chat": rows})["chat"].k == 2
    assert recommend({"chat": []})["chat"].k == 0


def test_sweep_row_refuses_an_unknown_estimate_kind():
    with pytest.raises(ValueError):
        sweep_row(2, 2.0, [1.9, 2.1], 1.5, "guessed")


def test_the_k_that_pays_is_one_rule_for_recommend_and_the_speculative_k_check():
    """The best K (the smaller one on a tie) pays when it reaches plain decoding's 1.0x; below that speculation is
    off. run.json's recommendation and the speculative-k check's suggested K come from this one rule, also at the
    edge where watch's advice used to differ (a K at exactly 1.0x was 'off' there)."""
    assert best_speedup({3: 1.4, 1: 1.2, 2: 1.4}) == (2, 1.4)
    assert (k_that_pays((2, 1.0)), k_that_pays((2, 0.99)), k_that_pays((2, 1.1), floor=1.2)) == (2, 0, 0)
    for speedups, expected in (([1.0, 0.8], 1), ([0.9, 0.95], 0), ([1.2, 1.3, 1.3], 2)):
        rows = [
            SweepRow(k=k, mean_acceptance_length=2.0, mean_acceptance_length_ci=[1.9, 2.1], speedup=s, estimate="exact")
            for k, s in enumerate(speedups, start=1)
        ]
        assert priced_speedups(rows) == dict(enumerate(speedups, start=1))
        assert recommend({OVERALL: rows})[OVERALL].k == expected
        record = RunRecord(
            meta=RunMeta(command="sweep"), summary=Summary(sweep=Sweep(overall=rows, by_class={}, costs={}))
        )
        check = run_checks(CheckContext(record=record, config=DoctorConfig(k=(9,))), only=["speculative-k"])[0]
        assert check.metrics["by_scope"][OVERALL]["suggested_k"] == expected


@pytest.mark.parametrize("confidence", ["uncertain", "unreliable"])
def test_a_k_past_the_useful_range_fails_even_where_speed_cannot_judge_it(confidence):
    """The slot rule needs no price: slot 4 accepted in 1 of 60 steps is wasted verify work at any speed. A K the
    recommendation finds within the noise of the best (or a timing not reliable enough to judge speed) still
    fails on it; only the speed findings are left out."""
    from dflash_doctor.rundir.run_record import Recommendation
    from dflash_doctor.stats.metrics import summarize

    steps = pd.DataFrame(
        [
            {"request_id": f"r{i // 6}", "class": "chat", "k": 4, "num_drafted": 4, "num_accepted": 4 if i == 0 else 1}
            for i in range(60)
        ]
    )
    summary = summarize(steps, n_boot=20)
    rows = [
        SweepRow(k=k, mean_acceptance_length=2.0, mean_acceptance_length_ci=[1.9, 2.1], speedup=s, estimate="exact")
        for k, s in ((1, 1.30), (2, 1.32), (3, 1.31), (4, 1.30))
    ]
    summary.sweep = Sweep(overall=rows, by_class={}, costs={})
    noise = Recommendation(
        k=2, conservative_k=1, speedup=1.32, reason="", ks_within_noise=[1, 2, 3, 4], confidence=confidence
    )
    record = RunRecord(meta=RunMeta(command="check"), summary=summary, recommendation={OVERALL: noise, "chat": noise})
    check = run_checks(CheckContext(record=record, config=DoctorConfig(k=(4,))), only=["speculative-k"])[0]
    assert check.status == "fail"
    failing = [f for f in check.findings if f.severity == "fail"]
    assert len(failing) == 2 and all("far past the useful range" in f.message for f in failing)  # overall, chat
    assert not any("speedup" in f.message for f in check.findings)
