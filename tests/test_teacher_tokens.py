"""Teacher-forced replay with ``full_anchors``: every slot only for the anchors the schedule drafts from,
matched runs for the rest. The sweep's steps and the tokens table must be those of a replay that
evaluates every slot of every anchor, and the tokens rows the live loop's."""

import math

import numpy as np
import pytest
import torch

from dflash_doctor.engine import teacher
from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, token_rows, walk_schedule
from tiny_models import TEACHER_PROMPTS, draft_that_agrees_often, tiny_dflash, tiny_target

MAX_NEW = 30
K = 5
FLOAT_COLUMNS = (
    "target_prob_of_draft",
    "draft_prob_of_target",
    "kl_target_draft",
    "total_variation",
    "target_entropy",
    "target_top1_margin",
)
EXACT_COLUMNS = (
    "step",
    "position",
    "offset",
    "draft_token",
    "target_token",
    "accepted",
    "target_rank_in_draft",
    "draft_topk_ids",
    "target_topk_ids",
)


def _pair(kind):
    """(target model, proposer factory) whose drafts are often accepted, so runs are long and anchors skipped."""
    target_model = tiny_target()
    if kind == "dflash":
        with torch.no_grad():
            target_model.lm_head.weight[75] *= 2.0  # the untrained draft leans to token 75: the target often agrees
        draft = tiny_dflash(target_model, block_size=K + 1)
        return target_model, lambda target: DFlashProposer(draft, target)
    draft = draft_that_agrees_often(target_model)
    return target_model, lambda target: AutoregressiveProposer(draft)


@pytest.mark.parametrize("kind", ["dflash", "autoregressive"])
def test_schedule_anchors_get_every_anchors_rows_and_the_live_loops(kind, monkeypatch):
    monkeypatch.setattr(teacher, "ANCHOR_CHUNK", 4)  # several draft passes: anchors are chosen pass by pass
    target_model, make = _pair(kind)
    skipped = lazy_runs_past_slot_1 = 0
    for prompt in TEACHER_PROMPTS:
        target = TargetModel(target_model)
        truth = plain_generate(target, torch.tensor(prompt), max_new_tokens=MAX_NEW).output_ids
        sequence = TeacherSequence(prompt, truth)

        def drafted_from(matches):
            return [s.position - 1 for s in walk_schedule(matches, truth, K, MAX_NEW, frozenset())]

        chosen, _ = slot_table(target, make(target), sequence, K, full_anchors=drafted_from)
        every, _ = slot_table(target, make(target), sequence, K)
        # the matched runs are every slot's matches up to the first miss: the same steps at every K
        assert np.array_equal(chosen.matches, np.cumprod(every.matches, axis=1).astype(bool))
        for k in range(1, K + 1):
            assert walk_schedule(chosen.matches[:, :k], truth, k, MAX_NEW, frozenset()) == walk_schedule(
                every.matches[:, :k], truth, k, MAX_NEW, frozenset()
            )
        steps = walk_schedule(chosen.matches, truth, K, MAX_NEW, frozenset())
        anchors = {s.position - 1 for s in steps}
        assert set(chosen.divergence_start) == anchors
        assert (chosen.guesses[sorted(anchors)] >= 0).all()  # every slot of a recorded anchor has its guess
        skipped += len(every.divergence_start) - len(anchors)
        off_schedule = [a for a in range(len(chosen.matches)) if a not in anchors]
        lazy_runs_past_slot_1 += int(chosen.matches[off_schedule, 0].sum())

        rows = token_rows(chosen, steps, truth)
        _assert_same_rows(rows, token_rows(every, steps, truth))
        live = speculative_generate(target, make(target), torch.tensor(prompt), k=K, max_new_tokens=MAX_NEW)
        assert live.output_ids == truth and len(rows) == len(live.tokens)
        accepted = {s.step: s.num_accepted for s in live.steps}
        on_true_prefix = [(row, twin) for row, twin in zip(rows, live.tokens) if row.offset <= accepted[row.step] + 1]
        _assert_same_rows(*zip(*on_true_prefix))  # past the first rejection the live target scores the draft's tokens
    assert skipped > 0 and lazy_runs_past_slot_1 > 0  # anchors were skipped, and skipped ones had runs to follow


def _assert_same_rows(rows, others):
    assert len(rows) == len(others)
    for row, other in zip(rows, others):
        for name in EXACT_COLUMNS:
            assert getattr(row, name) == getattr(other, name), name
        for name in FLOAT_COLUMNS:
            assert math.isclose(getattr(row, name), getattr(other, name), rel_tol=1e-4, abs_tol=1e-6), name


def test_full_anchors_refuse_sampling():
    target_model, make = _pair("autoregressive")
    target = TargetModel(target_model)
    with pytest.raises(ValueError, match="T = 0"):
        slot_table(
            target, make(target), TeacherSequence([5, 6], [7, 8, 9]), K, temperature=1.0, full_anchors=lambda m: ()
        )
