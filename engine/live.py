"""The real speculative loop: prefill, draft, verify, commit accepted tokens plus the bonus, roll back.

One sequence at a time, as a user's request is served. Each step:

1. the proposer drafts k tokens after the last committed token (``last``, not yet in the target cache);
2. the target scores ``[last, d1..dk]`` in one forward (k + 1 rows of logits);
3. the acceptance rule keeps ``d1..dn`` and yields the next token (bonus or replacement);
4. both KV caches are cropped to the committed length; the proposer receives the committed rows.

The schedule (the draft budget, the stop-token cut and what the last step counts) lives in
:mod:`dflash_doctor.engine.schedule`; teacher-forced replay (:mod:`dflash_doctor.engine.teacher`) walks
the same one. The target's forwards tap the hidden states the proposer declares in ``proposer.needs``:
the loop reads the declaration, nobody wires it into the target. Lossless: at temperature 0 the
output equals :func:`plain_generate`'s token for token; under sampling it has the target's distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from dflash_doctor.engine.attention import engine_attention
from dflash_doctor.engine.divergence import TargetRows, divergence_tensor, unpack_divergence
from dflash_doctor.engine.proposers.base import Proposer
from dflash_doctor.engine.step_records import StepRecord, TokenRecord
from dflash_doctor.engine.schedule import CONVENTIONS, EndOfRequest, cut_at_stop
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.verify import greedy_accept, rejection_sample


def sample_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, else a draw from softmax(logits / T)."""
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
    """The target's own decoding, one token per forward: the reference the speculative loop must equal."""
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
    """Generate with speculative decoding; ``k`` draft tokens per step (capped by the proposer's max_k).

    ``convention`` decides the drafts, the block length and the count of the last steps
    (:mod:`dflash_doctor.engine.schedule`); by default every draft stays inside the budget, the rule whose
    teacher-forced replay needs no tokens past the end."""
    if proposer.max_k is not None:
        k = min(k, proposer.max_k)
    device = target.device
    started = time.perf_counter()
    target.reset()
    taps = proposer.needs.hidden_state_indices
    prefill = target.forward(prompt_ids, taps=taps, logits_from=len(prompt_ids) - 1)
    proposer.start(prompt_ids, prefill.features)
    last = sample_token(prefill.logits[-1], temperature, generator)
    output = [last]
    steps: list[StepRecord] = []
    clock = StepClock(device)
    marks: list[tuple] = []  # (draft start, draft end = verify start, verify end) of each step
    # per-token records stay on the device until the request ends: one host copy per request
    pending: list[
        tuple[torch.Tensor, int, int, list[int], int]
    ] = []  # (packed rows, step, position, drafted, accepted)
    reason = "stop_token" if last in stop_ids else "max_new_tokens"
    tail: list[int] = []
    while reason != "stop_token" and len(output) < max_new_tokens:
        position = len(output)  # output tokens committed before this step
        k_step = convention.draft_budget(k, max_new_tokens, position)
        t0 = clock.mark()  # after the previous step's record kernels in the stream: they are not draft time
        proposal = proposer.propose(last, k_step, convention.block_k(k, max_new_tokens - position))
        n_drafted = len(proposal.tokens)  # a lookup proposer may offer fewer than k_step (none: a plain decode step)
        t1 = clock.mark()
        block = torch.cat([torch.tensor([last], device=device), proposal.tokens.to(device)])
        verified = target.forward(block, taps=taps)  # logits [n_drafted + 1, V]
        t2 = clock.mark()
        marks.append((t0, t1, t2))
        if temperature <= 0:
            run, next_token = greedy_accept(proposal.tokens, verified.logits)
        else:
            target_probs = torch.softmax(verified.logits / temperature, dim=-1)
            run, next_token = rejection_sample(proposal.tokens, target_probs, proposal.probs, generator)
        drafted = proposal.tokens.tolist()
        accepted = drafted[:run][: max_new_tokens - position]  # the output keeps what fits the budget
        stop_at = cut_at_stop(accepted, stop_ids)
        if stop_at is not None:  # an accepted stop token ends the request; nothing after it enters the output
            accepted = accepted[: stop_at + 1]
        num_accepted = convention.num_accepted(run, stop_at)
        num_committed_drafts = len(accepted)
        committed = 1 + num_committed_drafts  # last + accepted drafts enter the context
        target.crop(target.cache_length - (n_drafted + 1) + committed)
        features = verified.features[:committed] if verified.features is not None else None
        proposer.accept(block[:committed], features)
        output.extend(accepted)
        bonus = -1
        if stop_at is not None:
            reason = "stop_token"
        elif len(output) < max_new_tokens:  # else the bonus token lies past the budget: the output ends without it
            output.append(next_token)
            bonus = next_token
            last = next_token
            if next_token in stop_ids:
                reason = "stop_token"
        # what the step sampled that the output does not keep: past the end, on the last step (vLLM's suffix
        # cache keeps it with the response)
        tail = (drafted[:run] + [next_token])[len(accepted) + (bonus != -1) :] if convention.drafts_past_end else []
        steps.append(
            StepRecord(
                step=len(steps),
                position=position,
                k=k,
                num_drafted=n_drafted,
                num_accepted=num_accepted,
                bonus_token=bonus,
            )
        )
        if record_tokens and n_drafted:
            target_rows = TargetRows.of(verified.logits[:n_drafted])
            packed = divergence_tensor(proposal.logits, proposal.tokens, target_rows)
            packed = torch.cat([packed, target_rows.tokens[:, None].to(packed.dtype)], dim=1)
            pending.append((packed, len(steps) - 1, position, drafted, num_committed_drafts))
    output = output[:max_new_tokens]
    steps = [
        replace(step, draft_time_s=clock.seconds(t0, t1), verify_time_s=clock.seconds(t1, t2))
        for step, (t0, t1, t2) in zip(steps, marks)
    ]
    tokens = [t for t in _token_rows(pending) if t.position < max_new_tokens]  # drafts past the budget are no output
    return GenerationResult(
        output_ids=output,
        stop_reason=reason,
        wall_time_s=time.perf_counter() - started,
        steps=steps,
        tokens=tokens,
        tail_ids=tail,
    )


def _token_rows(pending: list[tuple[torch.Tensor, int, int, list[int], int]]) -> list[TokenRecord]:
    """The token records of a request from its steps' packed divergence rows, copied to the host at once."""
    if not pending:
        return []
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
