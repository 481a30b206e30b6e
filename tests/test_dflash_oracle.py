"""Our DFlash drafts against the official implementation (PyPI ``dflash`` 0.1.0, tests/official_dflash.py).

For every variant (full attention, a sliding-window layer, all-causal, the scaling keys, DFlash 2) a
tiny random official module is saved as a z-lab checkpoint and loaded by our loader; then:

* the draft hidden states and logits equal the official module's (fp32);
* our live loop under the ``official`` end-of-request convention gives the official ``dflash_generate``'s
  greedy outputs and per-step acceptance lengths, request by request, with and without a stop token
  that falls inside an accepted run of drafts;
* under the ``vllm`` convention the outputs are the same and every step drafted with a full block agrees;
* under sampling our draft distribution is the official one (probabilistic drafts) and DFlash 2's walk
  returns the official candidate distribution.

The target's lm_head favours a few tokens so that random drafts are accepted often enough for the
acceptance lengths to vary (a test where every step accepts nothing would prove little).
"""

from __future__ import annotations

import pytest
import torch

from official_dflash import VARIANTS, official, official_config, official_generate, official_model, save_official
from tiny_models import tiny_target, torch_threads

from dflash_doctor.engine.schedule import CONVENTIONS
from dflash_doctor.engine.live import speculative_generate
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.models.loading import load_dflash_draft

PROMPTS = [[1, 17, 42, 8, 9, 30, 31, 44, 45, 46, 50, 12], [1, 60, 61, 5, 22]]
BLOCK = 6
MAX_NEW = 30


@pytest.fixture(scope="module")
def target():
    with torch_threads(1):
        model = tiny_target()
        with torch.no_grad():
            model.lm_head.weight[5:8] *= 6.0  # a few favoured tokens: drafts get accepted, lengths vary
        yield model


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, target, tmp_path_factory):
    official_draft = official_model(official_config(target, request.param, block_size=BLOCK))
    ours = load_dflash_draft(save_official(official_draft, tmp_path_factory.mktemp(request.param)))
    return request.param, official_draft, ours


def _ours(target, draft, prompt, convention, stop_ids=(), temperature=0.0, **proposer_args):
    wrapped = TargetModel(target, draft.hidden_state_indices)
    proposer = DFlashProposer(draft, wrapped, temperature=temperature, **proposer_args)
    result = speculative_generate(
        wrapped,
        proposer,
        torch.tensor(prompt),
        k=BLOCK - 1,
        max_new_tokens=MAX_NEW,
        stop_ids=frozenset(stop_ids),
        convention=CONVENTIONS[convention],
    )
    return result.output_ids, [step.num_accepted + 1 for step in result.steps], result.steps


@torch.no_grad()
def _official_block(official_draft, target, prompt):
    """Official draft hidden states and logits for the block after ``prompt`` (no cache, one pass)."""
    hidden_states = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    features = official.extract_context_feature(hidden_states, official_draft.target_layer_ids)
    block = torch.tensor([[prompt[-1]] + [official_draft.mask_token_id] * (BLOCK - 1)])
    scale = float(official._draft_value(official_draft.config, "input_embedding_scale", 1.0))
    noise = official._raw_input_embeddings(target, block, scale)
    positions = torch.arange(len(prompt) + BLOCK)[None]
    hidden = official_draft(target_hidden=features, noise_embedding=noise, position_ids=positions)
    return features, block, hidden, official_draft.compute_logits(hidden, target.lm_head)


