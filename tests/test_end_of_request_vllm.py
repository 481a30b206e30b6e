"""vLLM's end of a request (engine/schedule.py ``vllm``): the last step drafts K however few tokens are left, and counts
every draft it accepts, past max_tokens and past an accepted stop token; the teacher-forced replay reproduces it from
the target's greedy tokens past each answer's end (``TeacherSequence.tail_ids``), generated once with the answer.
The llama.cpp convention keeps every draft inside the budget, as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_doctor.engine.batched import generate_greedy_batch
from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.proposers.suffix import SuffixProposer, SuffixSettings
from dflash_doctor.engine.schedule import CONVENTIONS
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import (
    TeacherSequence,
    greedy_tail,
    sampled_past_end,
    slot_table,
    token_rows,
    walk_schedule,
)
from tiny_models import TEACHER_PROMPTS, VOCAB, draft_that_agrees_often, tiny_dflash, tiny_target

VLLM, LLAMACPP = CONVENTIONS["vllm"], CONVENTIONS["llamacpp"]
KEYS = ("position", "num_drafted", "num_accepted", "bonus_token")


def _strip(steps):
    return [tuple(getattr(s, key) for key in KEYS) for s in steps]


def test_walk_counts_past_max_tokens_and_past_an_accepted_stop_only_under_vllm():
    """Hand-made tables: output of 10 tokens (100..109), 2 tail tokens; matches[i, j-1] is slot j of anchor i."""
    matches = np.zeros((9, 3), dtype=bool)
    matches[0] = [True, True, False]
    matches[3] = [True, True, True]
    matches[7] = [True, True, True]  # position 8, two tokens left: slot 3 lies past the end
    output = list(range(100, 110))
    assert _strip(walk_schedule(matches, output, 3, 10, frozenset(), VLLM)) == [
        (1, 3, 2, 103),
        (4, 3, 3, 107),
        (8, 3, 3, -1),
    ]
    assert _strip(walk_schedule(matches, output, 3, 10, frozenset(), LLAMACPP)) == [
        (1, 3, 2, 103),
        (4, 3, 3, 107),
        (8, 1, 1, 109),
    ]
    # the step with one token left: vLLM drafts K (here 2 matched, 1 past the end), llama.cpp decodes plainly
    matches[7] = [False, False, False]
    matches[8] = [True, True, False]
    assert _strip(walk_schedule(matches, output, 3, 10, frozenset(), VLLM))[-2:] == [(8, 3, 0, 108), (9, 3, 2, -1)]
    assert _strip(walk_schedule(matches, output, 3, 10, frozenset(), LLAMACPP))[-2:] == [(8, 1, 0, 108), (9, 0, 0, 109)]
    # a stop token accepted at draft 2 of 3 with draft 3 matched past it: vLLM counts 3, llama.cpp 2, official 1
    stop = frozenset({105})
    matches = np.zeros((5, 3), dtype=bool)
    matches[3] = [True, True, True]
    counted = {
        name: walk_schedule(matches, output[:6], 3, 10, stop, CONVENTIONS[name])[-1].num_accepted
        for name in ("vllm", "llamacpp", "official")
    }
    assert counted == {"vllm": 3, "llamacpp": 2, "official": 1}


def test_greedy_continuations_go_on_past_their_end_as_the_target_would():
    """generate_greedy_batch(past_end=n): every answer (stopped or cut at max_new_tokens) continues n greedy tokens,
    each equal to the target's own greedy continuation of prompt + answer, stop tokens included."""
    model = tiny_target()
    prompts = [list(p) for p in TEACHER_PROMPTS]
    plain = generate_greedy_batch(model, prompts, max_new_tokens=30, stop_ids=frozenset())
    stop = frozenset({plain[0][6], plain[1][11]})  # tokens the target writes mid-way: two answers stop early
    answers = generate_greedy_batch(model, prompts, max_new_tokens=20, stop_ids=stop)
    extended = generate_greedy_batch(model, prompts, max_new_tokens=20, stop_ids=stop, past_end=4)
    assert sum(a[-1] in stop for a in answers) >= 2
    for prompt, answer, longer in zip(prompts, answers, extended, strict=True):
        assert longer[: len(answer)] == answer and len(longer) == len(answer) + 4
        assert longer[len(answer) :] == greedy_tail(model, prompt, answer, 4)


