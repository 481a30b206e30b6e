"""The speculative schedule, written once: how many tokens a step may draft, where a stop token cuts it,
and how the engine being modelled drafts and counts the last steps of a request (:class:`EndOfRequest`).

The live loop (:mod:`dflash_doctor.engine.live`) runs this schedule on a real target; teacher-forced
replay (:mod:`dflash_doctor.engine.teacher`) walks the same schedule over known matches. Sharing these
two rules is what makes teacher-forced replay reproduce the live loop's steps exactly (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from dflash_doctor.errors import UsageError


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


# ---------------------------------------------------------------------------------------------------
# The end of a request: the engine's convention
#
# Two loops agree step for step everywhere except at the end of a request (measured on the demo
# pair: equal outputs, equal acceptance on every full-block step, different figures on the last ones):
#
# * ``vllm`` (vLLM and SGLang, and this tool by default): every step drafts a full block of K; verification
#   uses only the ``min(K, remaining - 1)`` drafts that fit the budget. A draft stop token that is accepted
#   ends the request and counts as an accepted draft (the step emitted ``accepted + 1`` tokens up to it).
# * ``official`` (PyPI ``dflash`` ``dflash_generate``): the last blocks shrink to ``min(K, remaining)``
#   drafts, which changes a block drafter's guesses (every slot attends to the whole block), and a step
#   that stops on an accepted draft counts the tokens produced up to and including the stop token, so the
#   stop token takes the bonus token's place in that step's acceptance length.
#
# A run records which convention it used (``run.json`` config ``end_of_request``).


@dataclass(frozen=True)
class EndOfRequest:
    name: str
    shrink_last_block: bool  # block of min(K, remaining) drafts instead of K
    stop_replaces_bonus: bool  # an accepted stop draft is the step's last counted token

    def block_k(self, k: int, remaining: int) -> int:
        """Block length (drafted slots) of a step with ``remaining`` tokens left in the budget."""
        return min(k, remaining) if self.shrink_last_block else k

    def accepted_through_stop(self, stop_at: int) -> int:
        """``num_accepted`` of a step whose accepted drafts hold a stop token at index ``stop_at``."""
        return stop_at if self.stop_replaces_bonus else stop_at + 1


CONVENTIONS = {
    "vllm": EndOfRequest("vllm", shrink_last_block=False, stop_replaces_bonus=False),
    "official": EndOfRequest("official", shrink_last_block=True, stop_replaces_bonus=True),
}


def end_of_request(name: str) -> EndOfRequest:
    try:
        return CONVENTIONS[name]
    except KeyError:
        raise UsageError(f"end_of_request {name!r} is not one of {', '.join(CONVENTIONS)}; pick the engine you serve with.") from None
