"""Many DFlash blocks in one pass: the layout DFlash trains with, and what teacher-forced replay uses.

Given a whole known sequence (prompt + the target's continuation) and the target's tapped hidden
states for it, every anchor ``a`` gets a block ``[token[a], mask x (B-1)]`` at positions ``a..a+B-1``.
Its queries see the context strictly before the anchor (positions ``< a``) and the rows of their own
block (bidirectionally); blocks are blind to each other. Slot ``j`` predicts ``token[a + j]``.

This equals, for every anchor at once, the single block the live loop drafts when ``a`` is the position
of its last committed token, because the live context holds exactly the rows before ``a``.
"""

from __future__ import annotations

import torch

from dflash_doctor.engine.dflash_model import DFlashDraftModel


def block_mask(anchors: torch.Tensor, anchor_valid: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """Boolean attention mask [N, 1, A*B, T + A*B] (True = may attend).

    anchors: [N, A] anchor positions; anchor_valid: [N, A] False for padding anchors (their rows still
    see their own block so that softmax stays finite).
    """
    n, a = anchors.shape
    device = anchors.device
    ctx_pos = torch.arange(context_length, device=device)
    sees_ctx = (ctx_pos[None, None, :] < anchors[:, :, None]) & anchor_valid[:, :, None]  # [N, A, T]
    sees_ctx = (
        sees_ctx[:, :, None, :].expand(n, a, block_size, context_length).reshape(n, a * block_size, context_length)
    )
    block_id = torch.arange(a, device=device).repeat_interleave(block_size)  # [A*B]
    same_block = block_id[:, None] == block_id[None, :]  # [A*B, A*B]
    mask = torch.cat([sees_ctx, same_block[None].expand(n, -1, -1)], dim=-1)
    return mask[:, None]


def draft_block_hidden(
    draft: DFlashDraftModel,
    embedding_weight: torch.Tensor,  # [V, H] the target's input embedding matrix
    token_ids: torch.Tensor,  # [N, T] the known sequences (padded)
    ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [N, kvh, T, D], from draft.context_kv
    anchors: torch.Tensor,  # [N, A]
    anchor_valid: torch.Tensor,  # [N, A] bool
    block_size: int,
) -> torch.Tensor:
    """Draft hidden states for every block: [N, A, B, H] (slot 0 is the anchor token's row)."""
    n, t = token_ids.shape
    a = anchors.shape[1]
    device = token_ids.device
    block_tokens = torch.full((n, a, block_size), draft.config.mask_token_id, dtype=torch.long, device=device)
    block_tokens[:, :, 0] = token_ids.gather(1, anchors.clamp(0, t - 1))
    positions = anchors[:, :, None] + torch.arange(block_size, device=device)  # [N, A, B]
    embeds = draft.embed_block(embedding_weight, block_tokens.view(n, a * block_size))
    ctx_positions = torch.arange(t, device=device)[None].expand(n, -1)
    mask = block_mask(anchors, anchor_valid, t, block_size)
    hidden = draft(embeds, positions.view(n, a * block_size), ctx_kv, ctx_positions, mask, block_length=block_size)
    return hidden.view(n, a, block_size, -1)


def context_kv_for(draft: DFlashDraftModel, features: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer context K/V for whole sequences of tapped target features [N, T, F] at positions 0..T-1."""
    n, t, _ = features.shape
    positions = torch.arange(t, device=features.device)[None].expand(n, -1)
    return draft.context_kv(features.to(draft.fc.weight.dtype), positions)
