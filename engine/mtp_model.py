"""A target's own multi-token-prediction (MTP) head as a module: one step of it, as the engines compute it.

One MTP layer turns (the token at position p + 1, a hidden state of position p) into a guess for
position p + 2::

    e = embedding_norm(embed(token))          # DeepSeek's layout: embed(token) zeroed at position 0
    x = proj(cat[e, hidden_norm(hidden)])      # eh_proj / fc, [H, 2H]
    y = block(x)                               # one decoder block of the target's own architecture
    logits = head(output_norm(y))              # shared_head.norm / mtp.norm, then the head

The block is transformers' own decoder-layer class of the target's architecture, built with the layer
index the checkpoint gives the MTP layer (after the target's layers), so it computes exactly what the
target's layers compute (MoE routing, MLA, q/k norms included). Its attention reads the K/V rows the
caller hands it (:class:`KeyValueRows`): the head keeps no cache of its own, which lets the live loop
cache committed rows across steps and the teacher-forced replay batch many anchors' chains at once.
The embedding and the vocabulary head are the target's unless the checkpoint ships its own.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_doctor.errors import UsageError

KeyValue = tuple[torch.Tensor, torch.Tensor]


class KeyValueRows:
    """Stands in for transformers' ``Cache`` inside one block's attention: ``update`` returns the rows
    handed in (``past``, [B, heads, P, d] each, whatever pair the architecture caches: K/V, or MLA's
    latents) followed by the new ones, and keeps the new ones in ``new`` for the caller to keep or drop."""

    def __init__(self, past: KeyValue | None):
        self.past = past
        self.new: KeyValue | None = None

    def update(self, first: torch.Tensor, second: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> KeyValue:
        self.new = (first, second)
        if self.past is None:
            return first, second
        return torch.cat([self.past[0], first], dim=-2), torch.cat([self.past[1], second], dim=-2)


def decoder_layer_class(config) -> type[nn.Module]:
    """transformers' decoder-layer class of the target's architecture, which an MTP block is built as.

    Args:
        config: the target's transformers config; its type finds the causal-LM class.

    Returns:
        The first class that the model's ``_no_split_modules`` names as a ``...DecoderLayer``.

    Raises:
        UsageError: when transformers has no causal-LM class for the architecture or it names no decoder
            layer.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    module = sys.modules.get(model_class.__module__) if model_class is not None else None
    names = [n for n in getattr(model_class, "_no_split_modules", None) or [] if n.endswith("DecoderLayer")]
    if module is None or not names:
        raise UsageError(
            f"transformers has no decoder layer for the {config.model_type} architecture to build its MTP "
            "block from; replay this target's MTP head with an engine that serves it."
        )
    return getattr(module, names[0])


