"""Window arithmetic on engine counters: differences, resets, sums, vLLM's metric definitions, intervals."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dflash_doctor.telemetry.counts import SpecCounts, bootstrap_tau_interval, tau_interval, total, window_tau_interval
from dflash_doctor.telemetry.exposition import parse_exposition


def counts_from_lengths(lengths: list[int], k: int) -> SpecCounts:
    """Counts an engine would export after drafts that accepted ``lengths`` tokens each (K drafted per step)."""
    lengths = np.asarray(lengths)
    return SpecCounts(
        num_drafts=float(len(lengths)),
        num_draft_tokens=float(len(lengths) * k),
        num_accepted_tokens=float(lengths.sum()),
        num_accepted_tokens_per_pos=tuple(float((lengths > i).sum()) for i in range(k)),
    )


def test_metrics_follow_vllm_definitions():
    counts = counts_from_lengths([0, 1, 3, 4, 2], k=4)
    assert counts.mean_acceptance_length == pytest.approx(1 + 10 / 5)  # bonus token included
    assert counts.draft_acceptance_rate == pytest.approx(10 / 20)
    assert counts.acceptance_rate_per_pos == pytest.approx([4 / 5, 3 / 5, 2 / 5, 1 / 5])
    assert counts.k == 4
    # tau = 1 + sum of the unconditional per-position rates (vLLM's definition: bonus token included)
    assert counts.mean_acceptance_length == pytest.approx(1 + sum(counts.acceptance_rate_per_pos))


def test_difference_of_snapshots_is_the_window():
    early = counts_from_lengths([1, 2], k=3)
    late = early.plus(counts_from_lengths([3, 0, 0], k=3))
    window, reset = late.since(early)
    assert not reset
    assert window == counts_from_lengths([3, 0, 0], k=3)


def test_counter_reset_counts_from_zero():
    before_restart = counts_from_lengths([3, 3, 3, 3], k=3)
    after_restart = counts_from_lengths([1], k=3)  # the server restarted: counters started over
    window, reset = after_restart.since(before_restart)
    assert reset
    assert window == after_restart  # what the restarted server counted, never a negative count


def test_missing_fields_stay_missing():
    sglang_like = SpecCounts(num_drafts=10.0, num_accepted_tokens=15.0, num_generated_tokens=25.0)
    assert sglang_like.acceptance_rate_per_pos is None
    assert sglang_like.draft_acceptance_rate is None
    assert sglang_like.plus(sglang_like).num_draft_tokens is None
    assert total([]) == SpecCounts()


def test_per_position_series_may_grow_between_scrapes():
    # vLLM creates position series as positions first accept; an earlier scrape may have fewer.
    early = SpecCounts(num_drafts=5.0, num_accepted_tokens=3.0, num_accepted_tokens_per_pos=(3.0,))
    late = SpecCounts(num_drafts=9.0, num_accepted_tokens=8.0, num_accepted_tokens_per_pos=(6.0, 2.0))
    window, reset = late.since(early)
    assert not reset and window.num_accepted_tokens_per_pos == (3.0, 2.0)


def test_interval_from_histogram_covers_the_truth():
    """The count-based interval has close to its nominal coverage for independent drafts."""
    rng = np.random.default_rng(0)
    k, alpha, n = 6, 0.6, 400
    true_tau = 1 + sum(alpha ** (i + 1) for i in range(k))
    hits = 0
    trials = 300
    for _ in range(trials):
        accepted = np.minimum(rng.geometric(1 - alpha, size=n) - 1, k)  # i.i.d. chain acceptance
        lo, hi = tau_interval(counts_from_lengths(list(accepted), k))
        hits += lo <= true_tau <= hi
    assert 0.91 <= hits / trials <= 0.99


def test_interval_without_per_position_counts_is_wider():
    counts = counts_from_lengths([0, 1, 3, 4, 2] * 40, k=4)
    bounded = SpecCounts(
        num_drafts=counts.num_drafts,
        num_draft_tokens=counts.num_draft_tokens,
        num_accepted_tokens=counts.num_accepted_tokens,
    )
    exact = tau_interval(counts)
    worst_case = tau_interval(bounded)
    assert worst_case[1] - worst_case[0] > exact[1] - exact[0]
    assert tau_interval(SpecCounts(num_drafts=0.0, num_accepted_tokens=0.0)) is None


def test_bootstrap_over_scrape_intervals_sees_between_interval_spread():
    # Each scrape interval is dominated by one kind of request: tau 1.2 or 3.0. The count-based interval
    # (independent drafts) is narrow; the bootstrap over intervals is not - and the window keeps the wider.
    units = [
        counts_from_lengths([0] * 40 + [1] * 10, 4) if i % 2 else counts_from_lengths([2] * 50, 4) for i in range(8)
    ]
    pooled = total(units)
    narrow = tau_interval(pooled)
    spread = bootstrap_tau_interval(units)
    combined = window_tau_interval(pooled, units)
    assert spread[1] - spread[0] > narrow[1] - narrow[0]
    assert combined[0] <= min(narrow[0], spread[0]) and combined[1] >= max(narrow[1], spread[1])
    assert bootstrap_tau_interval(units[:3]) is None  # too few intervals to measure a spread


def test_exposition_reads_by_name_and_label_and_counts_garbage():
    text = (
        "# HELP x y\n# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="a \\"quoted\\" name"} 4687.0\n'
        "this is not a sample\n"
        'vllm:spec_decode_num_drafts_total{model_name="b"} 1e3 1700000000000\n'
        "plain_metric 7\n"
        'broken_value{a="b"} abc\n'
    )
    expo = parse_exposition(text)
    drafts = expo.named("vllm:spec_decode_num_drafts_total")
    assert [(s.labels.get("model_name"), s.value) for s in drafts] == [('a "quoted" name', 4687.0), ("b", 1000.0)]
    assert expo.named("plain_metric")[0].labels == {}
    assert expo.num_unreadable_lines == 2
    assert expo.first_unreadable_line == "this is not a sample"


def test_interval_is_never_zero_width():
    rejected = counts_from_lengths([0] * 50, k=4)
    lo, hi = tau_interval(rejected)
    assert lo == 1.0 and hi == pytest.approx(1 + 3 / 50)  # rule of three, clipped at tau >= 1
    accepted = counts_from_lengths([4] * 50, k=4)
    lo, hi = tau_interval(accepted)
    assert hi == 5.0 and lo == pytest.approx(5 - 3 / 50)  # clipped at 1 + K


def test_the_interval_from_a_bounded_sample_of_units_matches_the_one_from_all_of_them():
    """A days-long watch keeps a uniform sample of its units: the sample's bootstrap, narrowed by
    sqrt(sample / all), gives the interval the whole watch's bootstrap gives (and a far wider one without)."""
    rng = random.Random(1)
    units = []
    for _ in range(4000):
        drafts = float(rng.randint(50, 150))
        accepted = drafts * rng.uniform(0.8, 2.2)  # scrape intervals differ far more than their drafts explain
        units.append(SpecCounts(num_drafts=drafts, num_draft_tokens=4 * drafts, num_accepted_tokens=accepted))
    pooled = total(units)
    full = bootstrap_tau_interval(units)
    sample = rng.sample(units, 256)
    from_sample = window_tau_interval(pooled, sample, num_units=len(units))
    unscaled = bootstrap_tau_interval(sample)
    assert full is not None and from_sample is not None and unscaled is not None
    width = full[1] - full[0]
    assert from_sample[1] - from_sample[0] == pytest.approx(width, rel=0.3)
    assert from_sample[0] < pooled.mean_acceptance_length < from_sample[1]
    assert unscaled[1] - unscaled[0] > 3 * width