@pytest.mark.parametrize("max_new", [20, 33])
def test_vllm_live_loop_equals_teacher_with_the_tail_for_every_k(max_new):
    """The live loop under ``vllm`` (K drafts to the end, counted past max_tokens and a stop token) equals the walk
    over one teacher pass with the tail, every K; the last steps differ from llama.cpp's, the outputs do not."""
    target_model = tiny_target()
    draft_model = draft_that_agrees_often(target_model)
    stop = frozenset({2})
    differing = 0
    for prompt in TEACHER_PROMPTS:
        truth = plain_generate(
            TargetModel(target_model), torch.tensor(prompt), max_new_tokens=max_new, stop_ids=stop
        ).output_ids
        sequence = TeacherSequence(prompt, truth, greedy_tail(target_model, prompt, truth, 11))
        table, _ = slot_table(TargetModel(target_model), AutoregressiveProposer(draft_model), sequence, 12)
        for k in (1, 3, 5, 12):
            runs = {
                name: speculative_generate(
                    TargetModel(target_model),
                    AutoregressiveProposer(draft_model),
                    torch.tensor(prompt),
                    k=k,
                    max_new_tokens=max_new,
                    stop_ids=stop,
                    convention=CONVENTIONS[name],
                )
                for name in ("vllm", "llamacpp")
            }
            live = runs["vllm"]
            assert live.output_ids == runs["llamacpp"].output_ids == truth
            walked = walk_schedule(table.matches[:, :k], truth, k, max_new, stop, VLLM)
            assert _strip(walked) == _strip(live.steps), (k, prompt)
            assert live.tail_ids == sampled_past_end(walked, sequence.tail_ids, len(truth))
            rows = token_rows(table, walked, truth)
            # past a step's first miss a chain drafts on from its own guess in the live loop, from the truth here
            assert [(r.position, r.draft_token) for r in rows if r.accepted] == [
                (r.position, r.draft_token) for r in live.tokens if r.accepted and r.position < len(truth)
            ]
            differing += _strip(live.steps) != _strip(runs["llamacpp"].steps)
            assert all(s.num_drafted == k for s in live.steps)
    assert differing >= 4  # the conventions part on the last steps of most requests


def test_vllm_dflash_block_equals_live_to_the_end():
    target_model = tiny_target()
    draft = tiny_dflash(target_model, block_size=6)
    for prompt in TEACHER_PROMPTS:
        target = TargetModel(target_model, draft.hidden_state_indices)
        truth = plain_generate(target, torch.tensor(prompt), max_new_tokens=30).output_ids
        for k in (5, 3):
            sequence = TeacherSequence(prompt, truth, greedy_tail(target_model, prompt, truth, k - 1))
            table, _ = slot_table(
                target, DFlashProposer(draft, target), sequence, k, max_new_tokens=30, convention=VLLM
            )
            live = speculative_generate(
                target, DFlashProposer(draft, target), torch.tensor(prompt), k=k, max_new_tokens=30, convention=VLLM
            )
            assert live.output_ids == truth
            assert _strip(walk_schedule(table.matches, truth, k, 30, frozenset(), VLLM)) == _strip(live.steps)


PROMPTS = [
    [5, 17, 42, 8, 9, 5, 17, 42, 8, 9, 5, 17],
    [11, 12, 13, 11, 12],
    [60, 61, 62, 63, 64, 65, 66, 67],
    [5, 17, 42, 8, 9, 5, 17, 42, 8, 9, 5, 17],
]


def test_suffix_global_tree_keeps_what_the_last_step_sampled_past_the_end():
    """vLLM adds every sampled token to the suffix cache before the output is cut, so the next request's global
    tree holds the last step's tokens past max_tokens: the live loop (its tail) and the teacher (the tail up to what
    the walk's last step sampled) hand the proposer the same response, request after request."""
    target_model = tiny_target()
    max_new, k = 24, 8
    settings = SuffixSettings(max_spec_factor=2.0, min_token_prob=0.0)
    live_proposer, teacher_proposer = SuffixProposer(settings, VOCAB), SuffixProposer(settings, VOCAB)
    past_end = 0
    for prompt in PROMPTS:
        live = speculative_generate(
            TargetModel(target_model), live_proposer, torch.tensor(prompt), k=k, max_new_tokens=max_new, convention=VLLM
        )
        live_proposer.finish_request(prompt, live.output_ids + live.tail_ids)
        sequence = TeacherSequence(prompt, live.output_ids, greedy_tail(target_model, prompt, live.output_ids, k - 1))
        table, _ = slot_table(TargetModel(target_model), teacher_proposer, sequence, k)
        walked = walk_schedule(table.matches, live.output_ids, k, max_new, frozenset(), VLLM, table.drafted)
        assert _strip(walked) == _strip(live.steps), prompt
        teacher_proposer.finish_request(
            prompt, live.output_ids + sampled_past_end(walked, sequence.tail_ids, len(live.output_ids))
        )
        past_end += len(live.tail_ids)
    assert past_end > 0  # some request's last step sampled past max_tokens
