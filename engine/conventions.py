"""How a speculative loop drafts and counts the last steps of a request: the engine's convention.

Two loops agree step for step everywhere except at the end of a request (issue 12, measured on the demo
pair: equal outputs, equal acceptance on every full-block step, different figures on the last ones):

* ``vllm`` (vLLM and SGLang, and this tool by default): every step drafts a full block of K; verification
  uses only the ``min(K, remaining - 1)`` drafts that fit the budget. A draft stop token that is accepted
  ends the request and counts as an accepted draft (the step emitted ``accepted + 1`` tokens up to it).
* ``official`` (PyPI ``dflash`` ``dflash_generate``): the last blocks shrink to ``min(K, remaining)``
  drafts, which changes a block drafter's guesses (every slot attends to the whole block), and a step
  that stops on an accepted draft counts the tokens produced up to and including the stop token, so the
  stop token takes the bonus token's place in that step's acceptance length.

A run records which convention it used (``run.json`` config ``end_of_request``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_doctor.errors import UsageError


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
