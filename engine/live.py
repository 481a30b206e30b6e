"""The real speculative loop: prefill, draft, verify, commit accepted tokens plus the bonus, roll back.

One sequence at a time, as a user's request is served. Each step (:func:`speculative_step`, the lossless core):

1. the proposer drafts k tokens after the last committed token (``last``, not yet in the target cache);
2. the target scores ``[last, d1..dk]`` in one forward (k + 1 rows of logits);
3. the acceptance rule keeps ``d1..dn`` and yields the next token (bonus or replacement);
4. both KV caches are cropped to the committed length; the proposer receives the committed rows.

The loop around the steps (:func:`speculative_generate`) walks the schedule, counts each step, times
it and packs its records; only the step decides tokens.

The schedule (the draft budget, the stop-token cut and what the last step counts) lives in
:mod:`dflash_doctor.engine.schedule`; teacher-forced replay (:mod:`dflash_doctor.engine.teacher`) walks
the same one. The target's forwards tap the hidden states the proposer declares in ``proposer.needs``:
the loop reads the declaration, nobody wires it into the target. Lossless: at temperature 0 the
output equals :func:`plain_generate`'s token for token; under sampling it has the target's distribution.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from dflash_doctor.engine.attention import engine_attention
from dflash_doctor.engine.divergence import TargetRows, divergence_tensor, unpack_divergence
from dflash_doctor.engine.proposers.base import Proposal, Proposer
from dflash_doctor.engine.step_records import StepRecord, TokenRecord
from dflash_doctor.engine.schedule import CONVENTIONS, EndOfRequest, cut_at_stop
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.verify import greedy_accept, rejection_sample


def sample_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The next token from the target's scores: greedy at temperature 0, else a draw from softmax(logits / T).

    Args:
        logits: [V] the target's scores of the next token.
        temperature: 0 (or below) for the argmax, above 0 for a draw.
        generator: the random generator of the draw; None uses torch's.

    Returns:
        The token id.
    """
    if temperature <= 0:
        return int(logits.argmax().item())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


class StepClock:
    """The draft and verify time of each step, read without stalling the GPU.

    On a GPU a mark is a CUDA event recorded in the stream, and the times are read once, when the request
    ends: a host synchronisation per mark (the plain way to time GPU work from the host) would stop the
    host from queueing the target's forward while the draft still runs, and those launches are a large
    part of a step on a fast GPU. The times are the GPU's time between the marks (launch gaps included).
    On a CPU a mark is the host clock.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> "torch.cuda.Event | float":
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: "torch.cuda.Event | float", end: "torch.cuda.Event | float") -> float:
        """Seconds between two marks (on a GPU, after ``end`` has completed: call once the request is over)."""
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        assert isinstance(start, float) and isinstance(end, float), "marks of one clock are of one kind"
        return end - start


@dataclass
class GenerationResult:
    """Output of one request: committed tokens and, for speculative runs, per-step and per-token records.

    ``tail_ids``: the target's tokens past the answer's end, under a convention that drafts past it
    (:mod:`dflash_doctor.engine.schedule`): the greedy ones a teacher-forced replay verifies the last step's drafts
    against, or what the live loop's last step sampled past the end."""

    output_ids: list[int]
    stop_reason: str  # "stop_token" | "max_new_tokens"
    wall_time_s: float
    steps: list[StepRecord] = field(default_factory=list)
    tokens: list[TokenRecord] = field(default_factory=list)
    tail_ids: list[int] = field(default_factory=list)