@torch.no_grad()
def test_draft_logits_equal_official(pair, target):
    variant, official_draft, ours = pair
    for prompt in PROMPTS:
        features, block, official_hidden, official_logits = _official_block(official_draft, target, prompt)
        proposer = DFlashProposer(ours, TargetModel(target, ours.hidden_state_indices))
        proposer.start(torch.tensor(prompt), features[0])
        positions = torch.arange(len(prompt), len(prompt) + BLOCK)[None]
        embeds = ours.embed_block(target.get_input_embeddings().weight, block[0])[None]
        hidden = ours(embeds, positions, proposer.ctx_kv, torch.arange(len(prompt))[None])
        torch.testing.assert_close(hidden, official_hidden, rtol=0, atol=2e-5)
        torch.testing.assert_close(ours.compute_logits(hidden, target.lm_head), official_logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("variant", ["sliding", "causal", "scaled"])
def test_variant_keys_change_the_draft(variant, target, tmp_path):
    """Each variant's keys matter: the same weights read as a plain full-attention draft give other logits
    (so the equality above is not an accident of keys that do nothing on these inputs)."""
    official_draft = official_model(official_config(target, variant, block_size=BLOCK))
    ours = load_dflash_draft(save_official(official_draft, tmp_path))
    cfg = ours.config
    cfg.is_causal, cfg.layer_types = None, ["full_attention"] * cfg.num_hidden_layers
    cfg.input_embedding_scale, cfg.output_multiplier, cfg.final_logit_softcapping = 1.0, 1.0, None
    prompt = PROMPTS[0]
    features, block, _, official_logits = _official_block(official_draft, target, prompt)
    with torch.no_grad():
        proposer = DFlashProposer(ours, TargetModel(target, ours.hidden_state_indices))
        proposer.start(torch.tensor(prompt), features[0])
        embeds = ours.embed_block(target.get_input_embeddings().weight, block[0])[None]
        hidden = ours(
            embeds,
            torch.arange(len(prompt), len(prompt) + BLOCK)[None],
            proposer.ctx_kv,
            torch.arange(len(prompt))[None],
        )
        plain = ours.compute_logits(hidden, target.lm_head)
    assert (plain - official_logits).abs().max() > 1e-2


def _stop_inside_a_run(outputs: list[int], lengths: list[int]) -> int | None:
    """A token that the official loop produced as a non-final token of a multi-token step."""
    position = 1
    for length in lengths:
        if length >= 3:
            return outputs[position]  # the step's first accepted draft; the run continues after it
        position += length
    return None


def test_greedy_outputs_and_acceptance_equal_official(pair, target):
    variant, official_draft, ours = pair
    longest = 0
    stops_tested = 0
    for prompt in PROMPTS:
        official_out, official_lengths = official_generate(
            official_draft, target, prompt, max_new_tokens=MAX_NEW, stop_ids=None
        )
        out, lengths, _ = _ours(target, ours, prompt, "official")
        assert out == official_out
        assert lengths == official_lengths
        longest = max(longest, max(lengths))
        stop = _stop_inside_a_run(official_out, official_lengths)
        if stop is None or stop in official_out[:1]:
            continue
        official_out, official_lengths = official_generate(
            official_draft, target, prompt, max_new_tokens=MAX_NEW, stop_ids=[stop]
        )
        out, lengths, _ = _ours(target, ours, prompt, "official", stop_ids=[stop])
        assert (out, lengths) == (official_out, official_lengths)
        stops_tested += 1
    assert longest >= 2, "no step accepted a draft: the comparison would be vacuous"
    assert stops_tested or variant in ("sliding", "dflash2"), "no stop token fell inside an accepted run"


def test_vllm_convention_differs_only_at_the_end(pair, target):
    """Under vLLM's convention outputs are equal and every step that drafted a full block agrees."""
    variant, official_draft, ours = pair
    compared = 0
    for prompt in PROMPTS:
        official_out, official_lengths = official_generate(
            official_draft, target, prompt, max_new_tokens=MAX_NEW, stop_ids=None
        )
        out, lengths, steps = _ours(target, ours, prompt, "vllm")
        assert out == official_out
        for step, length, official_length in zip(steps, lengths, official_lengths):
            if MAX_NEW - step.position >= BLOCK - 1:  # the official block was full too
                assert length == official_length
                compared += 1
    assert compared >= 10


@torch.no_grad()
def test_probabilistic_drafts_use_the_official_distribution(pair, target):
    """Under sampling, drafts come from the official draft distribution (vLLM ``probabilistic``); ``greedy``
    keeps one-hot drafts (``probs`` None) whatever the temperature."""
    variant, official_draft, ours = pair
    temperature = 0.7
    prompt = PROMPTS[0]
    features, block, official_hidden, official_logits = _official_block(official_draft, target, prompt)
    wrapped = TargetModel(target, ours.hidden_state_indices)
    proposer = DFlashProposer(
        ours,
        wrapped,
        temperature=temperature,
        draft_sample_method="probabilistic",
        generator=torch.Generator().manual_seed(0),
    )
    proposer.start(torch.tensor(prompt), features[0])
    proposal = proposer.propose(prompt[-1], BLOCK - 1, BLOCK - 1)
    slots = official_hidden[:, 1:]
    if variant == "dflash2":
        torch.manual_seed(0)
        tokens, indices, q = official_draft.propose(slots, block[:, 0], target.lm_head, temperature)
        # the official q is over each slot's candidates given the official walk's own picks; re-walk ours on them
        # slot 1's candidates and distribution (its predecessor is the anchor in both walks)
        first = torch.zeros_like(proposal.probs[0]).scatter(-1, indices[0, 0], q[0, 0])
        torch.testing.assert_close(proposal.probs[0], first, rtol=0, atol=1e-5)
    else:
        expected = official._sampling_probs(official_logits[:, 1:], temperature)[0]
        torch.testing.assert_close(proposal.probs, expected, rtol=0, atol=1e-5)
    assert proposer.samples_drafts(temperature)
    greedy = DFlashProposer(ours, wrapped, temperature=temperature)
    greedy.start(torch.tensor(prompt), features[0])
    assert greedy.propose(prompt[-1], BLOCK - 1, BLOCK - 1).probs is None and not greedy.samples_drafts(temperature)


@torch.no_grad()
def test_dflash2_greedy_walk_equals_official(target, tmp_path):
    official_draft = official_model(official_config(target, "dflash2", block_size=BLOCK), seed=4)
    ours = load_dflash_draft(save_official(official_draft, tmp_path))
    for prompt in PROMPTS:
        features, block, official_hidden, _ = _official_block(official_draft, target, prompt)
        official_tokens, _, _ = official_draft.propose(official_hidden[:, 1:], block[:, 0], target.lm_head, 0.0)
        proposer = DFlashProposer(ours, TargetModel(target, ours.hidden_state_indices))
        proposer.start(torch.tensor(prompt), features[0])
        assert proposer.propose(prompt[-1], BLOCK - 1, BLOCK - 1).tokens.tolist() == official_tokens[0].tolist()


def test_probabilistic_drafts_run_through_rejection_sampling(pair, target):
    """At T > 0 a probabilistic proposer hands its draft distribution to rejection sampling: every drafted
    token has probability under it, and a seeded run is reproducible."""
    variant, _, ours = pair
    runs = []
    for _ in range(2):
        wrapped = TargetModel(target, ours.hidden_state_indices)
        generator = torch.Generator().manual_seed(7)
        proposer = DFlashProposer(
            ours, wrapped, temperature=0.8, draft_sample_method="probabilistic", generator=generator
        )
        drafted = []
        original = proposer.propose

        def spy(*args, **kwargs):
            proposal = original(*args, **kwargs)
            drafted.append(
                proposal.probs.gather(-1, proposal.tokens[:, None]).min().item() if len(proposal.tokens) else 1.0
            )
            return proposal

        proposer.propose = spy
        result = speculative_generate(
            wrapped,
            proposer,
            torch.tensor(PROMPTS[0]),
            k=BLOCK - 1,
            max_new_tokens=20,
            temperature=0.8,
            generator=generator,
        )
        assert min(drafted) > 0
        runs.append(result.output_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 20


# ----------------------------------------------------------------------------------------------------
# Scaled RoPE: the official module rotates with transformers' Qwen3RotaryEmbedding; ours takes the scaled
# types from transformers' ROPE_INIT_FUNCTIONS and keeps its own proven path for plain RoPE.

ORIGINAL_LENGTH = 16  # short enough that a prompt plus a block passes it
ROPE_SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_LENGTH},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [2.0, 4.0, 8.0, 16.0],
        "original_max_position_embeddings": ORIGINAL_LENGTH,
    },
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL_LENGTH,
    },
}


