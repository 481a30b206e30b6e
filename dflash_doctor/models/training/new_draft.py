"""A new draft for a target: its config (the target's width, heads and RoPE base), weights initialised from the
target's, and the mask token (an id the target never emits and the tokenizer does not treat as special).

Its own module because it runs before any data or training: ``train-draft`` builds the draft here, then
hands it to the loop.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from dflash_doctor.engine.dflash_model import DFlashConfig, DFlashDraftModel
from dflash_doctor.errors import UsageError

if TYPE_CHECKING:
    from dflash_doctor.engine.target import CausalLM


DEFAULT_NUM_TAPS = 4  # target layers a new draft conditions on (DFlash uses 5 for 36-layer targets)


def draft_config_for_target(
    target_config: Any, *, block_size: int, num_layers: int, target_layer_ids: Sequence[int], mask_token_id: int
) -> DFlashConfig:
    """A new draft's config: the target's width, heads and RoPE base (it shares the target's embeddings)."""
    num_target_layers = target_config.num_hidden_layers
    if block_size < 2:
        raise UsageError(f"--block-size {block_size} must be at least 2 (the anchor plus one drafted token).")
    if num_layers < 1:
        raise UsageError(f"--num-layers {num_layers} must be at least 1.")
    bad = [layer for layer in target_layer_ids if not 0 <= layer < num_target_layers]
    if not target_layer_ids or bad:
        raise UsageError(
            f"--target-layer-ids {list(target_layer_ids)} must name layers "
            f"0..{num_target_layers - 1} of the target; fix the list."
        )
    validate_mask_token_id(mask_token_id, target_config)
    rope = getattr(target_config, "rope_parameters", None) or {}
    heads = target_config.num_attention_heads
    return DFlashConfig(
        hidden_size=target_config.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        intermediate_size=target_config.intermediate_size,
        vocab_size=target_config.vocab_size,
        block_size=block_size,
        target_layer_ids=list(target_layer_ids),
        mask_token_id=mask_token_id,
        num_target_layers=num_target_layers,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
        max_position_embeddings=getattr(target_config, "max_position_embeddings", 40960),
    )


def init_draft_from_target(draft: DFlashDraftModel, target_model: CausalLM) -> list[int]:
    """Copy the target's LAST ``num_layers`` decoder layers (attention, MLP, both norms) and final norm into the draft.

    Why: the draft's layers have the target's width and head layout, and its output goes through the
    target's lm_head, so the layers nearest the head start the draft where the target's own top of the
    stack already maps hidden states to next-token logits (EAGLE-style drafts start from a target layer
    too). Tensors without a counterpart (``fc``, ``hidden_norm``, the per-head ``q_norm``/``k_norm`` a
    Llama target lacks) keep their fresh initialisation. Returns the target layer indices copied.
    """
    decoder = target_model.get_decoder()
    stack = list(decoder.get_submodule("layers").children())
    chosen = list(range(len(stack) - draft.config.num_hidden_layers, len(stack)))
    if chosen[0] < 0:
        raise UsageError(
            f"--init-from-target: the draft has {draft.config.num_hidden_layers} "
            f"layers but the target only {len(stack)}; use fewer --num-layers."
        )
    with torch.no_grad():
        for layer, index in zip(draft.layers, chosen):
            source = stack[index].state_dict()
            for name, tensor in layer.state_dict().items():
                if name in source and source[name].shape == tensor.shape:
                    tensor.copy_(source[name].to(tensor.dtype))
        draft.norm.weight.copy_(decoder.get_submodule("norm").get_parameter("weight").to(draft.norm.weight.dtype))
    return chosen


def _special_ids(target_config: Any, tokenizer: Any = None) -> set[int]:
    """bos / eos / pad / unk ids of the model and its tokenizer: never usable as the mask."""
    ids: set[int] = set()
    for source in (target_config, tokenizer):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            value = getattr(source, name, None) if source is not None else None
            if value is not None:
                ids.update(value if isinstance(value, (list, tuple)) else [value])
    return {int(i) for i in ids}


def validate_mask_token_id(mask_token_id: int, target_config: Any, tokenizer: Any = None) -> None:
    """The mask must be a real embedding row (< vocab) that is not bos/eos/pad/unk (docs/draft-formats.md)."""
    vocab = target_config.vocab_size
    if not 0 <= mask_token_id < vocab:
        raise UsageError(
            f"--mask-token-id {mask_token_id} is outside the target "
            f"vocabulary (0..{vocab - 1}); pick a reserved token id."
        )
    if mask_token_id in _special_ids(target_config, tokenizer):
        raise UsageError(
            f"--mask-token-id {mask_token_id} is the target's bos/eos/pad/unk "
            "token; pick a reserved token the target never generates."
        )


def choose_mask_token_id(
    tokenizer: Any, target_config: Any, used_ids: Iterable[int], chat_template: str | None = None
) -> int:
    """The highest-id special token that is not bos/eos/pad/unk, not in the chat template and never in the data.

    Why: the mask row must be a real embedding row (the draft embeds masks with the target's own
    ``embed_tokens``) that the target never emits, or an anchor token would look like a mask. Reserved
    special tokens fit; SmolLM2 (vocab 49152, no padding rows) has 17 (ids 0..16) and this picks
    ``<empty_output>`` (16), a Jupyter-notebook marker that chat never produces.
    """
    forbidden = _special_ids(target_config, tokenizer) | set(used_ids)
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    candidates = []
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if (
            getattr(added, "special", False)
            and token_id < target_config.vocab_size
            and token_id not in forbidden
            and added.content not in template
        ):
            candidates.append(int(token_id))
    if not candidates:
        raise UsageError(
            "the target tokenizer has no reserved special token that is free to serve as the mask; "
            "pass --mask-token-id with an id the target never generates."
        )
    return max(candidates)


def chat_template_record(chat_template: str | None) -> dict[str, Any]:
    """What config.json records under ``dflash_doctor`` so checks can compare the served template with this one."""
    text = chat_template or ""
    return {
        "chat_template_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest() if text else None,
        "chat_template": chat_template,
    }
