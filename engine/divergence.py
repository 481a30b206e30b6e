"""Per-drafted-token divergence between the draft and the target, from the same forward passes.

Computed on the models' own distributions at temperature 1 (what the draft learned to imitate), not
on temperature-scaled ones, so numbers from greedy and sampled runs are comparable.

The columns are computed batched on the models' device and packed into ONE float64 tensor
(:func:`divergence_tensor`), so that a caller copies to the host once per step or per sequence, never
once per column or per token: on a GPU every copy is a synchronisation that stalls the kernel queue.
:func:`unpack_divergence` turns the host copy into the ``tokens.parquet`` columns.
"""

from __future__ import annotations

import numpy as np
import torch

TOP_K = 5

# (name, width) in packing order; ids and ranks are exact in float64 (vocabularies are far below 2**53)
_LAYOUT = (
    ("target_prob_of_draft", 1),
    ("draft_prob_of_target", 1),
    ("target_rank_in_draft", 1),
    ("kl_target_draft", 1),
    ("total_variation", 1),
    ("target_entropy", 1),
    ("draft_topk_ids", TOP_K),
    ("target_topk_ids", TOP_K),
)
_INTEGER_COLUMNS = frozenset({"target_rank_in_draft", "draft_topk_ids", "target_topk_ids"})
WIDTH = sum(width for _, width in _LAYOUT)


@torch.inference_mode()
def divergence_tensor(
    draft_logits: torch.Tensor,  # [N, V]
    target_logits: torch.Tensor,  # [N, V]
    draft_tokens: torch.Tensor,  # [N]
    target_tokens: torch.Tensor,  # [N] the target's own token at each slot
) -> torch.Tensor:
    """The divergence columns of N rows packed as float64 [N, WIDTH], on the logits' device (no host copy)."""
    n = draft_tokens.shape[0]
    if n == 0:
        return torch.empty((0, WIDTH), dtype=torch.float64, device=draft_logits.device)
    log_q = torch.log_softmax(draft_logits, dim=-1, dtype=torch.float32)
    log_p = torch.log_softmax(target_logits, dim=-1, dtype=torch.float32)
    p, q = log_p.exp(), log_q.exp()
    rows = torch.arange(n, device=draft_tokens.device)
    draft_score_of_target = draft_logits[rows, target_tokens]
    columns = (
        p[rows, draft_tokens],
        q[rows, target_tokens],
        (draft_logits > draft_score_of_target[:, None]).sum(dim=-1),
        (p * (log_p - log_q)).sum(dim=-1).clamp_min(0.0),
        0.5 * (p - q).abs().sum(dim=-1),
        -(p * log_p).sum(dim=-1),
    )
    packed = [column.to(torch.float64)[:, None] for column in columns]
    packed.append(draft_logits.topk(TOP_K, dim=-1).indices.to(torch.float64))
    packed.append(target_logits.topk(TOP_K, dim=-1).indices.to(torch.float64))
    return torch.cat(packed, dim=1)


def unpack_divergence(packed: np.ndarray) -> dict[str, list]:
    """Host-side columns (lists, one entry per row) from a :func:`divergence_tensor` copied with ``.numpy()``."""
    columns: dict[str, list] = {}
    start = 0
    for name, width in _LAYOUT:
        block = packed[:, start : start + width]
        if name in _INTEGER_COLUMNS:
            block = block.astype(np.int64)
        columns[name] = (block if width > 1 else block[:, 0]).tolist()
        start += width
    return columns