def _scaled_rope_pair(target, kind: str, tmp_path):
    """An official full-attention draft whose config carries ``kind`` scaling, and ours loaded from its checkpoint."""
    cfg = official_config(target, "full", block_size=BLOCK)
    cfg.max_position_embeddings = ORIGINAL_LENGTH
    cfg.rope_parameters = {**ROPE_SCALINGS[kind], "rope_theta": cfg.rope_parameters["rope_theta"]}
    official_draft = official_model(cfg)
    return official_draft, load_dflash_draft(save_official(official_draft, tmp_path))


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
@torch.no_grad()
def test_scaled_rope_tables_equal_transformers_qwen3_rotary_embedding(kind, target, tmp_path):
    """cos and sin (attention factor included) for a pass inside the original length and one past it,
    each against a fresh transformers rotary embedding (the official draft's) for the same config."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    official_draft, ours = _scaled_rope_pair(target, kind, tmp_path)
    half = ours.config.head_dim // 2
    sign = torch.cat([-torch.ones(half), torch.ones(half)])
    for positions in (torch.arange(0, 12)[None], torch.arange(12, 12 + BLOCK + 4)[None]):
        cos, sin = Qwen3RotaryEmbedding(official_draft.config)(torch.zeros(1), positions)
        our_cos, our_signed_sin = ours.rope(positions, torch.float32)
        torch.testing.assert_close(our_cos[:, 0], cos, rtol=0, atol=1e-6)
        torch.testing.assert_close(our_signed_sin[:, 0], sin * sign, rtol=0, atol=1e-6)
    plain_cos, _ = Qwen3RotaryEmbedding(official_config(target, "full"))(torch.zeros(1), positions)
    assert (cos - plain_cos).abs().max() > 1e-2  # the scaling changes the tables these positions get


@pytest.mark.parametrize("kind", ["yarn", "linear", "llama3"])
@torch.no_grad()
def test_scaled_rope_draft_logits_equal_official(kind, target, tmp_path):
    """Frequencies fixed by the config (yarn with its attention factor, linear, llama3): the draft's hidden
    states and logits equal the official module's, for a block that ends past the original length."""
    official_draft, ours = _scaled_rope_pair(target, kind, tmp_path)
    prompt = PROMPTS[0]
    assert len(prompt) + BLOCK > ORIGINAL_LENGTH
    features, block, official_hidden, official_logits = _official_block(official_draft, target, prompt)
    proposer = DFlashProposer(ours, TargetModel(target, ours.hidden_state_indices))
    proposer.start(torch.tensor(prompt), features[0])
    embeds = ours.embed_block(target.get_input_embeddings().weight, block[0])[None]
    hidden = ours(
        embeds, torch.arange(len(prompt), len(prompt) + BLOCK)[None], proposer.ctx_kv, torch.arange(len(prompt))[None]
    )
    torch.testing.assert_close(hidden, official_hidden, rtol=0, atol=2e-5)
    torch.testing.assert_close(ours.compute_logits(hidden, target.lm_head), official_logits, rtol=0, atol=1e-4)
