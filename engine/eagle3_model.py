"""The EAGLE-3 draft head as our own PyTorch module, computing what vLLM's ``Eagle3LlamaForCausalLM`` computes.

No remote code: a checkpoint in the speculators layout or the original EAGLE-3 layout
(:mod:`dflash_doctor.models.eagle3_format` reads both) loads into :class:`Eagle3DraftModel`.

One head step over rows ``(token id, state, position)``:

1. The state of a row is either the target's aux states combined (:meth:`Eagle3DraftModel.combine`: an
   optional RMSNorm over their concatenation, ``norm_before_fc``, or one RMSNorm per state, ``fc_norm``,
   then ``fc``) or the state the head carried from its previous draft step.
2. One decoder layer whose q/k/v projections read ``cat([input_layernorm(embed(id)), hidden_norm(state)])``
   (width 2H); its residual is the state before ``hidden_norm``, or after it with ``norm_before_residual``.
   The layer is a Llama layer, or a Qwen3 layer (``q_norm``/``k_norm`` on each head before RoPE).
3. Attention, post-attention norm, SwiGLU MLP, each added to the residual; the final ``norm`` of that sum
   feeds ``lm_head`` [draft_vocab, H]. The sum itself (``norm_output``: its normed value) is the state the
   next draft step carries.

Draft logits live in the draft vocabulary; ``d2t`` maps draft id i to target id ``i + d2t[i]``, and
:meth:`Eagle3DraftModel.target_logits` writes them into a row of the target vocabulary that holds -inf
everywhere else, as vLLM does, so an argmax is a target id and a target token outside the map is never
proposed.

The module is stateless: callers keep the layer's K/V (the proposer caches the committed positions' rows
across steps; the teacher-forced pass computes a whole sequence at once).

:func:`teacher_first_pass` and :func:`teacher_chain_rows` are the teacher-forced layout (slot 1 of anchor a
is the first pass's row at a - 1; slot j chains on the true tokens with the carried state), batched over
sequences and differentiable: the proposer's sweep runs them under inference mode, ``train-draft`` with
gradients, so the head is trained in exactly the layout it drafts in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_doctor.engine.dflash_model import RMSNorm, apply_rope, rope_inverse_frequencies, rope_tables

#: Decoder layer kinds the head is built from (``transformer_layer_config.model_type``).
LAYER_TYPES = ("llama", "qwen3")

KeyValue = tuple[torch.Tensor, torch.Tensor]  # [B, kv heads, T, head dim] each, keys already rotated


@dataclass(frozen=True)
class NormSwitches:
    """Where the head normalises, as the replay runs it (each switch is explained in the module docstring)."""

    norm_before_residual: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False


@dataclass
class Eagle3Config:
    """The head's shape and switches, read from either checkpoint layout into one form."""

    layer_type: str  # one of LAYER_TYPES
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]  # vLLM's meaning: the state entering target layer k (HF hidden_states[k])
    norms: NormSwitches = NormSwitches()
    attention_bias: bool = False
    rope_theta: float = 10000.0
    rope_inverse_frequencies: torch.Tensor | None = None  # a scaled RoPE's, computed by the loader; None: plain RoPE
    rope_attention_factor: float = 1.0


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        width, hd = 2 * cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(width, cfg.num_attention_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(width, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(width, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.layer_type == "qwen3" else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.layer_type == "qwen3" else None

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, h, S, D], k and v [B, kvh, S, D] of rows ``x`` [B, S, 2H], q and k rotated."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q.transpose(1, 2), rope), apply_rope(k.transpose(1, 2), rope), v


class Eagle3Layer(nn.Module):
    """The head's one decoder layer; parameter names follow the checkpoints (``layers.0.*``)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False),
                "up_proj": nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False),
                "down_proj": nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False),
            }
        )


class Eagle3DraftModel(nn.Module):
    """The EAGLE-3 head: ``fc`` over the target's aux states, one decoder layer, ``norm``, ``lm_head``, ``d2t``.

    ``embed_tokens`` is None when the checkpoint ships none (the target's embedding is used, as vLLM
    shares it); ``lm_head`` is None when the checkpoint ships none and predicts over the whole target
    vocabulary with the target's head.
    """

    d2t: torch.Tensor  # [draft_vocab] long: target id = draft id + d2t[draft id]
    inv_freq: torch.Tensor
    facts: dict[str, Any]  # what run.json records about the checkpoint (eagle3_format.head_facts)

    def __init__(self, cfg: Eagle3Config, *, own_embedding: bool, own_lm_head: bool):
        super().__init__()
        self.config = cfg
        width = len(cfg.aux_layer_ids) * cfg.target_hidden_size
        self.input_norm = RMSNorm(width, cfg.rms_norm_eps) if cfg.norms.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in cfg.aux_layer_ids])
            if cfg.norms.fc_norm
            else None
        )
        self.fc = nn.Linear(width, cfg.hidden_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, cfg.hidden_size) if own_embedding else None
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False) if own_lm_head else None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        # a plain attribute, not a buffer: RoPE frequencies stay float32 when the head is cast to a half dtype
        self.inv_freq = self.rope_frequencies()
        self.facts = {}

    def rope_frequencies(self) -> torch.Tensor:
        """The RoPE inverse frequencies of the config (a scaled RoPE's as the loader computed them), on the current
        default device: a head built on the meta device computes them again once its shapes are checked."""
        scaled = self.config.rope_inverse_frequencies
        return rope_inverse_frequencies(self.config.head_dim, self.config.rope_theta) if scaled is None else scaled

    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]  # pyright: ignore[reportReturnType]  (a ModuleList of one Eagle3Layer)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def hidden_state_indices(self) -> tuple[int, ...]:
        """HF ``hidden_states`` indices to tap: aux id k is the state entering layer k, ``hidden_states[k]``."""
        return tuple(self.config.aux_layer_ids)

    def target_ids(self) -> torch.Tensor:
        """The target id of every draft id [draft_vocab]: the only tokens the head can ever propose."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., n*Ht] concatenated aux states -> [..., H] the first pass's row states."""
        aux = aux.to(self.dtype)
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.split(self.config.target_hidden_size, dim=-1)
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def embed(self, token_ids: torch.Tensor, target_embedding: nn.Embedding) -> torch.Tensor:
        """Input embeddings of target ids: the head's own table, else the target's module (as vLLM shares it)."""
        table = self.embed_tokens if self.embed_tokens is not None else target_embedding
        return table(token_ids).to(self.dtype)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(positions, self.inv_freq, self.dtype, self.config.rope_attention_factor)

    def layer_inputs(
        self, embeds: torch.Tensor, state: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to attention: q [B, h, S, D], this pass's K/V rows and the residual [B, S, H]."""
        layer = self.layer
        normed_state = layer.hidden_norm(state)
        residual = normed_state if self.config.norms.norm_before_residual else state
        x = torch.cat([layer.input_layernorm(embeds), normed_state], dim=-1)
        q, k, v = layer.self_attn.project(x, self.rope(positions))
        return q, k, v, residual

    def layer_outputs(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after attention (``attended`` [B, h, S, D]): the normed rows for ``lm_head`` and the
        state carried to the next draft step, both [B, S, H]."""
        layer = self.layer
        b, _, s, _ = attended.shape
        residual = residual + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(b, s, -1))
        h = layer.post_attention_layernorm(residual)
        mlp = layer.mlp
        prenorm = residual + mlp["down_proj"](F.silu(mlp["gate_proj"](h)) * mlp["up_proj"](h))
        normed = self.norm(prenorm)
        return normed, normed if self.config.norms.norm_output else prenorm

    def forward(
        self, embeds: torch.Tensor, state: torch.Tensor, positions: torch.Tensor, past: KeyValue | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, KeyValue]:
        """Rows [B, S] after ``past`` K/V rows (every past row precedes them; the rows attend causally among
        themselves): (normed [B, S, H], carried state [B, S, H], this pass's K/V rows)."""
        q, k, v, residual = self.layer_inputs(embeds, state, positions)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2))
        s, t = q.shape[2], keys.shape[2]
        mask = None if s == 1 else torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.num_heads_differ)
        normed, carried = self.layer_outputs(attended, residual)
        return normed, carried, (k, v)

    @property
    def num_heads_differ(self) -> bool:
        return self.config.num_attention_heads != self.config.num_key_value_heads

    def target_logits(self, normed: torch.Tensor, target_head: nn.Linear) -> torch.Tensor:
        """Float32 logits over the target vocabulary [..., V]: the draft vocabulary's scores at their target
        ids (``d2t``), -inf elsewhere. Without its own head the draft scores with the target's."""
        if self.lm_head is None:
            return target_head(normed.to(target_head.weight.dtype)).float()
        scores = self.lm_head(normed).float()
        full = torch.full((*scores.shape[:-1], self.config.target_vocab_size), float("-inf"), device=scores.device)
        return full.index_copy(-1, self.target_ids(), scores)


def teacher_first_pass(
    model: Eagle3DraftModel, target_embedding: nn.Embedding, token_ids: torch.Tensor, aux: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, KeyValue]:
    """The EAGLE-3 head's first pass over whole sequences, once for every anchor, with causal attention.

    Row p reads the aux state at p and the embedding of token p + 1 (the last row repeats its own token:
    no anchor reads it). Right padding is harmless: causal rows never see what follows them.

    Args:
        model: the EAGLE-3 draft head.
        target_embedding: the target's input embedding (the head embeds with it).
        token_ids: [N, T] the known sequences, right-padded.
        aux: [N, T, n*Ht] the target's tapped hidden states at every position, concatenated over its n
            tapped layers.

    Returns:
        (normed [N, T, H], carried [N, T, H], (keys, values) [N, kvh, T, D] each), what
        :func:`teacher_chain_rows` takes as ``first``.
    """
    shifted = torch.cat([token_ids[:, 1:], token_ids[:, -1:]], dim=1)
    positions = torch.arange(token_ids.shape[1], device=token_ids.device)[None].expand(len(token_ids), -1)
    return model(model.embed(shifted, target_embedding), model.combine(aux), positions)


def teacher_chain_rows(
    model: Eagle3DraftModel,
    target_embedding: nn.Embedding,
    token_ids: torch.Tensor,
    first: tuple[torch.Tensor, torch.Tensor, KeyValue],
    anchors: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """The head's normed rows of slots 1..k of every anchor, as the live loop's chain computes them when every
    earlier draft matched (the only case in which slot j is read).

    Slot 1 is the first pass's row at a - 1; slot j > 1 reads the true token at a + j - 1 and the state
    slot j - 1 carried, at the position after slot j - 1's row, attending to the first-pass keys before the
    anchor and the anchor's own chain keys.

    Args:
        model: the EAGLE-3 draft head.
        target_embedding: the target's input embedding.
        token_ids: [N, T] the known sequences.
        first: the first pass of :func:`teacher_first_pass` over ``token_ids``.
        anchors: [N, A] anchor positions, each >= 1.
        k: the slots per anchor (the block length), >= 1.

    Returns:
        [N, A, k, H] normed rows, slot j - 1 at index j - 1, for the head's logits.
    """
    first_normed, first_carried, (first_keys, first_values) = first
    n, width = token_ids.shape
    a = anchors.shape[1]
    bound = int(anchors.max()) if anchors.numel() else 0  # first-pass keys any anchor may see: positions < max anchor
    prefix_keys, prefix_values = first_keys[:, :, :bound], first_values[:, :, :bound]  # [N, kvh, bound, D]
    visible = torch.arange(bound, device=anchors.device)[None, None] < anchors[..., None]  # [N, A, bound]

    def at_rows(x: torch.Tensor) -> torch.Tensor:  # [N, T, H] -> the rows at a - 1, [N, A, H]
        return x.gather(1, (anchors - 1)[..., None].expand(-1, -1, x.shape[-1]))

    rows = [at_rows(first_normed)]
    carried = at_rows(first_carried).reshape(n * a, 1, -1)
    chain_keys: list[torch.Tensor] = []
    chain_values: list[torch.Tensor] = []
    for step in range(1, k):
        position = (anchors + step - 1).reshape(n * a, 1)  # the row after the anchor's previous one
        token = token_ids.gather(1, (anchors + step).clamp(max=width - 1))  # the true token the previous slot matched
        q, key, value, residual = model.layer_inputs(
            model.embed(token.reshape(n * a, 1), target_embedding), carried, position
        )
        chain_keys.append(key.view(n, a, *key.shape[1:]))
        chain_values.append(value.view(n, a, *value.shape[1:]))
        attended = attend_prefix_and_chain(
            q.view(n, a, q.shape[1], q.shape[3]),
            prefix_keys,
            prefix_values,
            visible,
            torch.cat(chain_keys, dim=3),
            torch.cat(chain_values, dim=3),
        )
        normed, carried = model.layer_outputs(attended.reshape(n * a, -1, 1, q.shape[3]), residual)
        rows.append(normed.view(n, a, -1))
    return torch.stack(rows, dim=2)


def attend_prefix_and_chain(
    q: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    visible: torch.Tensor,
    chain_keys: torch.Tensor,
    chain_values: torch.Tensor,
) -> torch.Tensor:
    """Attention of one query per anchor over its sequence's first-pass keys and its own chain keys.

    The shared keys are never copied per anchor (a [N, A, kvh, T, D] copy would dominate memory on a long
    sequence): scores against them are one product per kv head, then one softmax over both parts.

    Args:
        q: [N, A, h, D] one query per anchor (h heads, a multiple of kvh).
        prefix_keys: [N, kvh, T, D] the first-pass keys of each sequence, shared by its anchors.
        prefix_values: [N, kvh, T, D] the matching values.
        visible: [N, A, T] bool, True where an anchor's query may see a first-pass key.
        chain_keys: [N, A, kvh, s, D] each anchor's own chain keys (all visible).
        chain_values: [N, A, kvh, s, D] the matching values.

    Returns:
        [N, A, h, D] the attention outputs, in ``q``'s dtype (computed in float32).
    """
    n, a, h, d = q.shape
    kvh = prefix_keys.shape[1]
    grouped = q.view(n, a, kvh, h // kvh, d).float() * d**-0.5  # [N, A, kvh, g, D]
    prefix = torch.einsum("nakgd,nktd->nakgt", grouped, prefix_keys.float())
    prefix = prefix.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    own = torch.einsum("nakgd,naksd->nakgs", grouped, chain_keys.float())
    weights = torch.softmax(torch.cat([prefix, own], dim=-1), dim=-1)
    t = prefix.shape[-1]
    out = torch.einsum("nakgt,nktd->nakgd", weights[..., :t], prefix_values.float()) + torch.einsum(
        "nakgs,naksd->nakgd", weights[..., t:], chain_values.float()
    )
    return out.reshape(n, a, h, d).to(q.dtype)
