"""The agreement machinery: simulated serving setups, and a server stand-in that IS the embedded live loop.

The stand-in is honest about what it is: the embedded engine's own live loop, run with the configured or
with a deliberately mis-set draft, produces "engine" step sequences whose cause is known, so the
comparison must reproduce the first exactly and name the second. The real server is test_vllm_real.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_doctor.engine.live import speculative_generate
from dflash_doctor.models.serving_setups import (
    CONFIGURED,
    FIRST_LAYER_CONTEXT_K_NORM,
    ServingSetup,
    serving_setups,
    setup_proposer,
)
from dflash_doctor.serving.agreement import compare_turn, summarize_agreement
from server_turns import LocalStops, engine_turn
from tiny_models import tiny_dflash, tiny_target


def test_causal_flip_makes_each_slot_blind_to_later_slots():
    """Causal in-block attention: slot j's guess cannot depend on how many slots follow; bidirectional can."""
    target_model = tiny_target()
    draft = tiny_dflash(target_model, block_size=6)
    ids = torch.tensor([5, 17, 42, 8, 9, 11, 12, 60, 61, 62])
    anchors = torch.tensor([3, 5])
    results = {}
    for flip in (False, True):
        proposer, target = setup_proposer(draft, target_model, ServingSetup("x", flip_causal=flip))
        target.reset()
        features = target.forward(ids).features
        proposer.prepare_teacher(ids, features)
        results[flip] = (proposer.slot_logits(anchors, 4)[:, :2], proposer.slot_logits(anchors, 2))
    causal_long, causal_short = results[True]
    bidirectional_long, bidirectional_short = results[False]
    assert torch.allclose(causal_long, causal_short, atol=1e-5)
    assert not torch.allclose(bidirectional_long, bidirectional_short, atol=1e-3)


def test_layer_offset_setups_stay_inside_the_target():
    target_model = tiny_target(layers=4)
    draft = tiny_dflash(target_model, layer_ids=(0, 3))
    names = {
        s.name: setup_proposer(draft, target_model, s) for s in serving_setups(draft_causal=False, num_draft_layers=2)
    }
    assert names["target_layer_ids - 1"] is None and names["target_layer_ids + 1"] is None  # 0-1 and 3+1 fall off
    assert names[CONFIGURED] is not None and names["in-block attention causal"] is not None
    assert names[f"in-block attention causal, {FIRST_LAYER_CONTEXT_K_NORM.name}"] is not None


def test_the_context_k_norm_defect_changes_only_later_layers_context_keys():
    """vLLM's fused context-K norm on a kernel without per-row weights: layer 0 as trained, later layers' context
    keys scaled by layer 0's k_norm, block keys untouched; a one-layer draft has nothing to replay."""
    target_model = tiny_target()
    draft = tiny_dflash(target_model, num_layers=2)
    with torch.no_grad():
        draft.layers[1].self_attn.k_norm.weight.mul_(1.5)
    ids = torch.tensor([5, 17, 42, 8, 9, 11])
    proposer, target = setup_proposer(draft, target_model, FIRST_LAYER_CONTEXT_K_NORM)
    target.reset()
    features = target.forward(ids).features[None]
    positions = torch.arange(len(ids))[None]
    with torch.inference_mode():
        trained, served = draft.context_kv(features, positions), proposer.model.context_kv(features, positions)
    assert draft.context_k_norm_layer is None and proposer.model.layers is draft.layers  # a view, the weights shared
    assert torch.equal(trained[0][0], served[0][0]) and all(torch.equal(t[1], s[1]) for t, s in zip(trained, served))
    assert torch.allclose(served[1][0] * 1.5, trained[1][0], atol=1e-5)  # layer 1's keys lost its own 1.5x scale
    assert all(not s.first_layer_context_k_norm for s in serving_setups(draft_causal=False, num_draft_layers=1))


