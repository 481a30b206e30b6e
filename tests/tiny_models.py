"""Tiny models built from configs in-process (no downloads): a Llama-style target and drafts for it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_doctor.engine.dflash_model import DFlashConfig, DFlashDraftModel
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel

VOCAB = 97
PROMPT = [1, 17, 42, 8, 9, 30, 31, 44]


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside the block, the caller's setting restored after it. Tiny
    models want 1 (on a busy 2-core machine thread hand-offs cost more than their matmuls); a test module
    sets it for its own fixtures and tests only."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def tiny_target(seed: int = 0, *, vocab: int = VOCAB, hidden: int = 32, layers: int = 4) -> LlamaForCausalLM:
    """A random 4-layer target whose logits are peaked enough that argmax ties never happen."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def tiny_dflash(target: LlamaForCausalLM, seed: int = 1, *, block_size: int = 6, layer_ids=(0, 2), num_layers: int = 2,
                mask_token_id: int = 3, layer_types=None, sliding_window=None) -> DFlashDraftModel:
    torch.manual_seed(seed)
    tc = target.config
    cfg = DFlashConfig(
        hidden_size=tc.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=2 * tc.hidden_size,
        vocab_size=tc.vocab_size,
        block_size=block_size,
        target_layer_ids=list(layer_ids),
        mask_token_id=mask_token_id,
        num_target_layers=tc.num_hidden_layers,
        rope_theta=10000.0,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    model = DFlashDraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.eval()


@torch.no_grad()
def first_block_logits(draft: DFlashDraftModel, target: LlamaForCausalLM) -> torch.Tensor:
    """The scores of the first block the DFlash proposer drafts after :data:`PROMPT` (K = 5): what a
    checkpoint in another dialect must reproduce exactly."""
    wrapped = TargetModel(target, draft.hidden_state_indices)
    hidden = target(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    proposer = DFlashProposer(draft, wrapped)
    proposer.start(torch.tensor(PROMPT), torch.cat([hidden[i][0] for i in draft.hidden_state_indices], dim=-1))
    return proposer.propose(PROMPT[-1], 5, 5).logits
