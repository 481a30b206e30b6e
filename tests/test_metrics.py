"""Acceptance metrics on hand-written step tables: counters, tau, rates, histogram, intervals."""

from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd
import pytest

from dflash_doctor.stats.metrics import (
    conditional_rates,
    expected_tau_iid,
    summarize,
    tau_from_rates,
    tau_with_ci,
    truncate_steps,
)


def make_steps(accepted_by_request: dict[str, list[int]], *, k: int, classes: dict[str, str]) -> pd.DataFrame:
    """A steps table; an accepted count of -1 stands for a plain decode step (nothing drafted)."""
    rows = []
    for request_id, accepted in accepted_by_request.items():
        position = 0
        for step, count in enumerate(accepted):
            drafted = 0 if count < 0 else k
            rows.append(
                {
                    "request_id": request_id,
                    "class": classes[request_id],
                    "step": step,
                    "position": position,
                    "k": k,
                    "num_drafted": drafted,
                    "num_accepted": max(count, 0),
                }
            )
            position += max(count, 0) + 1
    return pd.DataFrame(rows)


def random_steps(num_requests: int, steps_per_request: int, *, k: int, alpha: float, seed: int) -> pd.DataFrame:
    """Steps whose accepted counts follow i.i.d. per-slot acceptance ``alpha`` (a run of successes)."""
    rng = np.random.default_rng(seed)
    success = rng.random((num_requests * steps_per_request, k)) < alpha
    accepted = np.cumprod(success, axis=1).sum(axis=1)
    request_ids = np.repeat([f"r{i}" for i in range(num_requests)], steps_per_request)
    return pd.DataFrame(
        {
            "request_id": request_ids,
            "class": "chat",
            "step": np.tile(np.arange(steps_per_request), num_requests),
            "position": 0,
            "k": k,
            "num_drafted": k,
            "num_accepted": accepted,
        }
    )


HAND_STEPS = make_steps(
    {"A": [3, 1, 0, 2], "B": [3, 3, -1, 0]},
    k=3,
    classes={"A": "math", "B": "code"},
)


def test_known_table_gives_known_counters_tau_rates_and_histogram():
    overall = summarize(HAND_STEPS, n_boot=50).overall
    # draft steps accept 3,1,0,2 and 3,3,0; B's third step is a plain decode step
    assert overall.num_requests == 2
    assert overall.num_drafts == 7
    assert overall.num_draft_tokens == 21
    assert overall.num_accepted_tokens == 12
    assert overall.num_accepted_tokens_per_pos == [5, 4, 3]
    assert overall.acceptance_histogram == [2, 1, 1, 3]
    assert overall.mean_acceptance_length == pytest.approx(1 + 12 / 7)
    assert overall.acceptance_rate_per_pos == pytest.approx([5 / 7, 4 / 7, 3 / 7])
    assert overall.conditional_acceptance_rate_per_pos == pytest.approx([5 / 7, 4 / 5, 3 / 4])
    assert overall.draft_acceptance_rate == pytest.approx(12 / 21)
    # output tokens: accepted + 1 per step, the plain decode step included: 12 + 8
    assert overall.num_output_tokens == 20
    assert overall.wasted_verify_tokens_per_output_token == pytest.approx(9 / 20)
    # per-request tau: A = 1 + 6/4, B = 1 + 6/3
    assert overall.request_tau.mean == pytest.approx((2.5 + 3.0) / 2)
    assert overall.request_tau.p50 == pytest.approx(2.75)
    assert overall.mean_acceptance_length == pytest.approx(tau_from_rates(overall.acceptance_rate_per_pos))


def test_by_class_splits_requests_and_keeps_the_contract_keys():
    summary = summarize(HAND_STEPS, n_boot=50)
    assert set(summary.by_class) == {"math", "code"}
    math_block = summary.by_class["math"]
    assert math_block.num_drafts == 4
    assert math_block.mean_acceptance_length == pytest.approx(2.5)
    assert math_block.acceptance_histogram == [1, 1, 1, 1]
    assert summary.by_class["code"].num_accepted_tokens_per_pos == [2, 2, 2]
    assert set(vars(math_block)) == set(vars(summary.overall)) == {
        "num_requests", "num_output_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
        "num_accepted_tokens_per_pos", "mean_acceptance_length", "mean_acceptance_length_ci",
        "acceptance_rate_per_pos", "acceptance_rate_per_pos_ci", "conditional_acceptance_rate_per_pos",
        "draft_acceptance_rate", "acceptance_histogram", "request_tau", "wasted_verify_tokens_per_output_token",
    }  # fmt: skip


def test_requests_table_gives_exact_output_tokens_and_counts_requests_without_steps():
    requests = pd.DataFrame(
        {"request_id": ["A", "B", "C"], "class": ["math", "code", "code"], "num_output_tokens": [13, 9, 1]}
    )
    summary = summarize(HAND_STEPS, requests, n_boot=50)
    assert summary.overall.num_requests == 3
    assert summary.overall.num_output_tokens == 23
    assert summary.by_class["code"].num_requests == 2
    assert summary.by_class["code"].num_output_tokens == 10
    assert summary.overall.wasted_verify_tokens_per_output_token == pytest.approx(9 / 23)


