"""`check --engine URL`: send the workload to a running server and write a run directory from ITS figures.

The server does the decoding; the doctor only asks and reads. Each turn is one OpenAI request (chat for
``messages`` requests, completions for raw ``prompt`` ones) with the run's temperature, seed and
max-token limit; a later turn is asked after the server's own answer to the earlier one, as the
embedded replay does. Requests run a few at a time (``--engine-concurrency``); their turns stay in
order. The steps table holds the engine's own steps (vLLM ``detailed``: in order, with positions), the
requests table its outputs, and ``run.json`` records ``source: serving engine`` with the endpoint. A
failure stops the run with one sentence; every request measured before it stays in the run directory.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_doctor.engine.live import GenerationResult
from dflash_doctor.engine.step_records import StepRecord
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.inputs.machine import collect_environment
from dflash_doctor.inputs.workloads import Request, conversation_turns, fill_answers
from dflash_doctor.processes import signal_of
from dflash_doctor.replay.turns import turn_limit
from dflash_doctor.rundir.run_record import ModelInfo, RunMeta, RunRecord, Source
from dflash_doctor.rundir.tables import REQUESTS_SCHEMA, STEPS_SCHEMA, StepRow, as_row, turn_row_id
from dflash_doctor.rundir.writer import utc_now
from dflash_doctor.serving.client import ServerEndpoint, ServerError, auth_fix, call
from dflash_doctor.serving.prometheus import ServerCounters, measurement_between, scrape_counters
from dflash_doctor.serving.responses import (
    LLAMA_CPP,
    MalformedResponse,
    MissingMetrics,
    SpecMeasurement,
    check_measurement,
    check_response_shape,
    read_measurement,
    step_rows,
)

FIGURES_FROM = {
    "responses": "the server's per-request metrics in each response",
    "counters": "the server's /metrics counters scraped around each request, one request at a time "
    "(the server reports no per-request metrics; other traffic on it would leak in; step order unknown)",
    "timings and counters": (
        "llama.cpp's timings per response (draft tokens, accepted tokens), with the verify steps and "
        "per-position acceptances from its /metrics counters scraped around each request, one request "
        "at a time (llama.cpp returns no verify-step count per request; step order unknown)"
    ),
}

LLAMA_CPP_WITHOUT_METRICS = (
    "llama.cpp returns drafted and accepted tokens per request (timings.draft_n) but no verify-step count, so no tau; "
    "restart llama-server with --metrics so the doctor reads the verify steps from /metrics, one request at a time"
)


@dataclass
class ServerTurn:
    """One answered turn: what was sent, what came back, and the engine's speculative figures."""

    request: Request
    turn: int
    output_text: str
    output_token_ids: list[int] | None  # None when the engine does not return ids
    prompt_token_ids: list[int] | None
    prompt_num_tokens: int
    num_output_tokens: int
    stop_reason: str
    measurement: SpecMeasurement
    wall_time_s: float
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def key(self) -> str:
        """Row id in the steps table, as the embedded replay names turns
        (:func:`~dflash_doctor.rundir.tables.turn_row_id`)."""
        return turn_row_id(self.request.id, self.turn)


