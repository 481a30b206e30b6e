"""Stream a workload to a server at one load level and time every request.

A load level (:mod:`.loads`) says when each request starts; the measuring is one path for all of them.

Each request is one streamed OpenAI call (the body :func:`dflash_doctor.serving.server_run.request_body`
builds for ``check --engine``, with ``stream`` on and ``stream_options.include_usage`` so the final
chunk carries the usage and, on vLLM, the per-request ``metrics.speculative_decoding``). Timing follows
``vllm bench serve`` (vllm/benchmarks/lib/endpoint_request_func.py): time to first token (TTFT) is the
time to the first chunk that carries choices, time per output token (TPOT) is ``(end-to-end - TTFT) /
(output tokens - 1)``, end-to-end latency is the whole call. A run's output tokens/s and requests/s are over the wall
time from the first request sent to the last answered. A multi-turn workload request is measured on its first turn only:
later turns would carry the server's own answers, which differ across K under sampling and make the runs unequal.

Rollback compute is the target tokens verified and thrown away per output token:
``(draft tokens - accepted tokens) / output tokens`` from the engine's own figures (vLLM definitions).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Callable

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.inputs.workloads import Request, conversation_turns
from dflash_doctor.replay.turns import turn_limit
from dflash_doctor.serving.client import ServerEndpoint, auth_fix
from dflash_doctor.serving.http import AUTH_STATUSES, Unreachable
from dflash_doctor.serving.server_run import impossible_answer, request_body
from dflash_doctor.serving.prometheus import measurement_between, scrape_counters
from dflash_doctor.serving.responses import MalformedResponse, MissingMetrics, SpecMeasurement, read_measurement
from dflash_doctor.tune.loads import LoadLevel


@dataclass(frozen=True)
class TimedRequest:
    """One streamed request: its timings, its token counts and the engine's speculative figures."""

    request_id: str
    request_class: str
    prompt_num_tokens: int
    num_output_tokens: int
    ttft_s: float
    e2e_s: float
    spec: SpecMeasurement | None  # None: the server did not speculate (K = 0) or reported nothing

    @property
    def decode_s(self) -> float:
        """Time after the first token: what the output tokens after the first one cost."""
        return max(self.e2e_s - self.ttft_s, 0.0)

    @property
    def tpot_s(self) -> float | None:
        return self.decode_s / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else None

    def as_row(self, k: int, load: LoadLevel, repeat: int) -> dict[str, Any]:
        spec = self.spec
        return {
            "k": k,
            load.kind: load.value,
            "repeat": repeat,
            "request_id": self.request_id,
            "class": self.request_class,
            "prompt_num_tokens": self.prompt_num_tokens,
            "num_output_tokens": self.num_output_tokens,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "decode_s": self.decode_s,
            "num_drafts": spec.num_drafts if spec else None,
            "num_draft_tokens": spec.num_draft_tokens if spec else None,
            "num_accepted_tokens": spec.num_accepted_tokens if spec else None,
        }


@dataclass(frozen=True)
class LoadRun:
    """All requests of one (K, load) cell and the run-level figures."""

    k: int
    load: LoadLevel
    requests: list[TimedRequest]
    wall_s: float
    counters: SpecMeasurement | None  # the server's /metrics deltas over the run (None: no spec counters)
    repeat: int = 0  # 1: the K = 0 baseline measured again after the grid (drift check)


def first_turns(requests: list[Request]) -> list[Request]:
    """Each request cut to its first turn (see the module doc for why); the sweep replays the same list."""
    return [
        dataclasses.replace(r, messages=tuple(conversation_turns(r)[0])) if r.messages is not None else r
        for r in requests
    ]


def streamed_body(endpoint: ServerEndpoint, request: Request, config: DoctorConfig) -> tuple[str, dict[str, Any]]:
    """``check --engine``'s body for a one-turn request, streamed with the usage chunk at the end."""
    messages = list(request.messages) if request.messages is not None else None
    path, body = request_body(endpoint, request, messages, turn_limit(request, config.max_new_tokens), config)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return path, body


