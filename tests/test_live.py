"""The live loop is lossless: at T=0 its output equals the target's own greedy decoding, token for token."""

import copy

import pytest
import torch

from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from tiny_models import tiny_dflash, tiny_target

PROMPTS = [[5, 17, 42, 8, 9], [11, 12], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]


def _greedy(model, prompt, max_new=24):
    return plain_generate(TargetModel(model), torch.tensor(prompt), max_new_tokens=max_new).output_ids


@pytest.mark.parametrize("k", [1, 3, 5])
def test_identical_autoregressive_draft_accepts_everything(k):
    target_model = tiny_target()
    draft = AutoregressiveProposer(copy.deepcopy(target_model))
    for prompt in PROMPTS:
        result = speculative_generate(TargetModel(target_model), draft, torch.tensor(prompt), k=k, max_new_tokens=24)
        assert result.output_ids == _greedy(target_model, prompt)
        drafted = sum(s.num_drafted for s in result.steps)
        assert drafted > 0
        assert sum(s.num_accepted for s in result.steps) == drafted
        assert all(row.accepted for row in result.tokens)


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_random_autoregressive_draft_is_lossless(k):
    target_model = tiny_target()
    draft = AutoregressiveProposer(tiny_target(seed=5))
    rejected_any = False
    for prompt in PROMPTS:
        result = speculative_generate(TargetModel(target_model), draft, torch.tensor(prompt), k=k, max_new_tokens=24)
        assert result.output_ids == _greedy(target_model, prompt)
        assert len(result.output_ids) == 24
        rejected_any |= any(s.num_accepted < s.num_drafted for s in result.steps)
    assert rejected_any


@pytest.mark.parametrize("k", [1, 3, 5])
def test_random_dflash_draft_is_lossless(k):
    target_model = tiny_target()
    target = TargetModel(target_model)
    draft = tiny_dflash(target_model)
    target.hidden_state_indices = draft.hidden_state_indices
    proposer = DFlashProposer(draft, target)
    for prompt in PROMPTS:
        result = speculative_generate(target, proposer, torch.tensor(prompt), k=k, max_new_tokens=24)
        assert result.output_ids == _greedy(target_model, prompt)
        assert all(s.num_drafted <= k for s in result.steps)


def test_stop_token_ends_generation_like_plain_decoding():
    target_model = tiny_target()
    reference = _greedy(target_model, PROMPTS[0], max_new=30)
    stop = frozenset({reference[9]})  # a token the target emits mid-way
    plain = plain_generate(TargetModel(target_model), torch.tensor(PROMPTS[0]), max_new_tokens=30, stop_ids=stop)
    spec = speculative_generate(
        TargetModel(target_model),
        AutoregressiveProposer(copy.deepcopy(target_model)),
        torch.tensor(PROMPTS[0]),
        k=4,
        max_new_tokens=30,
        stop_ids=stop,
    )
    assert spec.output_ids == plain.output_ids
    assert spec.output_ids[-1] in stop and spec.stop_reason == "stop_token"


def test_token_records_describe_each_drafted_token():
    target_model = tiny_target()
    result = speculative_generate(
        TargetModel(target_model),
        AutoregressiveProposer(tiny_target(seed=5)),
        torch.tensor(PROMPTS[0]),
        k=3,
        max_new_tokens=16,
    )
    assert len(result.tokens) == sum(s.num_drafted for s in result.steps)
    for row in result.tokens:
        assert 0.0 <= row.target_prob_of_draft <= 1.0
        assert row.kl_target_draft >= 0.0 and 0.0 <= row.total_variation <= 1.0
        assert (row.draft_token == row.target_token) == (row.target_rank_in_draft == 0) or not row.accepted
        assert len(row.draft_topk_ids) == 5 and row.draft_topk_ids[0] == row.draft_token


def test_block_pass_equals_the_live_drafter_for_every_anchor():
    """engine.blocks drafts every anchor in one masked pass; each equals the live proposer's own block."""
    from dflash_doctor.engine.blocks import context_kv_for, draft_block_hidden

    target_model = tiny_target()
    draft = tiny_dflash(target_model, block_size=5)
    sequence = torch.tensor([5, 17, 42, 8, 9, 30, 31, 2, 44, 45, 46])
    with torch.no_grad():
        hidden = target_model(sequence[None], output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in draft.hidden_state_indices], dim=-1)  # [1, T, F]
        anchors = torch.tensor([[3, 6, 8]])
        block_hidden = draft_block_hidden(
            draft,
            target_model.get_input_embeddings().weight,
            sequence[None],
            context_kv_for(draft, features),
            anchors,
            torch.ones_like(anchors, dtype=torch.bool),
            5,
        )
        batched = target_model.lm_head(block_hidden[0, :, 1:])  # [A, 4, V]
    for i, anchor in enumerate(anchors[0].tolist()):
        target = TargetModel(target_model, draft.hidden_state_indices)
        proposer = DFlashProposer(draft, target)
        proposer.start(sequence[:anchor], features[0, :anchor])
        live = proposer.propose(int(sequence[anchor]), 4, 4)
        torch.testing.assert_close(live.logits, batched[i], rtol=1e-4, atol=1e-4)


def test_layer_id_l_feeds_hidden_states_l_plus_one():
    """A draft tapping layer id 2 must receive hidden_states[3]: record what the draft's fc sees."""
    target_model = tiny_target()
    draft = tiny_dflash(target_model, layer_ids=(2,))
    assert draft.hidden_state_indices == (3,)
    target = TargetModel(target_model, draft.hidden_state_indices)
    prompt = torch.tensor([5, 17, 42, 8])
    seen = []
    handle = draft.fc.register_forward_hook(lambda module, args, out: seen.append(args[0].detach().clone()))
    proposer = DFlashProposer(draft, target)
    proposer.start(prompt, target.forward(prompt).features)
    handle.remove()
    with torch.no_grad():
        states = target_model(prompt[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(seen[0][0], states[3][0])
    assert not torch.allclose(seen[0][0], states[2][0])