def test_num_slots_pads_per_position_lists_and_rejects_too_few_slots():
    overall = summarize(HAND_STEPS, num_slots=5, n_boot=20).overall
    assert overall.num_accepted_tokens_per_pos == [5, 4, 3, 0, 0]
    assert len(overall.acceptance_histogram) == 6
    with pytest.raises(ValueError):
        summarize(HAND_STEPS, num_slots=2)


def test_no_drafts_gives_undefined_ratios_not_a_crash():
    plain = make_steps({"A": [-1, -1, -1]}, k=0, classes={"A": "chat"})
    overall = summarize(plain, n_boot=20).overall
    assert overall.num_drafts == 0
    assert overall.num_output_tokens == 3
    assert math.isnan(overall.mean_acceptance_length)
    assert all(math.isnan(x) for x in overall.mean_acceptance_length_ci)


def test_accepted_beyond_drafted_is_refused():
    broken = HAND_STEPS.copy()
    broken.loc[0, "num_accepted"] = 4
    with pytest.raises(ValueError, match="num_accepted"):
        summarize(broken)


def test_ci_brackets_the_estimate_and_narrows_with_more_requests():
    few = summarize(random_steps(20, 10, k=4, alpha=0.7, seed=1), n_boot=400).overall
    many = summarize(random_steps(800, 10, k=4, alpha=0.7, seed=2), n_boot=400).overall
    for block in (few, many):
        low, high = block.mean_acceptance_length_ci
        assert low < block.mean_acceptance_length < high
        for rate, (rate_low, rate_high) in zip(block.acceptance_rate_per_pos, block.acceptance_rate_per_pos_ci):
            assert rate_low <= rate <= rate_high
    few_width, many_width = (
        block.mean_acceptance_length_ci[1] - block.mean_acceptance_length_ci[0] for block in (few, many)
    )
    assert many_width < few_width / 3  # sqrt(40) ~ 6x narrower in theory
    # and it covers the true tau of i.i.d. acceptance
    low, high = many.mean_acceptance_length_ci
    assert low < expected_tau_iid(0.7, 4) < high


def test_bootstrap_is_seeded_and_unaffected_by_other_classes_rows():
    chat = random_steps(30, 5, k=3, alpha=0.6, seed=6)
    first = summarize(pd.concat([HAND_STEPS, chat]), n_boot=200, seed=7)
    chat_first = summarize(pd.concat([chat, HAND_STEPS]), n_boot=200, seed=7)
    low, high = first.by_class["chat"].mean_acceptance_length_ci
    assert chat_first.by_class["chat"].mean_acceptance_length_ci == [low, high]
    other_seed = summarize(pd.concat([HAND_STEPS, chat]), n_boot=200, seed=8)
    assert other_seed.by_class["chat"].mean_acceptance_length_ci != [low, high]


def test_bootstrap_resamples_requests_not_steps():
    # ten requests of 50 steps: five accept every token, five none. The unit is the request, so the
    # interval must reflect ten coin flips (tau 1 + 4 p, p's sd 0.16: width ~ 2.5), not 500 (width ~ 0.35).
    accepted = {f"r{i}": [4 if i < 5 else 0] * 50 for i in range(10)}
    steps = make_steps(accepted, k=4, classes=dict.fromkeys(accepted, "chat"))
    low, high = summarize(steps, n_boot=500).overall.mean_acceptance_length_ci
    assert high - low > 1.5


def test_bootstrap_stays_fast_for_ten_thousand_requests():
    steps = random_steps(10_000, 20, k=8, alpha=0.8, seed=3)
    start = time.perf_counter()
    summary = summarize(steps, n_boot=1000)
    elapsed_s = time.perf_counter() - start
    assert summary.overall.num_requests == 10_000
    assert elapsed_s < 15.0, f"summarize took {elapsed_s:.1f} s for 10k requests"


def test_tau_with_ci_matches_summarize():
    tau, ci = tau_with_ci(HAND_STEPS, n_boot=100, seed=0)
    overall = summarize(HAND_STEPS, n_boot=100, seed=0).overall
    assert tau == pytest.approx(overall.mean_acceptance_length)
    assert ci == pytest.approx(overall.mean_acceptance_length_ci)


def test_truncated_steps_give_tau_from_the_first_k_rates():
    steps = random_steps(50, 20, k=6, alpha=0.75, seed=4)
    rates = summarize(steps, n_boot=10).overall.acceptance_rate_per_pos
    for k in (1, 3, 6):
        truncated = summarize(truncate_steps(steps, k), n_boot=10).overall
        assert truncated.mean_acceptance_length == pytest.approx(tau_from_rates(rates[:k]))
        assert truncated.num_draft_tokens == 50 * 20 * k


def test_leviathan_tau_is_the_general_form_with_geometric_rates():
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for k in (1, 4, 15):
            geometric_rates = [alpha ** (i + 1) for i in range(k)]
            assert expected_tau_iid(alpha, k) == pytest.approx(tau_from_rates(geometric_rates))


def test_conditional_rates_divide_by_the_previous_slot():
    assert conditional_rates([0.8, 0.4, 0.0, 0.0]) == pytest.approx([0.8, 0.5, 0.0, float("nan")], nan_ok=True)
