"""Tiny targets of each architecture family DFlash drafts are published for, built from transformers'
own configs in-process (fp32, seeded, no downloads).

Each builder keeps the family's defining parts at toy size: the hybrids' layer pattern (three
gated-delta-net layers to one attention layer, Mamba / short-convolution blocks), MoE routing, MLA's
low-rank projections, attention sinks, sliding windows smaller than the outputs the tests decode.
"""

from __future__ import annotations

from typing import Callable

import torch
import transformers

VOCAB = 97
HIDDEN = 32
SLIDING_WINDOW = 6  # smaller than the tests' outputs, so the window matters

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    initializer_range=0.3,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN)
GATED_DELTA = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
HYBRID_4 = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def _config(name: str, **fields) -> transformers.PretrainedConfig:
    fields = {**COMMON, **fields}
    return getattr(transformers, name)(**{k: v for k, v in fields.items() if v is not None})


CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama": lambda: _config("LlamaConfig", num_hidden_layers=4),
    "mistral": lambda: _config("MistralConfig", num_hidden_layers=4, sliding_window=SLIDING_WINDOW),
    "qwen3": lambda: _config("Qwen3Config", num_hidden_layers=4),
    "qwen3_moe": lambda: _config("Qwen3MoeConfig", num_hidden_layers=4, **MOE),
    "qwen3_5": lambda: _config("Qwen3_5TextConfig", num_hidden_layers=4, layer_types=HYBRID_4, **GATED_DELTA),
    "qwen3_5_moe": lambda: _config(
        "Qwen3_5MoeTextConfig",
        num_hidden_layers=4,
        layer_types=HYBRID_4,
        **GATED_DELTA,
        **MOE,
        shared_expert_intermediate_size=HIDDEN,
    ),
    "qwen3_next": lambda: _config(
        "Qwen3NextConfig",
        num_hidden_layers=4,
        layer_types=HYBRID_4,
        **GATED_DELTA,
        **MOE,
        shared_expert_intermediate_size=HIDDEN,
    ),
    "gpt_oss": lambda: _config(
        "GptOssConfig",
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "gemma4": lambda: _config(
        "Gemma4TextConfig",
        num_hidden_layers=4,
        sliding_window=SLIDING_WINDOW,
        global_head_dim=8,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    ),
    "deepseek_v3": lambda: _config(
        "DeepseekV3Config",
        num_hidden_layers=4,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=HIDDEN,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        head_dim=4,
        num_key_value_heads=4,
    ),
    "minimax_m2": lambda: _config("MiniMaxM2Config", num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": lambda: _config(
        "Glm4MoeConfig",
        num_hidden_layers=4,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=HIDDEN,
    ),
    "lfm2": lambda: _config(
        "Lfm2Config", num_hidden_layers=4, head_dim=None, layer_types=["conv", "conv", "full_attention", "conv"]
    ),
    "nemotron_h": lambda: _config(
        "NemotronHConfig",
        num_hidden_layers=4,
        layers_block_type=["mamba", "attention", "mamba", "moe"],
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=1,
        mamba_d_conv=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=HIDDEN,
        moe_shared_expert_intermediate_size=HIDDEN,
    ),
}


def tiny_family_target(family: str, seed: int = 0):
    """A random tiny causal LM of ``family`` in fp32 eval mode (attention implementation left to the engine)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())
    return model.float().eval()
