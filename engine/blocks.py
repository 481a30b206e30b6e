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
    """Boolean attention mask of every anchor's block over the context and its own block.

    Padding anchors' rows still see their own block, so that softmax stays finite.

    Args:
        anchors: [N, A] anchor positions in each sequence.
        anchor_valid: [N, A] bool, False for padding anchors (their rows see no context).
        context_length: T, the number of context positions (the padded sequence length).
        block_size: B, the rows of one block (the anchor's row included).

    Returns:
        [N, 1, A*B, T + A*B] bool, True where a block row may attend: context positions strictly before
        its anchor, then the rows of its own block.
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
    embedding_weight: torch.Tensor,
    token_ids: torch.Tensor,
    ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Draft hidden states for every anchor's block, all in one pass of the draft.

    Args:
        draft: the DFlash draft model.
        embedding_weight: [V, H] the target's input embedding matrix (the draft shares it).
        token_ids: [N, T] the known sequences, padded.
        ctx_kv: per draft layer, the context keys and values [N, kvh, T, D] from :func:`context_kv_for`.
        anchors: [N, A] anchor positions.
        anchor_valid: [N, A] bool, False for padding anchors.
        block_size: B, the rows of one block (the anchor's row included).

    Returns:
        [N, A, B, H] hidden states; slot 0 is the anchor token's row, slot j predicts ``token[a + j]``.
    """
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
    """Per-layer context K/V for whole sequences of tapped target features, computed once for every block.

    Args:
        draft: the DFlash draft model (its ``fc`` weight's dtype is the one the features are cast to).
        features: [N, T, F] tapped target hidden states, at positions 0..T-1.

    Returns:
        One (keys, values) pair per draft layer, each [N, kvh, T, D].
    """
    n, t, _ = features.shape
    positions = torch.arange(t, device=features.device)[None].expand(n, -1)
    return draft.context_kv(features.to(draft.fc.weight.dtype), positions)
