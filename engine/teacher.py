"""Teacher-forced replay: acceptance for every K from one pass over the known continuation.

Why it is exact at temperature 0: the speculative output is the target's greedy continuation, so the
committed text is known once that continuation is known. A draft token can only be accepted while every
earlier token of its block matched, i.e. while the draft saw exactly the true prefix. So the draft's
guesses under teacher forcing (:meth:`Proposer.slot_logits`) decide every acceptance, and walking the
live loop's schedule (start, accept n, jump n + 1) over them reproduces the live loop's steps for any K:
same draft budget, same stop-token rule, same last step (:mod:`dflash_doctor.engine.schedule`). An engine that
drafts past the end (vLLM) verifies its last step's drafts against the target's greedy tokens past the
answer's end: the replay knows them as the sequence's ``tail_ids`` (generated with the answer, at T = 0).

For a chain (autoregressive) draft one pass answers every K exactly. A block drafter's guesses depend on
its block length; one pass at block K_max is exact for K_max and a *truncated estimate* for smaller K,
unless ``exact_blocks`` asks for one pass per K (each row of the sweep says which it is).

Under sampling (T > 0) a step's acceptance is random; for each anchor of a sampled target trajectory
the probability that slot j is accepted given the earlier ones were is sum(min(p, q)) for a sampled draft
and p(draft token) for a greedy draft, which gives the expected tau(K).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F

from dflash_doctor.engine.batched import generate_greedy_batch
from dflash_doctor.engine.divergence import WIDTH, TargetRows, divergence_tensor, unpack_divergence
from dflash_doctor.engine.proposers.base import Proposer
from dflash_doctor.engine.step_records import StepRecord, TokenRecord
from dflash_doctor.engine.schedule import CONVENTIONS, EndOfRequest, cut_at_stop
from dflash_doctor.engine.target import TargetModel

if TYPE_CHECKING:
    from dflash_doctor.engine.target import CausalLM

ANCHOR_CHUNK = 64  # anchors per draft pass: bounds the [A*B, T + A*B] attention mask on small machines


@dataclass
class SlotTable:
    """Per-anchor guesses for one sequence. Row i is the step whose last committed token is output[i].

    guesses [N, K] draft tokens (-1 where a slot was not evaluated, see :func:`slot_table`'s
    ``full_anchors``); matches [N, K] guess == true token (False past the known output; past an anchor's
    first miss where only its matched run was evaluated); accept_probs [N, K] under sampling (None at
    T = 0); divergence: the packed columns ([rows, divergence.WIDTH] float64) of the recorded (anchor, slot)
    rows whose true token is known, anchor by anchor, and divergence_start: each recorded anchor's first row
    in them. They stay packed: :func:`token_rows` unpacks only the rows its steps draft (the 30k rows of a
    2,048-token sequence with every anchor recorded took 0.1 s of host time as Python lists, more than the
    records' 67 ms of GPU work in benchmarks/context_scaling.py).
    """

    guesses: np.ndarray
    matches: np.ndarray
    accept_probs: np.ndarray | None = None
    divergence: np.ndarray = field(default_factory=lambda: np.zeros((0, WIDTH)))
    divergence_start: dict[int, int] = field(default_factory=dict)
    drafted: np.ndarray | None = None  # [N] slots each anchor's step drafts (Proposer.proposal_lengths); None: all


def matched_runs(matches: np.ndarray) -> np.ndarray:
    """Accepted tokens of each draft: the run of matches before the first miss along the last axis.

    Args:
        matches: [..., K] bool, whether each slot's guess equals the true token: a row [K] or a table
            [N, K] (one row per anchor).

    Returns:
        The run length (0..K; K when none misses) of each row: a 0-d array for a row, [N] for a table.
    """
    return np.cumprod(matches, axis=-1).sum(axis=-1)


def walk_schedule(
    matches: np.ndarray,
    output_ids: list[int],
    k: int,
    max_new_tokens: int,
    stop_ids: frozenset[int],
    convention: EndOfRequest = CONVENTIONS["llamacpp"],
    drafted: np.ndarray | None = None,
) -> list[StepRecord]:
    """The live loop's steps at K over known matches, with the live loop's schedule (engine/schedule.py);
    walked, not timed.

    Slots past the output match only where the table knew the target's tokens there
    (``TeacherSequence.tail_ids``); the default convention keeps every draft inside the budget and needs none.

    Args:
        matches: [N, K'] bool (K' >= k), row i the guesses of the step whose last committed token is
            output[i] (:attr:`SlotTable.matches`).
        output_ids: the target's continuation (output[0] comes from the prefill).
        k: the draft length K asked of every step.
        max_new_tokens: the request's token budget.
        stop_ids: token ids that end the request.
        convention: how the engine modelled drafts and counts the last steps.
        drafted: [N] the tokens each anchor's step may draft at most (a lookup proposer that found fewer
            than K, or none: a plain decode step), as :attr:`SlotTable.drafted` records them; None: K.

    Returns:
        The steps in order, untimed; empty when the first output token is a stop token or the output
        has one token.
    """
    steps: list[StepRecord] = []
    n_out = len(output_ids)
    i = 0  # output index of the last committed token (output[0] comes from the prefill)
    if output_ids[0] in stop_ids:
        return steps
    while i + 1 < max_new_tokens and i + 1 < n_out:
        position = i + 1
        k_step = convention.draft_budget(k, max_new_tokens, position)
        if drafted is not None:
            k_step = min(k_step, int(drafted[i]))
        run = int(matched_runs(matches[i, :k_step]))
        kept = min(run, max_new_tokens - position)  # accepted drafts the output keeps
        stop_at = cut_at_stop(output_ids[i + 1 : i + 1 + kept], stop_ids)
        end = i + 1 + (kept if stop_at is None else stop_at + 1)  # output index after the step's kept drafts
        bonus = output_ids[end] if stop_at is None and end < min(n_out, max_new_tokens) else -1
        steps.append(
            StepRecord(
                step=len(steps),
                position=position,
                k=k,
                num_drafted=k_step,
                num_accepted=convention.num_accepted(run, stop_at),
                bonus_token=bonus,
            )
        )
        if stop_at is not None or bonus == -1 or bonus in stop_ids:
            break
        i = end
    return steps


def greedy_tail(model: CausalLM, prompt_ids: list[int], output_ids: list[int], n: int) -> list[int]:
    """The target's greedy tokens past the output's end (past its stop token or max_tokens): what an engine
    that drafts past the end verifies its last step's drafts against (:attr:`TeacherSequence.tail_ids`).

    Args:
        model: the target causal LM.
        prompt_ids: the request's prompt tokens.
        output_ids: the target's continuation of it, stop token included.
        n: how many tokens past the end; 0 or less for none.

    Returns:
        The ``n`` greedy tokens that follow ``prompt_ids + output_ids`` (no stop token ends them).
    """
    if n <= 0:
        return []
    return generate_greedy_batch(model, [list(prompt_ids) + list(output_ids)], max_new_tokens=n, stop_ids=frozenset())[
        0
    ]


def sampled_past_end(steps: list[StepRecord], tail_ids: list[int], n_out: int) -> list[int]:
    """The tokens a request's last step sampled past its output (the accepted drafts there and the bonus
    token), as far as ``tail_ids`` knows them: vLLM's suffix cache keeps them with the response, as the
    live loop's :attr:`GenerationResult.tail_ids` does.

    Args:
        steps: the request's steps, walked or run.
        tail_ids: the target's greedy tokens past the output's end.
        n_out: the output's length in tokens.

    Returns:
        The first tokens of ``tail_ids`` that the last step reached past ``n_out``; empty when there are no
        steps or the last step ended inside the output.
    """
    if not steps:
        return []
    last = steps[-1]
    return tail_ids[: max(last.position + last.num_accepted + 1 - n_out, 0)]


@dataclass
class TeacherSequence:
    """One replayed turn: the prompt and the target's own continuation (greedy, sampled or recorded).

    ``tail_ids``: the target's greedy tokens past the continuation's end (past max_tokens or its stop token), which
    the drafts of an engine's last step are verified against when it drafts past the end; none: those slots never
    match."""

    prompt_ids: list[int]
    output_ids: list[int]
    tail_ids: list[int] = field(default_factory=list)


@torch.inference_mode()
def slot_table(
    target: TargetModel,
    proposer: Proposer,
    sequence: TeacherSequence,
    k: int,
    *,
    temperature: float = 0.0,
    record_divergence: bool = True,
    full_anchors: Callable[[np.ndarray], Iterable[int]] | None = None,
    target_pass: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    max_new_tokens: int | None = None,
    convention: EndOfRequest = CONVENTIONS["llamacpp"],
) -> tuple[SlotTable, tuple[torch.Tensor, torch.Tensor | None]]:
    """Guesses and matches for every anchor of ``sequence`` at block length ``k``, from one target forward.

    Under a convention that shrinks the last blocks (the official loop), the anchors within ``k`` of
    ``max_new_tokens`` are drafted with the block the live loop would use there (their slots past it stay
    unmatched; the schedule never drafts them). The target pass is returned so that several K can reuse
    one target forward. The prompt's positions get no logits: they predict nothing a slot drafts, and on a
    long context the vocabulary head over them would be most of the pass's memory.

    ``full_anchors`` names the anchors whose every slot is needed: the ones the recorded schedule drafts
    from, about 1 / tau of them. Every other anchor only needs its matched run, which is all a schedule walk
    reads (the first miss ends a step), so its slot j is evaluated only where slots < j matched: about 1.6
    of 15 slots at the demo's acceptance, and the draft's vocabulary head and the divergence columns over
    the full vocabulary are most of a replay's time.

    Args:
        target: the target model (reset before and after its forward).
        proposer: the draft's proposer, prepared here for ``sequence``.
        sequence: the prompt, the target's continuation and its tail.
        k: the block length (slots per anchor), >= 1.
        temperature: 0 for greedy matching; > 0 also records each slot's acceptance probability.
        record_divergence: whether to compute the divergence columns of the evaluated anchors.
        full_anchors: (T = 0 only) given the matched runs so far ([N, k] bool, rows past the current
            draft pass False), the anchors whose every slot is needed (guesses, and divergence rows with
            ``record_divergence``); called once per draft pass, so it must name anchors that earlier rows
            decide, as a schedule walk does. None: every slot of every anchor (divergence for all of them).
        target_pass: the target pass an earlier call returned for the same sequence; None runs it.
        max_new_tokens: the request's token budget, for a convention that shrinks the last blocks; None:
            every block has ``k`` slots.
        convention: the end-of-request convention whose block lengths are used.

    Returns:
        (the slot table, the target pass): the pass is (the logits of the output and tail positions
        [n_out + tail, V], row i predicting output[i + 1]; the tapped features of every position, or None
        when the proposer taps none).

    Raises:
        ValueError: when ``full_anchors`` is given with ``temperature`` > 0 (under sampling every slot's
            acceptance probability is read).
    """
    device = target.device
    known_ids = sequence.output_ids + sequence.tail_ids  # the truth the slots are matched against
    ids = torch.tensor(sequence.prompt_ids + known_ids, device=device)
    p_len, n_out = len(sequence.prompt_ids), len(sequence.output_ids)
    if target_pass is None:
        target.reset()
        out = target.forward(ids, taps=proposer.needs.hidden_state_indices, logits_from=p_len)
        target.reset()
        target_pass = (out.logits, out.features)
    target_logits, features = target_pass
    proposer.prepare_teacher(ids, features)
    truth = torch.tensor(known_ids, device=device)
    n_anchor = max(n_out - 1, 0)
    sampled = temperature > 0
    if sampled and full_anchors is not None:
        raise ValueError("full_anchors needs T = 0: under sampling every slot's acceptance probability is read")
    target_rows = TargetRows.of(target_logits, pad=k) if record_divergence and n_anchor else None
    block_of = np.full(n_anchor, k)
    if max_new_tokens is not None:
        block_of = np.array([convention.block_k(k, max_new_tokens - (i + 1)) for i in range(n_anchor)], dtype=np.int64)
    # Results stay on the device until the sequence is done: a host copy per pass would stall the GPU's
    # queue once per pass (only the matched runs that ``full_anchors`` reads are copied per pass). Slots
    # past a block or past the known output are padded / computed, then dropped on the host.
    runs = np.zeros((n_anchor, k), dtype=bool)  # the matched runs so far, for full_anchors
    guess_parts, match_parts, prob_parts, divergence_parts, recorded, length_parts = [], [], [], [], [], []
    for start, stop, bk in _draft_passes(block_of):
        anchors = torch.arange(p_len + start, p_len + stop)
        idx = torch.arange(start, stop, device=device)  # output indices
        slot_pos = idx[:, None] + torch.arange(1, bk + 1, device=device)  # output index each slot predicts
        known = slot_pos < len(known_ids)
        lengths = proposer.proposal_lengths(anchors, bk)  # a lookup proposer may draft fewer slots than bk
        if lengths is not None:
            known &= torch.arange(bk, device=device) < lengths.to(device)[:, None]
            length_parts.append(lengths.cpu())
        safe_pos = slot_pos.clamp(max=len(known_ids) - 1)
        if full_anchors is None:
            logits = proposer.slot_logits(anchors, bk)  # [A, bk, V]
            guess = logits.argmax(dim=-1)
            match = (guess == truth[safe_pos]) & known
            full = torch.arange(stop - start, device=device)
        else:
            scorer = proposer.slot_scorer(anchors, bk)
            guess, match = _matched_runs(scorer, truth[safe_pos], known)
            runs[start:stop, :bk] = match.cpu().numpy()
            chosen = sorted({a - start for a in full_anchors(runs) if start <= a < stop})
            full = torch.tensor(chosen, dtype=torch.long, device=device)
            every_slot = torch.arange(bk, device=device).repeat(len(chosen))
            logits = scorer(full.repeat_interleave(bk), every_slot).unflatten(0, (len(chosen), bk))
            guess[full] = logits.argmax(dim=-1)
        guess_parts.append(_widen(guess, k))
        match_parts.append(_widen(match, k))
        if sampled:  # the target's scores for each slot sit one row before the token it predicts
            p = torch.softmax(target_logits[safe_pos - 1] / temperature, dim=-1)
            if proposer.samples_drafts(temperature):
                q = torch.softmax(logits.float() / temperature, dim=-1)
                prob = torch.minimum(p, q).sum(dim=-1)
            else:
                prob = p.gather(-1, guess[..., None])[..., 0]
            prob_parts.append(_widen(prob * known, k))
        if target_rows is not None and len(full):  # record_divergence
            slots = target_rows.windows(start, stop - start, bk)  # output row a + j - 1 for slot j
            entries = None if full_anchors is None else full  # every anchor: the windows themselves, no gathered copy
            divergence_parts.append(_widen(divergence_tensor(logits, guess[full], slots, entries), k).flatten(0, 1))
            recorded.append(full + start)
    guesses = _host(guess_parts, np.zeros((0, k), dtype=np.int64))
    matches = _host(match_parts, np.zeros((0, k), dtype=bool))
    accept_probs = _host(prob_parts, np.zeros((0, k))).astype(np.float64) if sampled else None
    divergence = np.zeros((0, WIDTH))
    divergence_start: dict[int, int] = {}
    if record_divergence:
        rows = _host(recorded, np.zeros(0, dtype=np.int64))
        slot = np.arange(1, k + 1)[None]
        kept = (rows[:, None] + slot < n_out) & (slot <= block_of[rows][:, None])
        divergence = _host(divergence_parts, divergence)[kept.reshape(-1)]
        divergence_start = dict(zip(rows.tolist(), (np.cumsum(kept.sum(axis=1)) - kept.sum(axis=1)).tolist()))
    drafted = torch.cat(length_parts).numpy() if length_parts and len(length_parts) == len(guess_parts) else None
    table = SlotTable(
        guesses=guesses,
        matches=matches,
        accept_probs=accept_probs,
        divergence=divergence,
        divergence_start=divergence_start,
        drafted=drafted,
    )
    return table, target_pass


def _matched_runs(
    scorer: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], truth: torch.Tensor, known: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Guesses and matches [A, bk] of each anchor's matched run, slot by slot: slot j is scored only for
    the anchors whose slots < j all matched (guess -1 and no match elsewhere)."""
    guess = torch.full(truth.shape, -1, dtype=torch.long, device=truth.device)
    match = torch.zeros(truth.shape, dtype=torch.bool, device=truth.device)
    alive = torch.arange(truth.shape[0], device=truth.device)
    for j in range(truth.shape[1]):
        alive = alive[known[alive, j]]
        if alive.numel() == 0:
            break
        guess[alive, j] = scorer(alive, torch.full_like(alive, j)).argmax(dim=-1)
        hit = guess[alive, j] == truth[alive, j]
        match[alive, j] = hit
        alive = alive[hit]
    return guess, match