@engine_attention
@torch.inference_mode()
def plain_generate(
    target: TargetModel,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """The target's own decoding, one token per forward: the reference the speculative loop must equal.

    Args:
        target: the target model.
        prompt_ids: [P] the prompt's token ids.
        max_new_tokens: the output's budget in tokens, >= 1.
        temperature: 0 for greedy decoding, above 0 to sample.
        stop_ids: the token ids that end a request.
        generator: the random generator of the draws; None uses torch's.

    Returns:
        The output and its stop reason (no step records: there are no steps).
    """
    started = time.perf_counter()
    target.reset()
    logits = target.forward(prompt_ids, taps=(), logits_from=len(prompt_ids) - 1).logits[-1]
    output: list[int] = []
    while True:
        token = sample_token(logits, temperature, generator)
        output.append(token)
        if token in stop_ids:
            reason = "stop_token"
            break
        if len(output) >= max_new_tokens:
            reason = "max_new_tokens"
            break
        logits = target.forward(torch.tensor([token], device=target.device), taps=()).logits[-1]
    return GenerationResult(output_ids=output, stop_reason=reason, wall_time_s=time.perf_counter() - started)


@dataclass(frozen=True)
class Step:
    """What one speculative step decided (:func:`speculative_step`): the lossless core's answer to the loop.

    The output grows by :attr:`emitted`; the loop reads the rest to count the step under its convention
    (``run``, ``stop_at``), to keep what the step sampled past the end (:attr:`past_output`) and to pack
    the token records (``proposal``, ``verify_logits``)."""

    proposal: Proposal  # the drafts, with the draft's logits the token records compare
    verify_logits: torch.Tensor  # [len(drafted) + 1, V] the target's scores of [last, d1..dk]
    drafted: list[int]
    run: int  # drafts the acceptance rule kept, past the budget and a stop token included
    accepted: list[int]  # the drafts the output keeps: the run cut to the budget and after a stop token
    stop_at: int | None  # index of the accepted stop token (cut_at_stop), None when there is none
    next_token: int  # the target's token after the run: the bonus, or the first rejected draft's replacement
    bonus_token: int  # next_token where the output keeps it, -1 where a stop token or the budget ended it
    marks: tuple  # the clock's (draft start, draft end = verify start, verify end)

    @property
    def emitted(self) -> list[int]:
        """The tokens the step adds to the output: the accepted drafts and the bonus token it keeps."""
        return self.accepted + ([self.bonus_token] if self.bonus_token != -1 else [])

    @property
    def past_output(self) -> list[int]:
        """What the step sampled that the output does not keep (past a stop token or the budget)."""
        return (self.drafted[: self.run] + [self.next_token])[len(self.emitted) :]


def speculative_step(
    target: TargetModel,
    proposer: Proposer,
    last: int,
    *,
    k_step: int,
    block_k: int,
    room: int,
    temperature: float,
    stop_ids: frozenset[int],
    generator: torch.Generator | None,
    clock: StepClock,
) -> Step:
    """One step of the lossless core, as gpt-fast's ``speculative_decode``: draft, verify, accept, commit.

    The loop around it (:func:`speculative_generate`) decides the schedule and keeps the records; this
    function alone decides which tokens are committed, which is what makes the loop lossless. ``clock``
    marks the step's phases in the stream (before the draft, between draft and verify, after the verify)
    so that the loop times them without a host synchronisation.

    Args:
        target: the target, its cache holding the committed context up to, not including, ``last``.
        proposer: the draft, started on the same context (:meth:`Proposer.start`).
        last: the last committed token, not yet in the target's cache.
        k_step: most tokens the step may draft (the schedule's :meth:`EndOfRequest.draft_budget`); a
            lookup proposer may offer fewer, none making this a plain decode step.
        block_k: the step's block length (:meth:`EndOfRequest.block_k`), >= ``k_step``.
        room: output tokens the budget still allows, >= 1.
        temperature: 0 accepts the drafts matching the target's argmax, above 0 by rejection sampling.
        stop_ids: the token ids that end a request.
        generator: the random generator of rejection sampling; None uses torch's.
        clock: the loop's clock, marked before the draft, between draft and verify, and after the verify.

    Returns:
        The step's decisions. Both caches then hold ``last`` and the accepted drafts (the committed
        tokens): the target's is cropped to them, and the proposer has received them with their features.
    """
    t0 = clock.mark()
    proposal = proposer.propose(last, k_step, block_k)
    t1 = clock.mark()
    block = torch.cat([torch.tensor([last], device=target.device), proposal.tokens.to(target.device)])
    verified = target.forward(block, taps=proposer.needs.hidden_state_indices)  # logits [len(block), V]
    t2 = clock.mark()
    if temperature <= 0:
        run, next_token = greedy_accept(proposal.tokens, verified.logits)
    else:
        target_probs = torch.softmax(verified.logits / temperature, dim=-1)
        run, next_token = rejection_sample(proposal.tokens, target_probs, proposal.probs, generator)
    drafted = proposal.tokens.tolist()
    accepted = drafted[:run][:room]  # the output keeps what fits the budget
    stop_at = cut_at_stop(accepted, stop_ids)
    if stop_at is not None:  # an accepted stop token ends the request; nothing after it enters the output
        accepted = accepted[: stop_at + 1]
    committed = 1 + len(accepted)  # last + accepted drafts enter the context
    target.crop(target.cache_length - len(block) + committed)
    proposer.accept(block[:committed], verified.features[:committed] if verified.features is not None else None)
    # the next token ends the output where a stop token or the budget came first: it lies past the end
    bonus = next_token if stop_at is None and len(accepted) < room else -1
    return Step(proposal, verified.logits, drafted, run, accepted, stop_at, next_token, bonus, (t0, t1, t2))


@torch.inference_mode()
@engine_attention
def speculative_generate(
    target: TargetModel,
    proposer: Proposer,
    prompt_ids: torch.Tensor,
    *,
    k: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    record_tokens: bool = True,
    convention: EndOfRequest = CONVENTIONS["llamacpp"],
) -> GenerationResult:
    """Generate with speculative decoding: :func:`speculative_step` until a stop token or the budget, recorded.

    The loop walks the schedule (each step's draft budget and block length), counts each step under the
    convention, times it and packs its token records; the step decides the tokens.

    Args:
        target: the target model.
        proposer: the draft, which the loop starts on the prompt.
        prompt_ids: [P] the prompt's token ids.
        k: draft tokens per step (capped by the proposer's ``max_k``).
        max_new_tokens: the output's budget in tokens, >= 1.
        temperature: 0 for greedy decoding, above 0 to sample (rejection sampling keeps the target's
            distribution).
        stop_ids: the token ids that end a request.
        generator: the random generator of the target's and the acceptance's draws; None uses torch's.
        record_tokens: whether to pack one :class:`TokenRecord` per drafted token.
        convention: the engine whose end of a request is modelled: it decides the drafts, the block length
            and the count of the last steps (:mod:`dflash_doctor.engine.schedule`); by default every draft
            stays inside the budget, the rule whose teacher-forced replay needs no tokens past the end.

    Returns:
        The output, its stop reason, one :class:`StepRecord` per step (timed), the token records of the
        drafts inside the budget, and (under a convention that drafts past the end) what the last step
        sampled past it.
    """
    if proposer.max_k is not None:
        k = min(k, proposer.max_k)
    started = time.perf_counter()
    target.reset()
    prefill = target.forward(prompt_ids, taps=proposer.needs.hidden_state_indices, logits_from=len(prompt_ids) - 1)
    proposer.start(prompt_ids, prefill.features)
    output = [sample_token(prefill.logits[-1], temperature, generator)]
    steps: list[StepRecord] = []
    clock = StepClock(target.device)
    marks: list[tuple] = []  # (draft start, draft end = verify start, verify end) of each step
    records = torch.cuda.Stream(target.device) if record_tokens and clock.cuda else None
    # per-token records stay on the device until the request ends: one host copy per request
    pending: list[tuple[torch.Tensor, int, int, list[int], int]] = []  # (packed, step, position, drafted, accepted)
    tail: list[int] = []
    while output[-1] not in stop_ids and len(output) < max_new_tokens:
        position = len(output)  # output tokens committed before this step
        step = speculative_step(
            target,
            proposer,
            output[-1],
            k_step=convention.draft_budget(k, max_new_tokens, position),
            block_k=convention.block_k(k, max_new_tokens - position),
            room=max_new_tokens - position,
            temperature=temperature,
            stop_ids=stop_ids,
            generator=generator,
            clock=clock,
        )
        output.extend(step.emitted)
        # vLLM's suffix cache keeps what the last step sampled past the end with the response
        tail = step.past_output if convention.drafts_past_end else []
        num_accepted = convention.num_accepted(step.run, step.stop_at)
        steps.append(StepRecord(len(steps), position, k, len(step.drafted), num_accepted, step.bonus_token))
        marks.append(step.marks)
        if record_tokens and step.drafted:
            pending.append((_packed_rows(step, records), len(steps) - 1, position, step.drafted, len(step.accepted)))
    reason = "stop_token" if output[-1] in stop_ids else "max_new_tokens"
    steps = [
        replace(record, draft_time_s=clock.seconds(t0, t1), verify_time_s=clock.seconds(t1, t2))
        for record, (t0, t1, t2) in zip(steps, marks)
    ]
    tokens = [t for t in _token_rows(pending, records) if t.position < max_new_tokens]  # drafts past the budget
    return GenerationResult(
        output_ids=output[:max_new_tokens],
        stop_reason=reason,
        wall_time_s=time.perf_counter() - started,
        steps=steps,
        tokens=tokens,
        tail_ids=tail,
    )


def _packed_rows(step: Step, records: "torch.cuda.Stream | None") -> torch.Tensor:
    """The step's token records on the device: the divergence columns of each draft, then the target's token.

    On a GPU they are packed on the side stream ``records``, so that the next step's draft, queued in the
    main stream, does not wait for them (packed in the main stream they cost 6.7 ms per step on an H200;
    the overlap is not measured yet). The side stream first waits for the main stream, which
    wrote the logits, and the logits are marked as in use there (``record_stream``), so the allocator gives
    their memory to the main stream's next step only once the packing has read it. The clock's marks stay
    where they were, in the main stream; the packing no longer sits between one step's verify and the next
    step's first mark, and may run beside the draft. The records are the same kernels on the same tensors;
    on a CPU (``records`` None) the same calls in the same order.
    """
    if records is None:
        return _pack(step)
    records.wait_stream(torch.cuda.current_stream(records.device))
    with torch.cuda.stream(records):
        packed = _pack(step)
    for tensor in (step.proposal.logits, step.proposal.tokens, step.verify_logits):
        tensor.record_stream(records)
    return packed


def _pack(step: Step) -> torch.Tensor:
    target_rows = TargetRows.of(step.verify_logits[: len(step.drafted)])
    packed = divergence_tensor(step.proposal.logits, step.proposal.tokens, target_rows)
    return torch.cat([packed, target_rows.tokens[:, None].to(packed.dtype)], dim=1)


def _token_rows(
    pending: list[tuple[torch.Tensor, int, int, list[int], int]], records: "torch.cuda.Stream | None"
) -> list[TokenRecord]:
    """The token records of a request from its steps' packed divergence rows, copied to the host at once.

    On a GPU the copy runs in the stream that packed the rows (``records``), after them."""
    if not pending:
        return []
    with torch.cuda.stream(records) if records is not None else contextlib.nullcontext():
        host = torch.cat([packed for packed, *_ in pending]).cpu().numpy()
    columns = unpack_divergence(host[:, :-1])
    target_list = host[:, -1].astype(np.int64).tolist()
    tokens: list[TokenRecord] = []
    for _, step, position, drafted, num_committed_drafts in pending:
        for i in range(len(drafted)):
            flat = len(tokens)
            tokens.append(
                TokenRecord(
                    step=step,
                    position=position + i,
                    offset=i + 1,
                    draft_token=drafted[i],
                    target_token=target_list[flat],
                    accepted=i < num_committed_drafts,
                    **{name: values[flat] for name, values in columns.items()},
                )
            )
    return tokens
