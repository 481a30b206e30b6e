"""Per-drafted-token divergence between the draft and the target, from the same forward passes.

Computed on the models' own distributions at temperature 1 (what the draft learned to imitate), not
on temperature-scaled ones, so numbers from greedy and sampled runs are comparable.
"""

from __future__ import annotations

import torch

TOP_K = 5


@torch.inference_mode()
def divergence_columns(
    draft_logits: torch.Tensor,  # [N, V]
    target_logits: torch.Tensor,  # [N, V]
    draft_tokens: torch.Tensor,  # [N]
    target_tokens: torch.Tensor,  # [N] the target's own token at each slot
    top_k: int = TOP_K,
) -> dict[str, list]:
    """Columns of ``tokens.parquet`` that describe how far the draft is from the target, per row."""
    if draft_logits.shape[0] == 0:
        return {name: [] for name in _COLUMNS}
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    log_p = torch.log_softmax(target_logits.float(), dim=-1)
    p, q = log_p.exp(), log_q.exp()
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    top2 = p.topk(2, dim=-1).values  # [N, 2]
    draft_score_of_target = draft_logits[rows, target_tokens]
    columns = {
        "target_prob_of_draft": p[rows, draft_tokens],
        "draft_prob_of_target": q[rows, target_tokens],
        "target_rank_in_draft": (draft_logits > draft_score_of_target[:, None]).sum(dim=-1),
        "kl_target_draft": (p * (log_p - log_q)).sum(dim=-1).clamp_min(0.0),
        "total_variation": 0.5 * (p - q).abs().sum(dim=-1),
        "target_entropy": -(p * log_p).sum(dim=-1),
        # how sure the target was of its own top token: a miss near a tie (small margin) is irreducible at T = 0
        "target_top1_margin": top2[:, 0] - top2[:, 1],
        "draft_topk_ids": draft_logits.topk(top_k, dim=-1).indices,
        "target_topk_ids": target_logits.topk(top_k, dim=-1).indices,
    }
    return {name: value.cpu().tolist() for name, value in columns.items()}


_COLUMNS = (
    "target_prob_of_draft",
    "draft_prob_of_target",
    "target_rank_in_draft",
    "kl_target_draft",
    "total_variation",
    "target_entropy",
    "target_top1_margin",
    "draft_topk_ids",
    "target_topk_ids",
)
