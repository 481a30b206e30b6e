"""The speculative schedule, written once: how many tokens a step may draft and where a stop token cuts it.

The live loop (:mod:`dflash_doctor.engine.live`) runs this schedule on a real target; teacher-forced
replay (:mod:`dflash_doctor.engine.teacher`) walks the same schedule over known matches. Sharing these
two rules is what makes teacher-forced replay reproduce the live loop's steps exactly (tested).
"""

from __future__ import annotations

from typing import Iterable


def draft_budget(k: int, max_new_tokens: int, position: int) -> int:
    """Tokens the step at ``position`` (output tokens committed before it) may draft.

    Capped at ``remaining - 1`` so the step's bonus token still fits: a step never drafts past
    ``max_new_tokens``. The last step of a request may therefore draft 0 tokens (a plain decode step,
    which vLLM does not count as a draft).
    """
    return min(k, max_new_tokens - position - 1)


def cut_at_stop(accepted: Iterable[int], stop_ids: frozenset[int]) -> int | None:
    """Index of the first stop token among the accepted draft tokens, None when there is none.

    An accepted stop token ends the request: the step accepts up to and including it, nothing after it
    is compared, and no bonus token follows.
    """
    for index, token in enumerate(accepted):
        if token in stop_ids:
            return index
    return None