def stream_request(
    endpoint: ServerEndpoint, request: Request, config: DoctorConfig, clock: Callable[[], float] = time.perf_counter
) -> TimedRequest:
    """Send one request streamed and time it; a failure is a UsageError naming the server."""
    path, body = streamed_body(endpoint, request, config)
    started = clock()
    ttft: float | None = None
    final: dict[str, Any] = {}
    try:
        with endpoint.client.stream(
            "POST", endpoint.base_url + path, payload=body, headers={"Accept": "text/event-stream"}
        ) as (status, lines):
            if status != 200:
                fix = auth_fix(endpoint) if status in AUTH_STATUSES else "check the server's log and flags"
                raise UsageError(
                    f"--engine {endpoint.base_url}{path} answered HTTP {status} to request {request.id}; {fix}."
                )
            for raw in lines:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if ttft is None and chunk.get("choices"):
                    ttft = clock() - started
                if chunk.get("usage") is not None:  # its shape is read_measurement's to judge
                    final = chunk
    except (Unreachable, json.JSONDecodeError, AttributeError) as exc:
        raise UsageError(
            f"--engine {endpoint.base_url}: request {request.id} failed mid-stream ({exc}); "
            "check that the server is still up."
        ) from None
    e2e = clock() - started
    if not final or not final["usage"]:
        raise UsageError(
            f"--engine {endpoint.base_url} streamed no usage for request {request.id}; the server must "
            "honour stream_options.include_usage (vLLM, SGLang and llama.cpp do)."
        )
    try:
        spec: SpecMeasurement | None = read_measurement(final)
    except MissingMetrics:
        spec = None
    except MalformedResponse as exc:
        raise UsageError(impossible_answer(endpoint, exc)) from None
    usage = final["usage"]
    return TimedRequest(
        request_id=request.id,
        request_class=request.request_class,
        prompt_num_tokens=int(usage.get("prompt_tokens") or 0),
        num_output_tokens=int(usage.get("completion_tokens") or 0),
        ttft_s=ttft if ttft is not None else e2e,
        e2e_s=e2e,
        spec=spec,
    )


def run_load(
    endpoint: ServerEndpoint,
    requests: list[Request],
    config: DoctorConfig,
    *,
    k: int,
    load: LoadLevel,
    repeat: int = 0,
    on_request: Callable[[TimedRequest], None] | None = None,
) -> LoadRun:
    """Every request once at this load: ``concurrency`` in flight at a time (a closed loop, as ``vllm bench
    serve --request-rate inf --max-concurrency``) or each sent at its arrival offset from ``config.seed``'s
    schedule (an open loop, as ``--request-rate``); the /metrics counters around the run give its
    acceptance when responses carry none. Wall time runs from the schedule's start to the last answer."""
    before = scrape_counters(endpoint)
    done: list[TimedRequest] = []
    offsets = load.arrival_offsets(len(requests), config.seed)
    started = time.perf_counter()

    def send_at(request: Request, offset: float) -> TimedRequest:
        time.sleep(max(started + offset - time.perf_counter(), 0.0))
        return stream_request(endpoint, request, config)

    with concurrent.futures.ThreadPoolExecutor(max_workers=load.workers(len(requests))) as pool:
        futures = [pool.submit(send_at, request, offset) for request, offset in zip(requests, offsets)]
        try:
            for future in concurrent.futures.as_completed(futures):
                timed = future.result()
                done.append(timed)
                if on_request is not None:
                    on_request(timed)
        except BaseException:
            for pending in futures:
                pending.cancel()
            raise
    wall = time.perf_counter() - started
    after = scrape_counters(endpoint)
    counters = measurement_between(before, after) if before is not None and after is not None else None
    order = {request.id: i for i, request in enumerate(requests)}
    done.sort(key=lambda timed: order[timed.request_id])
    return LoadRun(k=k, load=load, requests=done, wall_s=wall, counters=counters, repeat=repeat)