def _draft_passes(block_of: np.ndarray) -> list[tuple[int, int, int]]:
    """(first, stop, block length) of each draft pass: up to ANCHOR_CHUNK consecutive anchors of one block length."""
    passes = []
    for chunk in range(0, len(block_of), ANCHOR_CHUNK):
        first, end = chunk, min(chunk + ANCHOR_CHUNK, len(block_of))
        for i in range(chunk + 1, end + 1):
            if i == end or block_of[i] != block_of[first]:
                passes.append((first, i, int(block_of[first])))
                first = i
    return passes


def _widen(x: torch.Tensor, k: int) -> torch.Tensor:
    """[A, bk, ...] -> [A, k, ...] (zeros / False): slots a shortened block does not draft get no guess, no match."""
    bk = x.shape[1]
    return x if bk == k else F.pad(x, (0, 0) * (x.dim() - 2) + (0, k - bk))


def _host(parts: list[torch.Tensor], empty: np.ndarray) -> np.ndarray:
    """The chunks of one result, concatenated on the device and copied to the host once (``empty``: no chunks)."""
    return torch.cat(parts).cpu().numpy() if parts else empty


def token_rows(table: SlotTable, steps: list[StepRecord], output_ids: list[int]) -> list[TokenRecord]:
    """Token records for the drafted slots of ``steps`` whose true token is known.

    Args:
        table: the slot table the steps were walked from; the divergence rows of the steps' anchors must
            have been recorded.
        steps: the steps whose drafted slots are recorded.
        output_ids: the target's continuation (the true tokens).

    Returns:
        One record per drafted slot inside the output, step by step; ``target_token`` is the target's
        token on the committed (true) context.
    """
    n_out = len(output_ids)
    slots: list[tuple[StepRecord, int, int]] = []  # (step, its anchor's output index i, offset j)
    for step in steps:
        i = step.position - 1
        slots += [(step, i, j) for j in range(1, min(step.num_drafted, n_out - 1 - i) + 1)]
    columns = unpack_divergence(table.divergence[[table.divergence_start[i] + j - 1 for _, i, j in slots]])
    return [
        TokenRecord(
            step=step.step,
            position=i + j,
            offset=j,
            draft_token=int(table.guesses[i, j - 1]),
            target_token=int(output_ids[i + j]),
            accepted=j <= step.num_accepted,
            **{name: values[row] for name, values in columns.items()},
        )
        for row, (step, i, j) in enumerate(slots)
    ]