def request_body(
    endpoint: ServerEndpoint,
    request: Request,
    messages: list[dict[str, Any]] | None,
    max_tokens: int,
    config: DoctorConfig,
    *,
    ids_from_probs: bool = False,
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) for one turn; asks vLLM for token ids and SGLang for its spec details.

    ``ids_from_probs``: llama.cpp returns output token ids only with its token probabilities
    (``n_probs``, passed through its OpenAI endpoints: ``choices[0].logprobs.content[i].id``).
    """
    body: dict[str, Any] = {
        "model": endpoint.model,
        "max_tokens": max_tokens,
        "temperature": config.temperature,
        "seed": config.seed,
        "n": 1,
        "stream": False,
        "return_token_ids": True,  # vLLM: prompt_token_ids + choices[0].token_ids
        "return_spec_tokens_details": True,  # SGLang: sglext.spec_tokens_details
    }
    if ids_from_probs:
        body["n_probs"] = 1
    if messages is None:
        body["prompt"] = request.prompt
        return "/v1/completions", body
    body["messages"] = messages
    if request.chat_template_kwargs:
        body["chat_template_kwargs"] = dict(request.chat_template_kwargs)
    return "/v1/chat/completions", body


def read_completion(body: dict[str, Any]) -> tuple[str, list[int] | None, list[int] | None, str, dict[str, Any]]:
    """(text, output ids, prompt ids, stop reason, usage) of a non-streamed n = 1 completion body."""
    choices = body.get("choices") or []
    if len(choices) != 1:
        raise MissingMetrics(
            f"the response has {len(choices)} choices; engines report per-request speculative metrics only for "
            "n = 1 (vLLM returns null for n > 1), so send one completion per request"
        )
    choice = choices[0]
    text = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
    output_ids = choice.get("token_ids")
    if output_ids is None:
        output_ids = (choice.get("meta_info") or body.get("meta_info") or {}).get("output_token_ids")
    probs = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if output_ids is None and probs and all(isinstance(p, dict) and "id" in p for p in probs):
        output_ids = [p["id"] for p in probs]  # llama.cpp with n_probs
    prompt_ids = body.get("prompt_token_ids", choice.get("prompt_token_ids"))
    finish = choice.get("finish_reason")
    stop_reason = "max_new_tokens" if finish == "length" else "stop_token"
    return text or "", output_ids, prompt_ids, stop_reason, body.get("usage") or {}


def ask(
    endpoint: ServerEndpoint,
    request: Request,
    config: DoctorConfig,
    *,
    from_counters: bool = False,
    ids_from_probs: bool = False,
) -> list[ServerTurn]:
    """All turns of one request, in order; a later turn carries the server's own earlier answers.

    ``from_counters``: read each turn's figures from ``/metrics`` scraped before and after it (the
    fallback for a server without per-request metrics; only exact when nothing else runs meanwhile).
    ``ids_from_probs``: see :func:`request_body` (llama.cpp).
    """
    max_tokens = turn_limit(request, config.max_new_tokens)
    turns = conversation_turns(request) if request.messages is not None else [None]
    answers: list[str] = []
    results = []
    for turn, messages in enumerate(turns):
        filled = fill_answers(messages, answers) if messages is not None else None
        path, payload = request_body(endpoint, request, filled, max_tokens, config, ids_from_probs=ids_from_probs)
        before = _counters(endpoint) if from_counters else None
        started = time.perf_counter()
        body = call(endpoint, "POST", path, payload)
        wall = time.perf_counter() - started
        check_response_shape(body)
        text, output_ids, prompt_ids, stop_reason, usage = read_completion(body)
        measurement = (
            check_measurement(counted_measurement(before, _counters(endpoint), body))
            if before is not None
            else read_measurement(body)
        )
        output_ids = [int(t) for t in output_ids] if output_ids is not None else None
        results.append(
            ServerTurn(
                request=request,
                turn=turn,
                output_text=text,
                output_token_ids=output_ids,
                prompt_token_ids=[int(t) for t in prompt_ids] if prompt_ids is not None else None,
                prompt_num_tokens=int(usage.get("prompt_tokens") or len(prompt_ids or [])),
                num_output_tokens=len(output_ids)
                if output_ids is not None
                else int(usage.get("completion_tokens") or 0),
                stop_reason=stop_reason,
                measurement=measurement,
                wall_time_s=wall,
                steps=step_rows(measurement, output_ids),
            )
        )
        answers.append(text)
    return results


def counted_measurement(before: ServerCounters, after: ServerCounters, body: dict[str, Any]) -> SpecMeasurement:
    """One request's figures from the /metrics counters around it, checked against the draft tokens the
    response itself reports (llama.cpp's ``timings.draft_n``): a difference is other traffic on the server."""
    measurement = measurement_between(before, after)
    timings = body.get("timings")
    if isinstance(timings, dict) and "draft_n" in timings and int(timings["draft_n"]) != measurement.num_draft_tokens:
        raise MissingMetrics(
            f"the server's /metrics counters moved by {measurement.num_draft_tokens} draft tokens while the request "
            f"drafted {int(timings['draft_n'])} (timings.draft_n): other requests ran on it meanwhile; measure on a "
            "server that serves nothing else"
        )
    return measurement


def _counters(endpoint: ServerEndpoint) -> ServerCounters:
    counters = scrape_counters(endpoint)
    if counters is None:
        raise MissingMetrics(
            "the server's /metrics page lost its speculative-decoding counters mid-run; keep the server up and retry"
        )
    return counters


def figures_source(endpoint: ServerEndpoint, first: Request, config: DoctorConfig) -> tuple[str, list[ServerTurn]]:
    """(``"responses"``, the first request's turns) when the server reports per request, or
    (``"counters"``, []) when only its /metrics counters can stand in (the sequential fallback).

    Asks the first request alone; a response without figures from a server whose /metrics has no
    spec-decode counters either re-raises the response's own sentence. llama.cpp's responses carry tokens
    but no verify-step count: its /metrics counters give the steps (``"timings and counters"``), and the
    first request is asked again around two scrapes.
    """
    try:
        turns = ask(endpoint, first, config)
    except MissingMetrics as exc:
        if exc.per_request_off and scrape_counters(endpoint) is not None:
            return "counters", []
        raise
    if turns[0].measurement.num_drafts is not None:
        return "responses", turns
    if scrape_counters(endpoint) is None:
        raise MissingMetrics(LLAMA_CPP_WITHOUT_METRICS)
    return "timings and counters", []


def turn_rows(result: ServerTurn) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The requests-table row and steps-table rows of one answered turn."""
    m = result.measurement
    row = {
        "request_id": result.key,
        "class": result.request.request_class,
        "subclass": result.request.subclass,
        "turn": result.turn,
        "prompt_num_tokens": result.prompt_num_tokens,
        "output_token_ids": result.output_token_ids or [],
        "output_text": result.output_text,
        "num_output_tokens": result.num_output_tokens,
        "num_steps": m.num_drafts if m.num_drafts is not None else len(result.steps),
        "num_drafts": m.num_drafts,
        "num_draft_tokens": m.num_draft_tokens,
        "num_accepted_tokens": m.num_accepted_tokens,
        "tau": m.tau,
        "stop_reason": result.stop_reason,
        "wall_time_s": result.wall_time_s,
    }
    steps = [
        as_row(StepRow(request_id=result.key, request_class=result.request.request_class, **vars(s)))
        for s in result.steps
    ]
    return row, steps


def impossible_answer(endpoint: ServerEndpoint, exc: MalformedResponse, kept: str = "") -> str:
    """The one sentence for a server that answered something of the wrong shape or impossible (``check --engine``
    and ``tune``); ``kept`` says what the run directory holds."""
    return (
        f"--engine {endpoint.base_url}: {exc}; point --engine at the serving "
        f"engine itself, not at a proxy that rewrites its answers{kept}."
    )


def _failure_sentence(endpoint: ServerEndpoint, exc: Exception, done: int, run_dir: Path) -> str:
    kept = f"; the {done} request(s) measured before it are in {run_dir}" if done else ""
    if isinstance(exc, MissingMetrics):
        return f"--engine {endpoint.base_url}: {exc}{kept}."
    if isinstance(exc, MalformedResponse):
        return impossible_answer(endpoint, exc, kept)
    if isinstance(exc, ServerError) and exc.status is None:
        return f"--engine {endpoint.base_url}: {exc}; check that the server is still up{kept}."
    if isinstance(exc, ServerError) and exc.auth_refused:
        return f"--engine {endpoint.base_url}: {exc}; {auth_fix(endpoint)}{kept}."
    return f"--engine {endpoint.base_url}: {exc}; fix the request or the server flags{kept}."


@dataclass
class ServerMeasurement:
    """What a server run produced: the answered turns and their table rows (kept for the summary)."""

    turns: list[ServerTurn] = field(default_factory=list)
    request_rows: list[dict[str, Any]] = field(default_factory=list)
    step_rows: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False
    interrupt_signal: int | None = None  # the signal that cut it short, for the exit code (None: a failure did)
    failure: UsageError | None = None  # raised by the caller once the run directory is closed

    def requests_frame(self):
        return _frame(self.request_rows, REQUESTS_SCHEMA)

    def steps_frame(self):
        return _frame(self.step_rows, STEPS_SCHEMA)


def _frame(rows: list[dict[str, Any]], schema):
    import pyarrow as pa

    return pa.Table.from_pylist(rows, schema=schema).to_pandas()


def measure_server(
    endpoint: ServerEndpoint,
    requests: list[Request],
    config: DoctorConfig,
    writer,
    record,
    *,
    concurrency: int = 4,
    progress=None,
) -> ServerMeasurement:
    """Send every request (``concurrency`` at a time) and stream its rows through ``writer``.

    The first failure stops sending; rows of finished requests are kept, the record notes the run as
    interrupted, and the failure is raised as one UsageError sentence after the caller closes the writer.
    """
    measured = ServerMeasurement()
    failure: Exception | None = None
    futures: list = []
    pool = None
    try:
        source, first_turns = figures_source(endpoint, requests[0], config) if requests else ("responses", [])
        record.source.details["figures_from"] = FIGURES_FROM[source]
        from_counters = source != "responses"
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1 if from_counters else max(1, concurrency))
        remaining = requests[1:] if first_turns else requests
        futures = [
            pool.submit(
                ask,
                endpoint,
                request,
                config,
                from_counters=from_counters,
                ids_from_probs=source == "timings and counters",
            )
            for request in remaining
        ]
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(first_turns)
        # each request's rows go to the journal as its answer arrives (a lazy chain: a list would wait for all)
        for future in itertools.chain([done], concurrent.futures.as_completed(futures)):
            try:
                turns = future.result()
            except (ServerError, MissingMetrics) as exc:
                failure = exc
                for pending in futures:
                    pending.cancel()
                break
            for result in turns:
                row, steps = turn_rows(result)
                writer.add("requests", [row])
                writer.add("steps", steps)
                measured.turns.append(result)
                measured.request_rows.append(row)
                measured.step_rows.extend(steps)
                if progress is not None:
                    progress(
                        GenerationResult(
                            output_ids=result.output_token_ids or [],
                            stop_reason=result.stop_reason,
                            wall_time_s=result.wall_time_s,
                            steps=result.steps,
                        )
                    )
            writer.flush()
    except (ServerError, MissingMetrics) as exc:  # the first request, asked alone by figures_source
        failure = exc
    except KeyboardInterrupt as interrupt:
        measured.interrupted, measured.interrupt_signal = True, signal_of(interrupt)
        for pending in futures:
            pending.cancel()
    finally:
        if pool is not None:
            pool.shutdown(wait=not measured.interrupted, cancel_futures=True)
        record.source.details.update(server_facts(measured.turns))
    if failure is not None:
        measured.interrupted = True
        kept = len({t.request.id for t in measured.turns})
        measured.failure = UsageError(_failure_sentence(endpoint, failure, kept, writer.run_dir))
    return measured


def server_facts(answered: list[ServerTurn]) -> dict[str, Any]:
    """What the responses say about the server: engine kind, K, and how exact the step table is."""
    if not answered:
        return {}
    m = answered[0].measurement
    if all(t.measurement.steps_in_order for t in answered):
        steps = "in order (per-step arrays)"
    elif m.server_kind == LLAMA_CPP:
        steps = "histogram only (from /metrics per-position counters; llama.cpp reports no step order)"
    else:
        steps = "histogram only (step order unknown; vLLM --per-request-spec-decode-metrics detailed gives the order)"
    return {
        "kind": m.server_kind,
        "num_spec_tokens": m.num_spec_tokens,
        "steps": steps,
        "returns_token_ids": all(t.output_token_ids is not None for t in answered),
    }


def start_server_record(config: DoctorConfig, endpoint: ServerEndpoint, model_file: str | None = None):
    """The run record of a serving-engine run: ``source`` names the server; the target is what it serves.
    ``model_file``: the file the server says it serves (llama-server's GGUF, :func:`served_model_file`),
    kept in ``source.details`` for the target-identity check."""
    return RunRecord(
        meta=RunMeta(command="check", created_at=utc_now()),
        source=Source(
            kind="serving-engine",
            description=f"the server at {endpoint.base_url} (its own per-request figures)",
            url=endpoint.base_url,
            details={"model": endpoint.model, **({"model_file": model_file} if model_file else {})},
        ),
        models={
            "target": ModelInfo(
                id=endpoint.model or "", revision_or_hash="", dtype="", device=endpoint.base_url, kind="target"
            )
        },
        environment=collect_environment(None),
        config=config.as_dict(),
    )
