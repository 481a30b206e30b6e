"""Acceptance rules as pure tensor functions (Leviathan et al. 2023; Chen et al. 2023).

Convention (as gpt-fast): ``p`` is the TARGET distribution, ``q`` the DRAFT distribution. A draft
token x is accepted with probability min(1, p(x) / q(x)); on rejection the replacement is drawn from
the normalised residual max(p - q, 0). This keeps the output distributed exactly as the target's.
A greedy draft (DFlash, and vLLM/SGLang drafts in general) is the one-hot case q = 1[x]: accept with
p(x), resample from p with x removed. If all k drafts pass, a bonus token is drawn from the target's
distribution at slot k, so every step emits at least one token.

All functions return ``(num_accepted, next_token)``; ``next_token`` is the bonus or the replacement.
"""

from __future__ import annotations

import torch


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Temperature 0: accept the longest prefix equal to the target's argmax; the bonus is the argmax after it.

    Args:
        draft_tokens: [k] long, the drafted tokens.
        target_logits: [k + 1, V] the target's scores of the verified block; row i scores the token after
            block[:i + 1] (the block being the last committed token and the drafts).

    Returns:
        (num_accepted, next_token): the accepted prefix's length 0..k, and the target's argmax after it
        (the bonus when all k pass, else the replacement of the first rejected draft).
    """
    posterior = target_logits.argmax(dim=-1)  # [k + 1]
    k = draft_tokens.shape[0]
    matches = (draft_tokens == posterior[:k]).to(torch.int64)
    num_accepted = int(matches.cumprod(dim=0).sum().item()) if k else 0
    return num_accepted, int(posterior[num_accepted].item())


def rejection_sample(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Lossless speculative sampling: the emitted tokens are distributed exactly as the target's.

    A greedy draft is the one-hot case, where min(1, p/q) = p(x) and the residual is p with x zeroed.

    Args:
        draft_tokens: [k] long, the drafted tokens x.
        target_probs: [k + 1, V] the target's distributions p, row i for draft i, row k for the bonus.
        draft_probs: [k, V] the distributions q the drafts were sampled from, or None for a greedy
            (one-hot) draft.
        generator: the random generator for the uniform draws and the resampling; None uses torch's.

    Returns:
        (num_accepted, next_token): the accepted prefix's length 0..k, and the bonus token drawn from row
        k when all pass, else the replacement drawn from the normalised residual max(p - q, 0) of the first
        rejected slot.
    """
    k = draft_tokens.shape[0]
    rows = torch.arange(k, device=draft_tokens.device)
    p_x = target_probs[rows, draft_tokens]  # [k]
    if draft_probs is None:
        accept_prob = p_x
    else:
        q_x = draft_probs[rows, draft_tokens]
        accept_prob = torch.clamp(p_x / q_x.clamp_min(1e-30), max=1.0)
    u = torch.rand(k, generator=generator, device=accept_prob.device, dtype=accept_prob.dtype)
    rejected = (u >= accept_prob).nonzero()
    if rejected.numel() == 0:
        bonus = torch.multinomial(target_probs[k], 1, generator=generator)
        return k, int(bonus.item())
    n = int(rejected[0].item())
    if draft_probs is None:
        residual = target_probs[n].clone()
        residual[draft_tokens[n]] = 0.0
    else:
        residual = (target_probs[n] - draft_probs[n]).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: any draw from p is exact
        residual, total = target_probs[n], target_probs[n].sum()
    replacement = torch.multinomial(residual / total, 1, generator=generator)
    return n, int(replacement.item())
