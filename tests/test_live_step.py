"""The live loop's lossless core, one step at a time (:func:`speculative_step`): what it commits is the
target's greedy continuation, a draft equal to that continuation is accepted whole, and a stop token or the
budget inside the accepted run ends the output there while the caches keep exactly the committed tokens."""

from __future__ import annotations

import copy

import torch

from dflash_doctor.engine.live import StepClock, plain_generate, speculative_step
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.target import TargetModel
from tiny_models import draft_that_agrees_often, tiny_target

PROMPT = [5, 17, 42, 8, 9]


def _started(draft_model):
    """A target prefilled on PROMPT, an autoregressive proposer started on it, and the first output token."""
    target_model = tiny_target()
    target = TargetModel(target_model)
    proposer = AutoregressiveProposer(draft_model(target_model))
    prompt = torch.tensor(PROMPT)
    prefill = target.forward(prompt, taps=(), logits_from=len(PROMPT) - 1)
    proposer.start(prompt, prefill.features)
    greedy = plain_generate(TargetModel(target_model), prompt, max_new_tokens=20).output_ids
    assert int(prefill.logits[-1].argmax()) == greedy[0]
    return target, proposer, greedy


def _step(target, proposer, last, k, room=20, stop_ids=frozenset()):
    return speculative_step(
        target,
        proposer,
        last,
        k_step=k,
        block_k=k,
        room=room,
        temperature=0.0,
        stop_ids=stop_ids,
        generator=None,
        clock=StepClock(torch.device("cpu")),
    )


@torch.inference_mode()
def test_steps_commit_the_targets_greedy_tokens_through_rejections():
    target, proposer, greedy = _started(draft_that_agrees_often)
    output, rejected = [greedy[0]], 0
    while len(output) < 16:
        step = _step(target, proposer, output[-1], 4)
        rejected += step.run < len(step.drafted)
        output += step.emitted
        assert target.cache_length == len(PROMPT) + len(output) - 1  # everything committed but the new last token
    assert output == greedy[: len(output)]
    assert rejected > 0


@torch.inference_mode()
def test_a_draft_that_is_the_targets_own_continuation_is_accepted_whole():
    target, proposer, greedy = _started(copy.deepcopy)
    step = _step(target, proposer, greedy[0], 5)
    assert step.drafted == greedy[1:6] and step.run == 5 and step.accepted == greedy[1:6]
    assert step.bonus_token == step.next_token == greedy[6]
    assert step.emitted == greedy[1:7] and step.past_output == [] and step.stop_at is None
    assert step.verify_logits.shape[0] == 6


@torch.inference_mode()
def test_a_stop_token_inside_the_accepted_run_cuts_the_step_there():
    target, proposer, greedy = _started(copy.deepcopy)
    step = _step(target, proposer, greedy[0], 5, stop_ids=frozenset({greedy[3]}))
    assert step.run == 5  # the acceptance rule knows no stop token: the cut is the step's
    assert step.stop_at == 2 and step.accepted == greedy[1:4] and step.bonus_token == -1
    assert step.emitted == greedy[1:4] and step.past_output == greedy[4:7]
    assert target.cache_length == len(PROMPT) + 4  # the last token and the accepted drafts, the stop token included


@torch.inference_mode()
def test_the_budget_inside_the_accepted_run_ends_the_output_without_a_bonus():
    target, proposer, greedy = _started(copy.deepcopy)
    step = _step(target, proposer, greedy[0], 5, room=2)
    assert step.run == 5 and step.accepted == greedy[1:3] and step.bonus_token == -1 and step.stop_at is None
    assert step.past_output == greedy[3:7]
    assert target.cache_length == len(PROMPT) + 3  # the last token and the two drafts that fit
