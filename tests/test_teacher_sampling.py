"""At T > 0 the teacher's expected tau agrees with the live loop's mean tau over many seeds.

Under sampling a live step's acceptance is random; the teacher-forced replay instead gives, per anchor of
a sampled target trajectory, the probability that each slot is accepted (sum(min(p, q)) for a sampled
draft, p(draft token) for a greedy one) and :func:`_teacher_tau` turns them into tau(K). The live loop is
lossless, so its outputs ARE sampled target trajectories: the teacher reads the very outputs the live runs
produced, at the anchors the live steps started from (a paired comparison: trajectory noise cancels and
only the acceptance draws remain). Averaging over ALL anchors instead is biased for a greedy draft: the
live loop starts steps after rejections, where the last token is never the draft's guess, and acceptance
there is lower (measured: expected 1.187 vs live 1.169 [1.152, 1.185] over 400 seeds).

Tiny-vocabulary models (11 tokens) at T = 1 so that acceptance probabilities are far from 0 and 1. Only
full-K steps are compared (the last steps of a request draft fewer tokens: ``k`` is capped at
``remaining - 1``).
"""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch

from dflash_doctor.engine.live import speculative_generate
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, walk_schedule
from dflash_doctor.stats.metrics import tau_with_ci
from tiny_models import tiny_dflash, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: 10x slower with 2 threads on a busy machine

VOCAB = 11
TEMPERATURE = 1.0
K = 3
MAX_NEW_TOKENS = 16
NUM_SEEDS = 150
PROMPT = [5, 7, 1, 8, 9]


def _perturbed_copy(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """A sampled autoregressive draft that is close to the target but not equal to it."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return draft


class _GreedyRuleView(AutoregressiveProposer):
    """The same draft scored with the greedy-draft rule p(argmax q): the WRONG formula for a sampled draft."""

    def samples_drafts(self, temperature: float) -> bool:
        return False


def _live_runs(target_model, draft_model, make_proposer):
    """(target, proposer, result) of one live run per seed at T > 0."""
    runs = []
    for seed in range(NUM_SEEDS):
        generator = torch.Generator().manual_seed(seed)
        target = TargetModel(target_model, getattr(draft_model, "hidden_state_indices", ()))
        proposer = make_proposer(target, generator)
        result = speculative_generate(
            target,
            proposer,
            torch.tensor(PROMPT),
            k=K,
            max_new_tokens=MAX_NEW_TOKENS,
            temperature=TEMPERATURE,
            generator=generator,
            record_tokens=False,
        )
        assert len(result.output_ids) == MAX_NEW_TOKENS  # no stop ids: every anchor exists
        runs.append((target, proposer, result))
    return runs


def _full_k_steps(result) -> list[dict]:
    return [s for s in result.steps if s.num_drafted == K]


def _live_tau_ci(runs) -> tuple[float, list[float]]:
    rows = [
        {"request_id": str(seed), "class": "c", **vars(s)}
        for seed, (_, _, r) in enumerate(runs)
        for s in _full_k_steps(r)
    ]
    return tau_with_ci(pd.DataFrame(rows))


def _teacher_tau(runs, proposer_for=lambda proposer: proposer) -> float:
    """Expected tau at K over the anchors the live steps started from, each scored on its run's own output:
    1 + mean over anchors of sum_{i<K} P(at least i + 1 accepted), the running product of the slots'
    acceptance probabilities."""
    accept_probs = []
    for target, proposer, result in runs:
        table, _ = slot_table(
            target,
            proposer_for(proposer),
            TeacherSequence(PROMPT, result.output_ids),
            K,
            temperature=TEMPERATURE,
            record_divergence=False,
        )
        accept_probs.append(table.accept_probs[[s.position - 1 for s in _full_k_steps(result)]])
    reach = np.cumprod(np.concatenate(accept_probs), axis=1)
    return float(1.0 + reach[:, :K].sum(axis=1).mean())


@pytest.fixture(scope="module")
def target_model():
    return tiny_target(vocab=VOCAB)


def test_sampled_autoregressive_draft(target_model):
    draft = _perturbed_copy(target_model, scale=0.15)
    runs = _live_runs(
        target_model,
        draft,
        lambda _target, generator: AutoregressiveProposer(draft, temperature=TEMPERATURE, generator=generator),
    )
    live_tau, (low, high) = _live_tau_ci(runs)
    assert 1.2 < live_tau < 1 + 0.9 * K  # neither almost nothing nor almost everything accepted: the test has teeth
    teacher_tau = _teacher_tau(runs)
    assert low <= teacher_tau <= high, f"teacher {teacher_tau:.4f} outside the live CI [{low:.4f}, {high:.4f}]"
    wrong_rule_tau = _teacher_tau(runs, lambda _proposer: _GreedyRuleView(draft))
    assert not low <= wrong_rule_tau <= high, "the comparison cannot tell sum(min(p, q)) from p(argmax q)"


@pytest.fixture(scope="module")
def dflash_runs(target_model):
    draft = tiny_dflash(target_model, block_size=K + 1)
    return _live_runs(target_model, draft, lambda target, _generator: DFlashProposer(draft, target))


def test_greedy_dflash_draft(dflash_runs):
    runs = dflash_runs
    live_tau, (low, high) = _live_tau_ci(runs)
    assert live_tau > 1.05
    teacher_tau = _teacher_tau(runs)
    assert low <= teacher_tau <= high, f"teacher {teacher_tau:.4f} outside the live CI [{low:.4f}, {high:.4f}]"


def test_greedy_draft_walk_on_the_sampled_output_is_the_live_run(dflash_runs):
    """A greedy draft's token is accepted under sampling iff the target's sample equals it, so walking the
    teacher's matches over a live run's own (sampled) output reproduces that run's steps exactly."""
    rejected = 0
    for target, proposer, result in dflash_runs[:40]:
        table, _ = slot_table(target, proposer, TeacherSequence(PROMPT, result.output_ids), K, record_divergence=False)
        walked = walk_schedule(table.matches, result.output_ids, K, MAX_NEW_TOKENS, frozenset())
        keys = ("position", "num_drafted", "num_accepted", "bonus_token")
        assert [tuple(getattr(s, c) for c in keys) for s in walked] == [
            tuple(getattr(s, c) for c in keys) for s in result.steps
        ]
        rejected += sum(s.num_accepted < s.num_drafted for s in result.steps)
    assert rejected > 0