@pytest.fixture(scope="module")
def demo_pair():
    """The real SmolLM2-135M-Instruct and the shipped DFlash
    draft (its acceptance is high enough to tell setups apart)."""
    from transformers import AutoTokenizer

    from dflash_doctor.models.loading import (
        DEMO_DRAFT_DIR,
        demo_target_path,
        load_causal_lm,
        load_dflash_draft,
        resolve_model_dir,
    )
    from dflash_doctor.models.pair import stop_ids_of

    target_dir = resolve_model_dir(str(demo_target_path()))
    model = load_causal_lm(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    draft = load_dflash_draft(DEMO_DRAFT_DIR)
    return model, tokenizer, draft, stop_ids_of(model, tokenizer)


@pytest.mark.integration
@pytest.mark.parametrize(
    "served", [CONFIGURED, "target_layer_ids + 1", f"target_layer_ids + 1, {FIRST_LAYER_CONTEXT_K_NORM.name}"]
)
def test_a_stand_in_server_is_reproduced_step_by_step_and_its_setup_named(demo_pair, served):
    from dflash_doctor.inputs.workloads import encode_turn

    model, tokenizer, draft, stop_ids = demo_pair
    setups = serving_setups(draft_causal=False, num_draft_layers=draft.config.num_hidden_layers)
    proposers = {s.name: setup_proposer(draft, model, s) for s in setups}
    served_proposer, served_target = proposers[served]
    k, max_new = 15, 48
    turns, comparisons = [], []
    questions = ("What is 12 times 7? Explain step by step.", "Write a Python function that reverses a string.")
    for index, question in enumerate(questions):
        prompt = encode_turn(tokenizer, [{"role": "user", "content": question}])
        live = speculative_generate(
            served_target, served_proposer, torch.tensor(prompt), k=k, max_new_tokens=max_new, stop_ids=stop_ids
        )
        turn = engine_turn(f"r{index}", prompt, live, k)
        turns.append(turn)
        comparisons.append(compare_turn(LocalStops(stop_ids), setups, proposers, turn, prompt, k, max_new, 0.0))
    summary = summarize_agreement(comparisons, turns, engine_k=k, block_size=16)
    assert summary.outputs.num_identical == 2 and summary.prompts.num_identical == 2
    assert summary.per_step[served].share >= 0.95, summary.per_step
    assert summary.per_step[served].embedded_accepted > 0  # not a trivial all-zero agreement
    if served != CONFIGURED:
        stats = summary.per_step[served]
        assert stats.num_siding >= 0.9 * stats.num_telling, stats
        assert summary.per_step[CONFIGURED].share <= stats.share
        if (
            "target_layer_ids" in served
        ):  # an offset changes many steps; the norm defect alone changes few on this draft
            assert stats.num_telling >= 5 and summary.per_step[CONFIGURED].share < stats.share, stats


def test_an_ngram_server_is_reproduced_step_by_step_with_one_setup():
    """A speculator without weights has one serving setup, its settings: a stand-in server running vLLM's
    prompt lookup (the embedded live loop with the n-gram proposer) and listing its steps as vLLM does, the
    drafted ones only, is reproduced step for step by the teacher-forced replay of its own answer (the
    undrafted steps between them placed by the embedded rule), with no margins (a point mass has none)."""
    from dflash_doctor.engine.proposers.ngram import NgramProposer, NgramSettings
    from dflash_doctor.engine.target import TargetModel

    target_model = tiny_target(seed=1)  # a random target repeats itself rarely: lookups of one token find some of it
    target = TargetModel(target_model)
    proposer = NgramProposer(NgramSettings.resolve(1, 3, max_model_len=2048), target_model.config.vocab_size)
    prompt = [5, 17, 42, 8, 9, 11, 5, 17, 42]
    k, max_new = 4, 80
    live = speculative_generate(
        target, proposer, torch.tensor(prompt), k=k, max_new_tokens=max_new, stop_ids=frozenset()
    )
    assert sum(s.num_accepted for s in live.steps) > 0  # the lookup found its text again: not a trivial agreement
    drafted = [s for s in live.steps if s.num_drafted > 0]
    assert 0 < len(drafted) < len(live.steps)  # undrafted steps in between, as vLLM leaves out of its arrays
    turn = engine_turn("r0", prompt, dataclasses.replace(live, steps=drafted), k)
    assert all(s.position == -1 for s in turn.steps)  # the listed steps cover fewer tokens than the output: not placed
    comparison = compare_turn(
        LocalStops(frozenset()),
        [ServingSetup(CONFIGURED)],
        {CONFIGURED: (proposer, target)},
        turn,
        prompt,
        k,
        max_new,
        0.0,
    )
    summary = summarize_agreement([comparison], [turn], engine_k=k, block_size=None)
    assert summary.outputs.num_identical == 1
    assert summary.per_step[CONFIGURED].num_steps == len(drafted)
    assert summary.per_step[CONFIGURED].share == 1.0 and summary.per_step[CONFIGURED].embedded_accepted > 0
    # tau as vLLM defines it, over the steps that drafted, on both sides
    assert summary.tau.overall.embedded_tau == pytest.approx(summary.tau.overall.engine_tau)
    assert comparison.deciding_margins == {}
