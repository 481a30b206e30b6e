"""The official DFlash implementation (PyPI ``dflash`` 0.1.0, z-lab) as a test oracle, never vendored.

Builds official ``DFlashDraftModel`` / ``DFlash2DraftModel`` modules with random weights for a tiny
target, writes them as checkpoints in the layout z-lab publishes (DFlash 2 codebooks without
``.weight``), and runs the official ``dflash_generate`` on CPU (its stats timer calls
``torch.cuda.synchronize``; :func:`official_generate` swaps in a CPU clock).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

# installed by scripts/setup-dev.sh (pip install --no-deps dflash==0.1.0), not by `pip install -e ".[test]"`: a test
# module that imports this one is skipped, with this reason, where it is missing (the light lane of CONTRIBUTING.md)
official = pytest.importorskip(
    "dflash.model", reason="the official dflash 0.1.0 oracle is installed by scripts/setup-dev.sh"
)

VARIANTS: dict[str, dict[str, Any]] = {
    "full": {},
    "sliding": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
    "causal": {"is_causal": True},
    "scaled": {
        "dflash_config": {"input_embedding_scale": 0.9, "output_multiplier": 1.1, "final_logit_softcapping": 3.0}
    },
    "dflash2": {
        "architecture": "DFlash2DraftModel",
        "dflash_config": {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 4},
    },
}


def official_config(target, variant: str, *, block_size: int = 6, layer_ids=(0, 2), mask_token_id: int = 3):
    """An official draft config (a transformers Qwen3Config with the DFlash keys) for ``variant``."""
    from transformers import Qwen3Config

    spec = VARIANTS[variant]
    tc = target.config
    layer_types = spec.get("layer_types", ["full_attention", "full_attention"])
    cfg = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=2 * tc.hidden_size,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        attention_bias=False,
        tie_word_embeddings=False,
        use_sliding_window="sliding_window" in spec,
        sliding_window=spec.get("sliding_window"),
        layer_types=layer_types,
    )
    cfg.architectures = [spec.get("architecture", "DFlashDraftModel")]
    cfg.block_size = block_size
    cfg.num_target_layers = tc.num_hidden_layers
    cfg.dflash_config = {
        "mask_token_id": mask_token_id,
        "target_layer_ids": list(layer_ids),
        **spec.get("dflash_config", {}),
    }
    if "is_causal" in spec:
        cfg.is_causal = spec["is_causal"]
    cfg._attn_implementation = "sdpa"
    return cfg


def official_model(cfg, seed: int = 1):
    """The official module with random weights large enough that every part matters."""
    cls = official.DFlash2DraftModel if cfg.architectures == ["DFlash2DraftModel"] else official.DFlashDraftModel
    model = cls(cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.25 * torch.randn(param.shape, generator=generator))
    return model.float().eval()


def save_official(model, out_dir: Path) -> Path:
    """config.json + model.safetensors as z-lab ships them (DFlash 2 codebooks keyed without ``.weight``)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    state = {}
    for key, tensor in model.state_dict().items():
        if key.startswith("candidate_selector.") and key.endswith("codebook.weight"):
            key = key.removesuffix(".weight")
        state[key] = tensor.contiguous()
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def official_generate(
    model,
    target,
    prompt: list[int],
    *,
    max_new_tokens: int,
    stop_ids: list[int] | None,
    block_size: int | None = None,
    temperature: float = 0.0,
):
    """Official ``dflash_generate`` with stats: (output token ids after the prompt, per-step acceptance lengths)."""
    real_timer = official._cuda_time
    official._cuda_time = time.perf_counter  # its timer synchronises CUDA; on CPU a plain clock
    try:
        stats = official.dflash_generate(
            model,
            target,
            torch.tensor([prompt]),
            max_new_tokens,
            stop_ids,
            temperature=temperature,
            block_size=block_size,
            return_stats=True,
        )
    finally:
        official._cuda_time = real_timer
    return stats.output_ids[0, len(prompt) :].tolist(), list(stats.acceptance_lengths)


#: Variants of a real z-lab draft (the shipped demo draft) that exercise each new code path.
REAL_VARIANTS = ("full", "sliding", "scaled", "causal", "dflash2")


def real_variant(draft_dir: Path, variant: str, out_dir: Path, seed: int = 0) -> Path:
    """A copy of the draft at ``draft_dir`` as an official ``variant`` checkpoint in ``out_dir``.

    sliding: first layer ``sliding_attention`` with a 64-token window (so it is causal inside the block);
    scaled: input_embedding_scale 0.9, output_multiplier 1.1, final_logit_softcapping 30; causal: every layer
    causal inside the block (``is_causal``, what JetSpec's ``dflash_config.causal`` means to vLLM); dflash2: the
    same layers plus DFlash 2 convolutions that start as identity with small random perturbations and a
    small random selector (rank 16, top-8), so both change the draft without destroying it.
    """
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    raw = json.loads((draft_dir / "config.json").read_text(encoding="utf-8"))
    raw.pop("dflash_doctor", None)
    if variant == "sliding":
        raw.update(
            layer_types=["sliding_attention"] + raw["layer_types"][1:],
            sliding_window=64,
            use_sliding_window=True,
            max_window_layers=0,
        )
    elif variant == "scaled":
        raw["dflash_config"].update(input_embedding_scale=0.9, output_multiplier=1.1, final_logit_softcapping=30.0)
    elif variant == "causal":
        raw["is_causal"] = True
    elif variant == "dflash2":
        raw["architectures"] = ["DFlash2DraftModel"]
        raw["dflash_config"].update(conv_kernel_size=3, conv_group_size=64, selector_rank=16, selector_top_k=8)
    cfg = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("dflash_config", "block_size", "num_target_layers")})
    cfg.dflash_config, cfg.block_size, cfg.num_target_layers = (
        raw["dflash_config"],
        raw["block_size"],
        raw["num_target_layers"],
    )
    cfg.architectures = raw["architectures"]
    cfg._attn_implementation = "sdpa"
    cls = official.DFlash2DraftModel if variant == "dflash2" else official.DFlashDraftModel
    model = cls(cfg).float()
    state = {k.removeprefix("model."): v for k, v in load_file(draft_dir / "model.safetensors").items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in missing:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
                if name.endswith("base_kernel"):
                    param[:, 0] += 1.0  # tap 0 = the row itself: the convolution starts near identity
    return save_official(model.eval(), out_dir)
