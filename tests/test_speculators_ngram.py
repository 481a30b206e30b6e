"""The ngram speculator: vLLM's prompt-lookup rule, the live loop and the teacher-forced replay against an
independent reference written here from the rule (not from the module's scan)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.ngram import NgramProposer, NgramSettings, ngram_lookup
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, token_rows, walk_schedule
from tiny_models import VOCAB, tiny_target


def reference_lookup(context: list[int], k: int, lo: int, hi: int, max_model_len: int | None = None) -> list[int]:
    """The rule in words: longest n in [lo, hi] whose last-n tokens occur earlier (overlap allowed), the
    earliest such occurrence, then up to k following tokens; k capped by max_model_len - len(context)."""
    total = len(context)
    if total < lo:
        return []
    if max_model_len is not None:
        k = min(k, max_model_len - total)
    if k <= 0:
        return []
    for n in range(min(hi, total - 1), lo - 1, -1):
        suffix = context[total - n :]
        for start in range(0, total - n):  # every start but the suffix's own, earliest first
            if context[start : start + n] == suffix:
                follow = start + n
                return context[follow : follow + k]
    return []


def test_vllm_docstring_example_and_defaults():
    assert ngram_lookup([1, 2, 3, 4, 2, 3], 4, NgramSettings.resolve(2, 3)) == [4, 2, 3]
    assert NgramSettings.resolve() == NgramSettings(5, 5)
    assert NgramSettings.resolve(prompt_lookup_max=3) == NgramSettings(3, 3)
    assert NgramSettings.resolve(prompt_lookup_min=2) == NgramSettings(2, 2)
    with pytest.raises(ValueError):
        NgramSettings.resolve(4, 2)


def test_earliest_occurrence_wins_a_tie_and_the_longest_match_wins_over_it():
    settings = NgramSettings.resolve(1, 3)
    # [7, 8] occurs at 0 (-> 1) and at 3 (-> 2): the earliest one proposes 1
    assert ngram_lookup([7, 8, 1, 7, 8, 2, 9, 7, 8], 1, settings) == [1]
    # a longer match later beats a shorter one earlier: [5, 7, 8] at 4 is length 3
    assert ngram_lookup([7, 8, 1, 9, 5, 7, 8, 4, 5, 7, 8], 1, settings) == [4]


@pytest.mark.parametrize("seed", range(4))
def test_scan_equals_the_reference_on_random_contexts(seed):
    rng = np.random.default_rng(seed)
    for _ in range(400):
        alphabet = int(rng.integers(2, 5))
        context = rng.integers(0, alphabet, size=int(rng.integers(0, 30))).tolist()
        lo = int(rng.integers(1, 5))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 9))
        cap = None if rng.random() < 0.7 else int(rng.integers(0, 40))
        got = ngram_lookup(context, k, NgramSettings.resolve(lo, hi, max_model_len=cap))
        assert got == reference_lookup(context, k, lo, hi, cap), (context, lo, hi, k, cap)


def reference_steps(
    prompt: list[int], truth: list[int], k: int, max_new: int, lo: int, hi: int
) -> list[tuple[int, int, int]]:
    """vLLM's greedy loop over the target's own greedy text: (position, drafted, accepted) per step."""
    steps, i = [], 0  # output index of the last committed token
    while i + 1 < max_new and i + 1 < len(truth):
        budget = min(k, max_new - (i + 1) - 1)
        proposal = reference_lookup(prompt + truth[: i + 1], budget, lo, hi)
        accepted = 0
        while (
            accepted < len(proposal) and i + 1 + accepted < len(truth) and proposal[accepted] == truth[i + 1 + accepted]
        ):
            accepted += 1
        steps.append((i + 1, len(proposal), accepted))
        i += accepted + 1
    return steps


PROMPTS = [[5, 17, 42, 8, 9, 5, 17, 42, 8, 9, 5, 17], [11, 12, 13, 11, 12], [60, 61, 62, 63, 64, 65, 66, 67]]


@pytest.mark.parametrize("lo,hi", [(1, 3), (2, 2), (5, 5)])
def test_live_loop_and_teacher_equal_the_reference(lo, hi):
    target_model = tiny_target()
    settings = NgramSettings.resolve(lo, hi)
    max_new = 40
    drafted_any = 0
    for prompt in PROMPTS:
        truth = plain_generate(TargetModel(target_model), torch.tensor(prompt), max_new_tokens=max_new).output_ids
        table, _ = slot_table(
            TargetModel(target_model), NgramProposer(settings, VOCAB), TeacherSequence(prompt, truth), 8
        )
        for k in (1, 3, 8):
            live = speculative_generate(
                TargetModel(target_model),
                NgramProposer(settings, VOCAB),
                torch.tensor(prompt),
                k=k,
                max_new_tokens=max_new,
            )
            assert live.output_ids == truth  # lossless: the target's own greedy text
            expected = reference_steps(prompt, truth, k, max_new, lo, hi)
            assert [(s.position, s.num_drafted, s.num_accepted) for s in live.steps] == expected, (prompt, k)
            walked = walk_schedule(table.matches[:, :k], truth, k, max_new, frozenset(), drafted=table.drafted)
            assert [(s.position, s.num_drafted, s.num_accepted, s.bonus_token) for s in walked] == [
                (s.position, s.num_drafted, s.num_accepted, s.bonus_token) for s in live.steps
            ], (prompt, k)
            drafted_any += sum(s.num_drafted for s in live.steps)
            if k == 8:  # token records: the teacher's rows equal the live loop's, a point mass per proposal
                rows = token_rows(table, walked, truth)
                assert [(r.position, r.draft_token, r.accepted) for r in rows] == [
                    (r.position, r.draft_token, r.accepted) for r in live.tokens
                ]
                for r in live.tokens:
                    assert r.draft_prob_of_target == (1.0 if r.draft_token == r.target_token else 0.0)
                    assert r.total_variation == pytest.approx(1.0 - r.target_prob_of_draft, abs=1e-5)
                    assert r.target_rank_in_draft == (0 if r.draft_token == r.target_token else 1)
    if lo <= 2:  # the prompts and the tiny target's loops give a short lookup something to find
        assert drafted_any > 0
