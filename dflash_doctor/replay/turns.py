"""The one turn loop: every prompt the replay sends is encoded here, and every answer decoded here.

A request has one turn per trailing user message (MT-Bench style): turn t + 1 is asked after the
target's OWN answer to turn t, as a client of vLLM / SGLang would send it (the answer goes back as text
and the conversation is rendered again with the chat template). Each turn is generated under the
request's own ``max_new_tokens`` (capped by ``--max-new-tokens``), and the next turn's prompt is built
from exactly the answer that was recorded.

Live and teacher-forced replay share this loop and differ only in ``generate``: the live loop drafts
and verifies one sequence at a time; teacher-forced replay generates the target's continuations in
batches. Turns are generated turn-major inside a chunk of requests (a batch holds turn t of several
requests) and handed out request by request, so rows stream to the run directory as requests finish.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from dflash_doctor.engine.live import GenerationResult
from dflash_doctor.errors import UsageError
from dflash_doctor.models.pair import Pair
from dflash_doctor.inputs.workloads import Request, encode_request_turn
from dflash_doctor.rundir.tables import turn_row_id


@dataclass(frozen=True)
class PendingTurn:
    """A turn ready to generate: its request, index, prompt ids and token limit."""

    request: Request
    index: int
    prompt_ids: list[int]
    max_new_tokens: int


@dataclass
class Turn:
    """A generated turn: the prompt sent and the target's answer (plus the live loop's steps and
    token rows, or the teacher-forced ones once annotated)."""

    request: Request
    index: int
    prompt_ids: list[int]
    max_new_tokens: int
    result: GenerationResult

    @property
    def key(self) -> str:
        """Row id in the steps/tokens tables (:func:`~dflash_doctor.rundir.tables.turn_row_id`)."""
        return turn_row_id(self.request.id, self.index)

    @property
    def output_ids(self) -> list[int]:
        return self.result.output_ids


GenerateBatch = Callable[[Sequence[PendingTurn]], list[GenerationResult]]


def turn_limit(request: Request, max_new_tokens: int) -> int:
    """A request's own limit, bounded by --max-new-tokens so the CLI flag always caps run time."""
    return min(request.max_new_tokens or max_new_tokens, max_new_tokens)


def answer_text(pair: Pair, output_ids: Sequence[int]) -> str:
    """The answer as the client sends it back: stop tokens dropped, special tokens skipped."""
    return pair.tokenizer.decode([t for t in output_ids if t not in pair.stop_ids], skip_special_tokens=True)


def first_turn_prompt(pair: Pair, request: Request) -> list[int]:
    """The prompt ids of a request's first turn, encoded once before any prefill (checked against the context)."""
    return encode_request_turn(pair.tokenizer, request, [], chat_template=pair.chat_template)


def refuse_past_context(
    pair: Pair, request: Request, index: int, prompt_ids: Sequence[int], max_new_tokens: int
) -> None:
    """Refuse a turn whose prompt plus token limit runs past the target's positions
    (``max_position_embeddings``), before its prefill: past them the model has no position to give
    (an error, or a prefill that never finishes), and a serving engine refuses such a request too."""
    limit = getattr(pair.target.model.config, "max_position_embeddings", None)
    if limit and len(prompt_ids) + max_new_tokens > limit:
        turn = f" turn {index + 1}" if index else ""
        raise UsageError(
            f"request {request.id!r}{turn}: its prompt of {len(prompt_ids)} "
            f"tokens plus up to {max_new_tokens} new tokens "
            f"runs past the target's {limit} positions (max_position_embeddings); shorten the prompt or lower "
            f"--max-new-tokens / the request's max_new_tokens."
        )


def run_turns(
    pair: Pair, requests: Sequence[Request], max_new_tokens: int, generate: GenerateBatch, *, chunk_size: int = 1
) -> Iterator[Turn]:
    """Generate every turn of ``requests``; yields each request's turns, in order, once the request is done.

    ``chunk_size`` requests are generated together, turn by turn; within a turn the pending prompts are
    handed to ``generate`` shortest first (less padding for a batched generator).
    """
    # every first turn is encoded once, here, and checked against the target's positions before any prefill;
    # a later turn's prompt exists only once the answers before it do, and is checked as it is built
    first_prompts = {r.id: first_turn_prompt(pair, r) for r in requests}
    for request in requests:
        refuse_past_context(pair, request, 0, first_prompts[request.id], turn_limit(request, max_new_tokens))
    for start in range(0, len(requests), chunk_size):
        chunk = list(requests[start : start + chunk_size])
        answers: dict[str, list[str]] = {r.id: [] for r in chunk}
        done: dict[tuple[str, int], Turn] = {}
        for index in range(max(r.num_turns for r in chunk)):
            pending = [
                PendingTurn(
                    r,
                    index,
                    first_prompts[r.id]
                    if index == 0
                    else encode_request_turn(pair.tokenizer, r, answers[r.id], chat_template=pair.chat_template),
                    turn_limit(r, max_new_tokens),
                )
                for r in chunk
                if r.num_turns > index
            ]
            if index:
                for item in pending:
                    refuse_past_context(pair, item.request, index, item.prompt_ids, item.max_new_tokens)
            pending.sort(key=lambda p: len(p.prompt_ids))
            for item, result in zip(pending, generate(pending), strict=True):
                done[(item.request.id, index)] = Turn(item.request, index, item.prompt_ids, item.max_new_tokens, result)
                answers[item.request.id].append(answer_text(pair, result.output_ids))
        for request in chunk:
            for index in range(request.num_turns):
                yield done[(request.id, index)]