class MtpLayer(nn.Module):
    """One MTP layer: the two input norms, the projection, the block and the output norm (and the layer's
    own head / embedding where the checkpoint ships them)."""

    def __init__(self, config, block: nn.Module, own_head: bool, own_embedding: bool):
        super().__init__()
        hidden = config.hidden_size
        norm_class = type(getattr(block, "input_layernorm"))  # the architecture's RMSNorm (Qwen3.5's is 1 + w)
        self.embedding_norm = norm_class(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = norm_class(hidden, eps=config.rms_norm_eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.output_norm = norm_class(hidden, eps=config.rms_norm_eps)
        self.head = nn.Linear(hidden, config.vocab_size, bias=False) if own_head else None
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embedding else None


class MtpHead(nn.Module):
    """The MTP layers of a target, built from its checkpoint (:func:`build_mtp_head`)."""

    def __init__(self, layers: list[MtpLayer], layout: str, first_layer_index: int, zero_first_embedding: bool):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.layout = layout
        self.first_layer_index = first_layer_index
        self.zero_first_embedding = zero_first_embedding

    @property
    def n_predict(self) -> int:
        return len(self.layers)

    def step(
        self,
        layer: int,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        shared: tuple[nn.Embedding, nn.Linear],
        rotary: nn.Module,
        past: KeyValue | None,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, KeyValue]:
        """Run MTP layer ``layer`` over ``token_ids`` / ``positions`` [B, S] with the hidden states [B, S, H].

        ``shared``: the target's embedding and head (used where the layer has none); ``rotary``: the
        target's rotary embedding; ``past``: K/V rows [B, heads, P, d] the queries may attend to, before
        the new ones; ``mask`` [B, 1, S, P + S]: True where a query may read a key. Returns the block's
        output (before the output norm), the normed output, and the new rows.
        """
        mtp = self.layers[layer]
        assert isinstance(mtp, MtpLayer)
        embedding = mtp.embed_tokens if mtp.embed_tokens is not None else shared[0]
        dtype = mtp.proj.weight.dtype
        embeds = embedding(token_ids).to(dtype)
        if self.zero_first_embedding:
            embeds = embeds.masked_fill((positions == 0)[..., None], 0.0)
        x = mtp.proj(torch.cat([mtp.embedding_norm(embeds), mtp.hidden_norm(hidden.to(dtype))], dim=-1))
        rows = KeyValueRows(past)
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        out = mtp.block(
            x, attention_mask=additive, position_ids=positions, cache=rows, position_embeddings=rotary(x, positions)
        )
        out = out[0] if isinstance(out, tuple) else out
        assert rows.new is not None, "the block's attention did not read its K/V rows"
        return out, mtp.output_norm(out), rows.new

    def logits(self, layer: int, normed: torch.Tensor, shared_head: nn.Linear) -> torch.Tensor:
        """The layer's vocabulary scores (float32) of normed outputs [..., H]."""
        mtp = self.layers[layer]
        assert isinstance(mtp, MtpLayer)
        head = mtp.head if mtp.head is not None else shared_head
        return head(normed.to(head.weight.dtype)).float()


def _fuse_experts(tensors: dict[str, torch.Tensor], wanted: set[str]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (``experts.{e}.gate_proj/up_proj/down_proj.weight``) stacked into the
    fused ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I] that transformers' MoE
    modules hold (transformers converts them the same way when it loads the target's own layers)."""
    out = dict(tensors)
    for fused in sorted(
        name for name in wanted if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and name not in tensors
    ):
        stem, _, kind = fused.rpartition(".")
        count = sum(1 for name in tensors if name.startswith(stem + ".") and name.endswith(".down_proj.weight"))
        if count == 0:
            continue
        parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        out[fused] = torch.stack(
            [torch.cat([out.pop(f"{stem}.{e}.{part}.weight") for part in parts]) for e in range(count)]
        )
    return out


@dataclass
class MtpCheckpoint:
    """The MTP weights of one target: its layout, and per MTP layer the tensors under the head's names."""

    layout: str
    layers: list[dict[str, torch.Tensor]]
    first_layer_index: int  # the MTP layers' index after the target's own layers (num_hidden_layers)
    zero_first_embedding: bool  # the layout masks the token embedding at position 0 (DeepSeek's: nothing precedes it)

    @property
    def n_predict(self) -> int:
        return len(self.layers)

    def has_own(self, part: str) -> bool:
        """Whether the checkpoint ships its own ``head`` / ``embed_tokens`` (else the target's are shared)."""
        return f"{part}.weight" in self.layers[0]


def build_mtp_head(
    checkpoint: MtpCheckpoint, target_config, *, dtype: torch.dtype, device: str, target_name: str
) -> MtpHead:
    """The head module of ``checkpoint`` for a target of ``target_config``, its weights loaded strictly.

    The modules are built on the meta device and take the checkpoint's tensors as they are (no copy): an MTP
    block of a large MoE target is the size of one of its decoder layers (DeepSeek-V3's: 11B parameters), and
    building it with random float32 weights first held 44 GB more than its bfloat16 weights and spent tens of
    seconds initialising them (benchmarks/mtp_load.py: peak memory x4.3, time x1.5 on a 0.33B block).

    Args:
        checkpoint: the MTP layers' tensors read from the target's checkpoint.
        target_config: the target's transformers config (its text config shapes the blocks).
        dtype: the dtype the head is cast to.
        device: the device the head is moved to, e.g. ``"cuda"``.
        target_name: the target's name, for the error messages.

    Returns:
        The head in eval mode, on ``device`` in ``dtype``.

    Raises:
        UsageError: when a layer's tensors and its block's parameters differ (a tensor the block lacks, or
            one the checkpoint lacks), or the block computes a buffer when built.
    """
    config = copy.deepcopy(target_config.get_text_config())
    if isinstance(getattr(config, "layer_types", None), list):  # the MTP blocks are full-attention layers
        config.layer_types = list(config.layer_types) + ["full_attention"] * checkpoint.n_predict
    layer_class = decoder_layer_class(target_config)
    layers = []
    for i, tensors in enumerate(checkpoint.layers):
        with torch.device("meta"):
            block = layer_class(config, checkpoint.first_layer_index + i)
            layer = MtpLayer(
                config, block, own_head=checkpoint.has_own("head"), own_embedding=checkpoint.has_own("embed_tokens")
            )
        state = _fuse_experts(tensors, set(layer.state_dict()))
        missing, unexpected = layer.load_state_dict(state, strict=False, assign=True)
        problem = (missing and f"lacks {missing[0]}") or (
            unexpected and f"has {unexpected[0]}, which a {layer_class.__name__} does not"
        )
        if problem:
            raise UsageError(
                f"the MTP layer {i} of the target {target_name} {problem}; pass a checkpoint whose MTP weights "
                "match its config.json."
            )
        # a buffer outside the state dict (none in today's MTP block classes) would have no value to take
        unset = next((name for name, tensor in layer.named_buffers() if tensor.is_meta), None)
        if unset is not None:
            raise UsageError(
                f"the MTP layer {i} of the target {target_name} is a {layer_class.__name__}, which computes its "
                f"buffer {unset} when built, and the MTP replay cannot load such a block yet; compare the "
                "target's other speculators (--draft ngram, an EAGLE-3 or DFlash draft) instead."
            )
        layers.append(layer)
    head = MtpHead(layers, checkpoint.layout, checkpoint.first_layer_index, checkpoint.zero_first_embedding)
    return head.to(device=device, dtype=dtype).eval()
