"""The speculative schedule, written once: where a stop token cuts a step, and how the engine being modelled
drafts and counts the last steps of a request (:class:`EndOfRequest`).

The live loop (:mod:`dflash_doctor.engine.live`) runs this schedule on a real target; teacher-forced
replay (:mod:`dflash_doctor.engine.teacher`) walks the same schedule over known matches. Sharing these
two rules is what makes teacher-forced replay reproduce the live loop's steps exactly (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from dflash_doctor.errors import UsageError


def cut_at_stop(accepted: Iterable[int], stop_ids: frozenset[int]) -> int | None:
    """Index of the first stop token among the accepted draft tokens, where the step and the request end.

    An accepted stop token ends the request: the output keeps the drafts up to and including it and no
    bonus token follows (how many drafts the step counts is the convention's:
    :meth:`EndOfRequest.num_accepted`).

    Args:
        accepted: the step's accepted draft tokens, in order.
        stop_ids: the token ids that end a request.

    Returns:
        The 0-based index of the first stop token in ``accepted``, None when there is none.

    Example: drafts 7, 2, 9, 2 accepted with stop tokens {2, 5}: the request ends at the first 2, and the
    9 after it never enters the output.

    >>> cut_at_stop([7, 2, 9, 2], frozenset({2, 5}))
    1
    >>> cut_at_stop([7, 9], frozenset({2})) is None
    True
    """
    for index, token in enumerate(accepted):
        if token in stop_ids:
            return index
    return None


# ---------------------------------------------------------------------------------------------------
# The end of a request: the engine's convention
#
# Loops agree step for step everywhere except at the end of a request (measured on the demo pair: equal
# outputs, equal acceptance on every full-block step, different figures on the last ones):
#
# * ``vllm`` (vLLM 0.32, and this tool by default): every step drafts K, however few tokens the request has
#   left: vLLM's scheduler trims a step's drafts only for the token budget and the model length
#   (``v1/core/sched/scheduler.py`` ``schedule``), never for ``max_tokens``. Its rejection sampler knows no
#   stop tokens nor ``max_tokens``: a step counts every draft it accepts (``num_accepted =
#   len(generated) - 1`` in ``update_from_output``), past an accepted stop token and past ``max_tokens``,
#   and the output is cut afterwards (``_update_request_with_output``). So the step that writes a request's
#   last token drafts K (even with one token left) and counts the drafts that equal the target's greedy
#   tokens past the answer's end; a replay needs those tokens (``TeacherSequence.tail_ids``).
# * ``llamacpp`` (llama.cpp's server, ``get_n_draft_max``): a step drafts at most ``remaining - 1`` tokens,
#   so its bonus token still fits, and an accepted stop token ends the count (the step counts the drafts
#   up to and including it). The step with one token left is a plain decode step (no draft).
# * ``official`` (PyPI ``dflash`` ``dflash_generate``): drafts as ``llamacpp``, but the last blocks shrink
#   to ``min(K, remaining)`` slots, which changes a block drafter's guesses (every slot attends to the
#   whole block), and a step that stops on an accepted draft counts the tokens produced up to and
#   including the stop token, so the stop token takes the bonus token's place in that step's acceptance
#   length.
#
# A run records which convention it used (``run.json`` config ``end_of_request``).


@dataclass(frozen=True)
class EndOfRequest:
    name: str
    shrink_last_block: bool  # block of min(K, remaining) drafts instead of K
    stop_replaces_bonus: bool  # an accepted stop draft is the step's last counted token
    drafts_past_end: bool  # drafts K to the end and counts accepted drafts past max_tokens and a stop token

    def draft_budget(self, k: int, max_new_tokens: int, position: int) -> int:
        """Tokens the step at ``position`` (output tokens committed before it) may draft: K, or, for a loop that
        keeps every draft inside the budget, ``remaining - 1`` so that the step's bonus token still fits
        (the last step may then draft 0 tokens: a plain decode step, which no engine counts as a draft).

        Example: K = 4 and a budget of 10 tokens. At position 8 (two tokens left) vLLM drafts 4 anyway,
        while llama.cpp and the official loop draft 1, so that the step's bonus token is the tenth; at
        position 9 (one left) they draft none.

        >>> [CONVENTIONS[name].draft_budget(4, 10, 8) for name in ("vllm", "llamacpp", "official")]
        [4, 1, 1]
        >>> [CONVENTIONS[name].draft_budget(4, 10, 9) for name in ("vllm", "llamacpp", "official")]
        [4, 0, 0]
        """
        return k if self.drafts_past_end else min(k, max_new_tokens - position - 1)

    def block_k(self, k: int, remaining: int) -> int:
        """Block length (drafted slots) of a step with ``remaining`` tokens left in the budget.

        Example: K = 4 with two tokens left: only the official loop shrinks the block to 2 slots (a block
        drafter's guesses then change, every slot attending to the whole block).

        >>> [CONVENTIONS[name].block_k(4, 2) for name in ("vllm", "llamacpp", "official")]
        [4, 4, 2]
        """
        return min(k, remaining) if self.shrink_last_block else k

    def num_accepted(self, run: int, stop_at: int | None) -> int:
        """``num_accepted`` of a step whose drafts match for ``run`` tokens and whose accepted drafts hold a
        stop token at index ``stop_at`` (None: none).

        Example: drafts d1 d2 d3 all match (run 3) and d2 is a stop token (index 1). vLLM counts all three,
        llama.cpp the drafts up to and including the stop token, the official loop one (the stop token
        takes the bonus token's place); without a stop token all three count 3.

        >>> [CONVENTIONS[name].num_accepted(3, 1) for name in ("vllm", "llamacpp", "official")]
        [3, 2, 1]
        >>> [CONVENTIONS[name].num_accepted(3, None) for name in ("vllm", "llamacpp", "official")]
        [3, 3, 3]
        """
        if stop_at is None or self.drafts_past_end:
            return run
        return stop_at if self.stop_replaces_bonus else stop_at + 1


CONVENTIONS = {
    "vllm": EndOfRequest("vllm", shrink_last_block=False, stop_replaces_bonus=False, drafts_past_end=True),
    "llamacpp": EndOfRequest("llamacpp", shrink_last_block=False, stop_replaces_bonus=False, drafts_past_end=False),
    "official": EndOfRequest("official", shrink_last_block=True, stop_replaces_bonus=True, drafts_past_end=False),
}


def end_of_request(name: str) -> EndOfRequest:
    """The end-of-request convention a run names (``run.json`` config ``end_of_request``), by its name.

    Args:
        name: ``vllm``, ``llamacpp`` or ``official`` (the keys of :data:`CONVENTIONS`).

    Returns:
        The convention of that name.

    Raises:
        UsageError: when ``name`` is not one of them.
    """
    try:
        return CONVENTIONS[name]
    except KeyError:
        raise UsageError(
            f"end_of_request {name!r} is not one of {', '.join(CONVENTIONS)}; pick the engine you serve with."
        ) from None
