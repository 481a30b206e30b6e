"""Replaying a workload through the pair, streaming rows into the run directory as requests finish.

Two ways to get the steps, one turn loop (:mod:`dflash_doctor.replay.turns`):

* :func:`replay_live`: the real speculative loop at one K (draft, verify, commit, roll back);
* :func:`replay_teacher`: the target's own continuations (batched), then teacher-forced replay of the
  draft over them, which answers every K at once (:mod:`dflash_doctor.engine.teacher`).

Both write the requests / steps / tokens rows of each finished turn through the :class:`RunWriter`
and keep in memory only what the summary needs (request and step rows, never token rows) plus the
turns themselves, so nothing is read back from disk. Ctrl-C (or SIGTERM / SIGHUP, which
:mod:`dflash_doctor.processes` turns into the same interrupt) stops between requests: what finished is in
the tables and in the returned :class:`Replay` (``interrupted``, and ``interrupt_signal`` for the exit code).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import torch

from dflash_doctor.engine.batched import generate_greedy_batch
from dflash_doctor.engine.live import GenerationResult, plain_generate, speculative_generate
from dflash_doctor.engine.schedule import CONVENTIONS, EndOfRequest
from dflash_doctor.engine.teacher import TeacherSequence, sampled_past_end, slot_table, token_rows, walk_schedule
from dflash_doctor.models.pair import Pair
from dflash_doctor.processes import signal_of
from dflash_doctor.rundir.tables import REQUESTS_SCHEMA, STEPS_SCHEMA, RequestRow, StepRow, TokenRow, as_row
from dflash_doctor.rundir.writer import RunWriter
from dflash_doctor.replay.turns import PendingTurn, Turn, run_turns
from dflash_doctor.inputs.workloads import Request

GREEDY_BATCH_SIZE = 32  # prompts per batched generate call (teacher-forced replay at T = 0)

Progress = Callable[[GenerationResult], None]


@dataclass
class Replay:
    """What a replay produced, in memory: every turn, the request and step rows written (for the
    summary), the steps at every K (teacher-forced) with whether each K is exact, and whether Ctrl-C
    cut it short.

    ``full_block_matches``: per turn key, the largest K's greedy matched runs when every anchor drafted a
    full block (T = 0, an end-of-request convention that keeps the block): exactly what the layer-offset
    probe computes at offset 0, so it reads them instead of drafting again."""

    turns: list[Turn] = field(default_factory=list)
    request_rows: list[dict[str, Any]] = field(default_factory=list)
    step_rows: list[dict[str, Any]] = field(default_factory=list)
    steps_by_k: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    estimate_by_k: dict[int, str] = field(default_factory=dict)
    full_block_matches: dict[str, np.ndarray] = field(default_factory=dict)
    interrupted: bool = False
    interrupt_signal: int | None = None  # the signal that cut it short (SIGINT, SIGTERM, SIGHUP), for the exit code

    def requests_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.request_rows, columns=list(REQUESTS_SCHEMA.names))

    def steps_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.step_rows, columns=list(STEPS_SCHEMA.names))

    def sweep_frames(self) -> dict[int, pd.DataFrame]:
        columns = ["request_id", "class", "step", "position", "k", "num_drafted", "num_accepted", "bonus_token"]
        return {k: pd.DataFrame(rows, columns=columns) for k, rows in self.steps_by_k.items()}


def _rows(pair: Pair, turn: Turn) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """The requests row, steps rows and tokens rows of one turn (typed rows, as the writer's dicts)."""
    result = turn.result
    drafts = [s for s in result.steps if s.num_drafted > 0]
    accepted = sum(s.num_accepted for s in drafts)
    cls = turn.request.request_class
    request_row = RequestRow(
        request_id=turn.key,
        request_class=cls,
        subclass=turn.request.subclass,
        turn=turn.index,
        prompt_num_tokens=len(turn.prompt_ids),
        output_token_ids=result.output_ids,
        output_text=pair.tokenizer.decode(result.output_ids, skip_special_tokens=False),
        num_output_tokens=len(result.output_ids),
        num_steps=len(result.steps),
        num_drafts=len(drafts),
        num_draft_tokens=sum(s.num_drafted for s in drafts),
        num_accepted_tokens=accepted,
        tau=1.0 + accepted / len(drafts) if drafts else None,
        stop_reason=result.stop_reason,
        wall_time_s=result.wall_time_s,
    )
    step_rows = [as_row(StepRow(request_id=turn.key, request_class=cls, **vars(s))) for s in result.steps]
    token_rows_ = [
        as_row(
            TokenRow(
                request_id=turn.key,
                request_class=cls,
                **vars(t),
                draft_text=pair.decode_token(t.draft_token),
                target_text=pair.decode_token(t.target_token),
                draft_category=pair.token_category(t.draft_token),
                target_category=pair.token_category(t.target_token),
            )
        )
        for t in result.tokens
    ]
    return as_row(request_row), step_rows, token_rows_


def _stream(pair: Pair, turns, writer: RunWriter, replay: Replay, progress: Progress | None, annotate=None) -> Replay:
    """Annotate (teacher-forced), write and remember each turn; Ctrl-C ends the replay cleanly."""
    try:
        for turn in turns:
            if annotate is not None:
                annotate(turn)
            request_row, step_rows, token_rows_ = _rows(pair, turn)
            writer.add("requests", [request_row])
            writer.add("steps", step_rows)
            writer.add("tokens", token_rows_)
            writer.flush()
            replay.turns.append(turn)
            replay.request_rows.append(request_row)
            replay.step_rows.extend(step_rows)
            if progress is not None:
                progress(turn.result)
    except KeyboardInterrupt as interrupt:
        replay.interrupted, replay.interrupt_signal = True, signal_of(interrupt)
    return replay


def replay_live(
    pair: Pair,
    requests: Sequence[Request],
    *,
    k: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    writer: RunWriter,
    progress: Progress | None = None,
    convention: EndOfRequest = CONVENTIONS["vllm"],
) -> Replay:
    """Every turn through the live speculative loop at ``k`` drafted tokens per step."""
    generator = torch.Generator(device=pair.target.device).manual_seed(seed)
    pair = pair.with_sampling(dataclasses.replace(pair.sampling, temperature=temperature, generator=generator))

    def generate(pending: Sequence[PendingTurn]) -> list[GenerationResult]:
        results = []
        for p in pending:
            results.append(
                speculative_generate(
                    pair.target,
                    pair.proposer,
                    torch.tensor(p.prompt_ids, device=pair.target.device),
                    k=k,
                    max_new_tokens=p.max_new_tokens,
                    temperature=temperature,
                    stop_ids=pair.stop_ids,
                    generator=generator,
                    convention=convention,
                )
            )
            pair.proposer.finish_request(p.prompt_ids, results[-1].output_ids + results[-1].tail_ids)
        return results

    return _stream(pair, run_turns(pair, requests, max_new_tokens, generate), writer, Replay(), progress)


class SharedContinuations:
    """The target's answers of one replay, handed to the next replay of the same workload and target.

    A head-to-head (``check --draft A --draft B``) replays the same turns once per speculator, and the
    target's continuations do not depend on the draft: greedy text at T = 0, and at T > 0 the samples of
    the same seeded generator drawn in the same order. The first replay generates them (on a CPU the
    largest part of a check); the others reuse them, so every speculator is judged on the very same
    turns. A turn is reused only when its prompt ids and token limit are the ones it was generated for
    (a scenario that edits the prompts generates anew), and when its tail past the end is as long as the
    replay needs (a larger K needs more)."""

    def __init__(self) -> None:
        self._answers: dict[tuple[str, int], tuple[list[int], int, list[int], str, list[int]]] = {}

    def lookup(self, pending: PendingTurn, past_end: int) -> GenerationResult | None:
        """A fresh result (no steps or tokens yet) for a turn generated before, else None."""
        known = self._answers.get((pending.request.id, pending.index))
        if (
            known is None
            or known[0] != pending.prompt_ids
            or known[1] != pending.max_new_tokens
            or len(known[4]) < past_end
        ):
            return None
        return GenerationResult(
            output_ids=list(known[2]),
            stop_reason=known[3],
            wall_time_s=float("nan"),
            tail_ids=list(known[4][:past_end]),
        )

    def remember(self, pending: PendingTurn, result: GenerationResult) -> None:
        self._answers[(pending.request.id, pending.index)] = (
            list(pending.prompt_ids),
            pending.max_new_tokens,
            list(result.output_ids),
            result.stop_reason,
            list(result.tail_ids),
        )


def _continuations(
    pair: Pair, temperature: float, generator: torch.Generator, shared: SharedContinuations | None, past_end: int = 0
):
    """The target's own answers: batched greedy at T = 0 (the batch's padded decoding steps may flip a
    near-tie relative to batch-1 decoding, which is why the lossless probe arbitrates a mismatch with
    unbatched decoding), sampled one by one above; turns ``shared`` holds already are taken from it. At
    T = 0 each answer comes with ``past_end`` greedy tokens past its end (:attr:`GenerationResult.tail_ids`)."""

    def generate_new(pending: Sequence[PendingTurn]) -> list[GenerationResult]:
        if temperature > 0:
            return [
                plain_generate(
                    pair.target,
                    torch.tensor(p.prompt_ids, device=pair.target.device),
                    max_new_tokens=p.max_new_tokens,
                    temperature=temperature,
                    stop_ids=pair.stop_ids,
                    generator=generator,
                )
                for p in pending
            ]
        results = []
        for start in range(0, len(pending), GREEDY_BATCH_SIZE):
            batch = pending[start : start + GREEDY_BATCH_SIZE]
            outputs = generate_greedy_batch(
                pair.target.model,
                [p.prompt_ids for p in batch],
                max_new_tokens=max(p.max_new_tokens for p in batch),
                stop_ids=pair.stop_ids,
                past_end=past_end,
            )
            for item, output in zip(batch, outputs, strict=True):
                end = next(
                    (i + 1 for i, token in enumerate(output[: item.max_new_tokens]) if token in pair.stop_ids),
                    min(len(output), item.max_new_tokens),
                )
                stopped = bool(output) and output[end - 1] in pair.stop_ids
                results.append(
                    GenerationResult(
                        output_ids=output[:end],
                        stop_reason="stop_token" if stopped else "max_new_tokens",
                        wall_time_s=float("nan"),
                        tail_ids=output[end : end + past_end],
                    )
                )
        return results

    def generate(pending: Sequence[PendingTurn]) -> list[GenerationResult]:
        if shared is None:
            return generate_new(pending)
        known = [shared.lookup(p, past_end) for p in pending]
        missing = [p for p, result in zip(pending, known) if result is None]
        fresh = iter(generate_new(missing))
        results = [result if result is not None else next(fresh) for result in known]
        for p, result in zip(pending, results):
            shared.remember(p, result)
        return results

    return generate


@torch.inference_mode()
def replay_teacher(
    pair: Pair,
    requests: Sequence[Request],
    *,
    ks: tuple[int, ...],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    exact_blocks: bool,
    writer: RunWriter,
    progress: Progress | None = None,
    convention: EndOfRequest = CONVENTIONS["vllm"],
    shared: SharedContinuations | None = None,
) -> Replay:
    """Teacher-forced replay for every K in ``ks``: the run directory holds the steps and tokens of the
    largest K; :attr:`Replay.steps_by_k` holds the steps of every K for the sweep. ``shared``: the target's
    answers of an earlier replay of the same turns, reused, and this replay's kept for the next.

    At T > 0 acceptance is drawn per slot with the exact per-slot probabilities along a sampled target
    trajectory (a Monte-Carlo walk whose expectation is the expected tau(K)).
    """
    ks = tuple(sorted(ks))
    pair.check_k_fits(ks)
    k_max = ks[-1]
    generator = torch.Generator(device=pair.target.device).manual_seed(seed)
    walk_rng = np.random.default_rng(seed)
    depends = pair.proposer.guesses_depend_on_k
    block_passes = ks if ((exact_blocks or pair.proposer.free_passes) and depends) else (k_max,)
    replay = Replay(
        steps_by_k={k: [] for k in ks},
        estimate_by_k={k: "exact" if (k in block_passes or not depends) else "truncated" for k in ks},
    )

    def annotate(turn: Turn) -> None:
        result = turn.result
        sequence = TeacherSequence(turn.prompt_ids, result.output_ids, result.tail_ids)

        def drafted_from(matches: np.ndarray) -> list[int]:
            """The anchors K_max's schedule drafts from: the only ones the tokens table has rows for."""
            return [
                s.position - 1
                for s in walk_schedule(
                    matches, result.output_ids, k_max, turn.max_new_tokens, pair.stop_ids, convention
                )
            ]

        tables: dict[int, Any] = {}
        target_pass = None
        for block_k in sorted(block_passes, reverse=True):
            recorded = block_k == k_max
            # at T = 0 only the recorded schedule's anchors need every slot; the sweep reads matched runs
            full_anchors = None if temperature > 0 else (drafted_from if recorded else lambda matches: ())
            tables[block_k], target_pass = slot_table(
                pair.target,
                pair.proposer,
                sequence,
                block_k,
                temperature=temperature,
                record_divergence=recorded,
                full_anchors=full_anchors,
                target_pass=target_pass,
                max_new_tokens=turn.max_new_tokens,
                convention=convention,
            )
        for k in ks:
            table = tables.get(k, tables[k_max])
            matches = table.matches[:, :k]
            if table.accept_probs is not None:
                matches = np.cumprod(walk_rng.random(matches.shape) < table.accept_probs[:, :k], axis=1).astype(bool)
            steps = walk_schedule(
                matches, result.output_ids, k, turn.max_new_tokens, pair.stop_ids, convention, table.drafted
            )
            replay.steps_by_k[k].extend(
                as_row(StepRow(request_id=turn.key, request_class=turn.request.request_class, **vars(s))) for s in steps
            )
            if k == k_max:
                if temperature <= 0 and not convention.shrink_last_block:  # the probe reads runs inside the output
                    inside = np.arange(len(table.matches))[:, None] + np.arange(1, k + 1) < len(result.output_ids)
                    replay.full_block_matches[turn.key] = table.matches & inside
                result.steps = steps
                result.tokens = token_rows(tables[k_max], steps, result.output_ids)
        # in the replay's request order, with what K_max's last step sampled past the end (vLLM's suffix cache keeps it)
        pair.proposer.finish_request(
            turn.prompt_ids, result.output_ids + sampled_past_end(result.steps, result.tail_ids, len(result.output_ids))
        )

    # Greedy continuations are batched across requests, one batch of requests at a time: each batch's
    # requests are annotated and journaled before the next batch generates, so a run killed mid-way keeps
    # them (a chunk of every request would journal nothing until the whole workload was generated).
    chunk = GREEDY_BATCH_SIZE if temperature <= 0 else 1
    past_end = (
        k_max - 1 if convention.drafts_past_end else 0
    )  # the tokens the last step's drafts may reach past the end
    turns = run_turns(
        pair, requests, max_new_tokens, _continuations(pair, temperature, generator, shared, past_end), chunk_size=chunk
    )
    return _stream(pair, turns, writer, replay, progress, annotate)
