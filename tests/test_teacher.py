"""Teacher-forced replay reproduces the live loop exactly at T = 0, for every K, from one pass."""

import numpy as np
import pytest
import torch

from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, token_rows, walk_schedule
from tiny_models import TEACHER_PROMPTS, draft_that_agrees_often, tiny_dflash, tiny_target

STEP_KEYS = ("position", "num_drafted", "num_accepted", "bonus_token")


def _strip(steps):
    return [tuple(getattr(s, key) for key in STEP_KEYS) for s in steps]


@pytest.mark.parametrize("max_new", [20, 33])
def test_autoregressive_every_k_from_one_pass_equals_live(max_new):
    target_model = tiny_target()
    draft_model = draft_that_agrees_often(target_model)
    stop = frozenset({2})
    accepted_counts = set()
    for prompt in TEACHER_PROMPTS:
        target = TargetModel(target_model)
        truth = plain_generate(target, torch.tensor(prompt), max_new_tokens=max_new, stop_ids=stop).output_ids
        table, _ = slot_table(target, AutoregressiveProposer(draft_model), TeacherSequence(prompt, truth), 12)
        for k in (1, 2, 3, 5, 8, 12):
            live = speculative_generate(
                TargetModel(target_model),
                AutoregressiveProposer(draft_model),
                torch.tensor(prompt),
                k=k,
                max_new_tokens=max_new,
                stop_ids=stop,
            )
            assert live.output_ids == truth
            walked = walk_schedule(table.matches[:, :k], truth, k, max_new, stop)
            assert _strip(walked) == _strip(live.steps), f"k={k} prompt={prompt}"
            accepted_counts.update(s.num_accepted for s in live.steps)
            rows = token_rows(table, walked, truth)
            live_accepted = [(r.position, r.draft_token) for r in live.tokens if r.accepted]
            assert [(r.position, r.draft_token) for r in rows if r.accepted] == live_accepted
    assert {0, 1, 2, 8} <= accepted_counts  # the draft both fails early and runs long: a demanding schedule


def test_dflash_full_block_equals_live():
    target_model = tiny_target()
    draft = tiny_dflash(target_model, block_size=6)
    for prompt in TEACHER_PROMPTS:
        target = TargetModel(target_model, draft.hidden_state_indices)
        truth = plain_generate(target, torch.tensor(prompt), max_new_tokens=30).output_ids
        for k in (5, 3):  # the live loop drafts blocks of K + 1; one teacher pass per block length
            table, _ = slot_table(target, DFlashProposer(draft, target), TeacherSequence(prompt, truth), k)
            live = speculative_generate(
                target, DFlashProposer(draft, target), torch.tensor(prompt), k=k, max_new_tokens=30
            )
            assert live.output_ids == truth
            assert _strip(walk_schedule(table.matches, truth, k, 30, frozenset())) == _strip(live.steps)


def test_walk_schedule_on_a_hand_made_table():
    # output: 10 tokens; matches[i, j-1]: does the guess for output[i + j] match?
    matches = np.zeros((9, 3), dtype=bool)
    matches[0] = [True, True, False]  # anchor 0: accept 2, bonus output[3]
    matches[3] = [True, True, True]  # anchor 3: accept 3, bonus output[7]
    matches[7] = [True, True, True]  # anchor 7: k capped to max_new - 8 - 1 = 1
    steps = walk_schedule(matches, list(range(100, 110)), 3, 10, frozenset())
    assert [(s.position, s.num_drafted, s.num_accepted, s.bonus_token) for s in steps] == [
        (1, 3, 2, 103),
        (4, 3, 3, 107),
        (8, 1, 1, 109),
    ]
