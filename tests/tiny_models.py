"""Tiny models built from configs in-process (no downloads): a Llama-style target and drafts for it."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_doctor.engine.dflash_model import DFlashConfig, DFlashDraftModel

VOCAB = 97


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
