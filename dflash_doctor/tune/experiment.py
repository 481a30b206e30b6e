"""Run a tune grid into a run directory (files in docs/tune.md).

Order: the workload (first turns, saved as ``workload.jsonl``); for each K, its server (launched or
given; one unmeasured warm-up request first, so one-off start costs stay out of the figures) and every
load level on it; then the doctor's teacher-forced sweep of the same prompts with the local pair (run
last, after every launched server is stopped, so the two never share the CPU; or read from an earlier
sweep run with ``--sweep DIR``); then the analysis, the cost fit and prediction, the recommendation, the
cost profiles and the reports. ``requests.parquet`` is rewritten after every K, so an interrupted grid
keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from dflash_doctor import pipeline
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.inputs.workloads import load_workload, save_workload
from dflash_doctor.models.draft_kinds import DraftKind, get_draft_kind
from dflash_doctor.rundir.tables import TUNE_JSON
from dflash_doctor.rundir.writer import utc_now
from dflash_doctor import __version__
from dflash_doctor.serving.client import ServerEndpoint, resolve_model
from dflash_doctor.tune.advice import settings_per_server, recommend_grid
from dflash_doctor.tune.analysis import analyse, baseline_drift, fill_from_counters
from dflash_doctor.tune.loads import CONCURRENCY, LoadLevel, load_text
from dflash_doctor.tune.measure import LoadRun, TimedRequest, first_turns, run_load, stream_request
from dflash_doctor.tune.prediction import fit_costs, held_out_error, predict, sweep_taus
from dflash_doctor.tune.result import TUNE_SCHEMA_VERSION, TuneResult
from dflash_doctor.tune.secrets import redact
from dflash_doctor.tune.servers import plan_servers, serving


@dataclass(frozen=True)
class TuneGrid:
    """What to measure: the K grid (0 = off), the load levels (all of one kind), the K the costs are fitted
    from, the servers."""

    ks: tuple[int, ...]
    loads: tuple[LoadLevel, ...]
    fit_ks: tuple[int, ...]
    engine: str | None = None
    launch: str | None = None
    launch_baseline: str | None = None
    sweep_dir: str | None = None  # an earlier sweep run of the same workload; None: run one
    start_timeout_s: float = 900.0
    warmup_requests: int = 1


def parse_rates(text: str) -> tuple[float, ...]:
    """``--request-rate 2,4,inf``: sorted distinct requests per second, each above 0 (inf = all at once)."""
    try:
        rates = {float(part) for part in text.split(",")}
    except ValueError:
        rates = set()
    if not rates or any(math.isnan(rate) or rate <= 0 for rate in rates):
        raise UsageError(
            f"--request-rate {text!r} must be requests per second above 0, comma-separated, like 2,4,inf; "
            "fix the value."
        )
    return tuple(sorted(rates))


def default_fit_ks(ks: tuple[int, ...]) -> tuple[int, ...]:
    """The two smallest K > 0: the cheap end of the grid predicts the expensive end."""
    return tuple(k for k in ks if k > 0)[:2]


@dataclass(frozen=True)
class TuneOutcome:
    run_dir: Path
    result: TuneResult


def measure_grid(
    grid: TuneGrid,
    config: DoctorConfig,
    requests,
    run_dir: Path,
    on_request: Callable[[int, LoadLevel, TimedRequest], None] | None = None,
    api_key: str | None = None,
) -> tuple[list[LoadRun], list[dict[str, Any]]]:
    """Every K on its server, every load on it; returns the runs and what each server said about itself.
    ``api_key`` (the servers' --api-key) goes with every request, health poll and /metrics scrape."""
    runs: list[LoadRun] = []
    servers: list[dict[str, Any]] = []
    plans = plan_servers(grid.ks, grid.engine, grid.launch, grid.launch_baseline)
    if plans[0].k == 0 and len(plans) > 1:
        plans.append(plans[0])  # the baseline again at the end: how far the machine's speed drifted meanwhile
    for plan in plans:
        repeat = sum(1 for s in servers if s["k"] == plan.k)
        log_name = f"server-k{plan.k}.log" if not repeat else f"server-k{plan.k}-repeat.log"
        runs_and_facts = _measure_server(plan, grid, config, requests, run_dir / log_name, api_key, repeat, on_request)
        runs.extend(runs_and_facts[0])
        servers.append(runs_and_facts[1])
        _rows(runs).to_parquet(run_dir / "requests.parquet", index=False)
    return runs, servers


def _measure_server(
    plan,
    grid: TuneGrid,
    config: DoctorConfig,
    requests,
    log_path: Path,
    api_key: str | None,
    repeat: int,
    on_request: Callable[[int, LoadLevel, TimedRequest], None] | None,
) -> tuple[list[LoadRun], dict[str, Any]]:
    """One K: its server up, warm-up requests, every load; the runs and what the server said about itself."""
    runs: list[LoadRun] = []
    with serving(plan, log_path, grid.start_timeout_s, api_key) as url:
        endpoint = resolve_model(
            ServerEndpoint.from_url(url, model=config.engine_model, timeout_s=config.engine_timeout_s, api_key=api_key)
        )
        for request in requests[: grid.warmup_requests]:
            stream_request(endpoint, request, config)
        for load in grid.loads:

            def report(timed: TimedRequest, k=plan.k, load=load) -> None:
                if on_request is not None:
                    on_request(k, load, timed)

            runs.append(run_load(endpoint, requests, config, k=plan.k, load=load, repeat=repeat, on_request=report))
        facts = _server_facts(plan.k, plan.command, url, endpoint.model, runs[-len(grid.loads) :]) | {"repeat": repeat}
    return runs, facts


def _server_facts(k: int, command: str | None, url: str, model: str | None, runs: list[LoadRun]) -> dict[str, Any]:
    """What the engine itself said at this K: the K it drafts (vLLM says it per request; llama.cpp does not),
    and where the acceptance figures came from (llama.cpp's responses count draft tokens but not steps). A K=0
    server that drafted, by its responses or its /metrics counters, is flagged: it is no baseline."""
    specs = [timed.spec for run in runs for timed in run.requests if timed.spec is not None]
    reported = {spec.num_spec_tokens for spec in specs if spec.num_spec_tokens is not None}
    per_request = any(spec.num_drafts is not None for spec in specs)
    facts: dict[str, Any] = {
        "k": k,
        "url": redact(url),
        "model": model,
        "launched": redact(command) if command else None,
        "engine_num_spec_tokens": sorted(reported),
        "acceptance_from": "per-request response metrics"
        if per_request
        else "/metrics counter deltas over the run (overall only)"
        if any(r.counters for r in runs)
        else "none",
    }
    if k > 0 and reported and reported != {k}:
        facts["warning"] = f"the server reports num_spec_tokens {sorted(reported)}, not K={k}: check the launch command"
    if k == 0 and (
        any(spec.num_draft_tokens or spec.num_drafts for spec in specs)
        or any(r.counters and r.counters.num_drafts for r in runs)
    ):
        facts["warning"] = "the K=0 server drafted tokens: it is speculating; the baseline must run without a draft"
    return facts


def _rows(runs: list[LoadRun]) -> pd.DataFrame:
    return pd.DataFrame([timed.as_row(run.k, run.load, run.repeat) for run in runs for timed in run.requests])


def run_throughput(runs: list[LoadRun]) -> dict[tuple[int, Any], dict[str, float]]:
    """Output tokens/s and requests/s per (K, load): totals over the summed wall time of its runs
    (the baseline's two passes count as one longer run)."""
    cells: dict[tuple[int, Any], list[LoadRun]] = {}
    for run in runs:
        cells.setdefault((run.k, run.load.value), []).append(run)
    figures = {}
    for key, group in cells.items():
        wall = sum(run.wall_s for run in group)
        tokens = sum(r.num_output_tokens for run in group for r in run.requests)
        figures[key] = {
            "output_tokens_per_s": tokens / wall,
            "requests_per_s": sum(len(run.requests) for run in group) / wall,
            "wall_s": wall,
        }
    return figures


def teacher_sweep(
    grid: TuneGrid, config: DoctorConfig, workload_path: Path, run_dir: Path
) -> tuple[dict[str, Any], str, DraftKind[Any]]:
    """(``summary.sweep``, its run directory, the draft's kind) of the doctor's teacher-forced replay of the same
    prompts."""
    if grid.sweep_dir is not None:
        sweep_dir = Path(grid.sweep_dir)
        try:
            run = json.loads((sweep_dir / "run.json").read_text(encoding="utf-8"))
            sweep = run["summary"]["sweep"]
        except (OSError, ValueError, KeyError, TypeError):
            raise UsageError(
                f"--sweep {sweep_dir} is not a finished sweep run directory (run.json with summary.sweep); "
                "run `dflash-doctor sweep` first."
            ) from None
    else:
        spec_ks = tuple(k for k in grid.ks if k > 0)
        sweep_config = dataclasses.replace(
            config,
            workload=str(workload_path),
            max_requests=None,
            classes=(),
            k=spec_ks,
            out=str(run_dir / "sweep"),
            cost_profile=None,
        )
        outcome = pipeline.run_sweep(sweep_config)
        sweep_dir, run = outcome.run_dir, outcome.record.to_json()
        sweep = run["summary"]["sweep"]
    name = str(((run.get("models") or {}).get("draft") or {}).get("kind") or "dflash")
    try:
        kind = get_draft_kind(name)
    except UsageError:
        raise UsageError(
            f"--sweep {sweep_dir} names the draft kind {name!r}, which this dflash-doctor does not know; "
            "run `dflash-doctor sweep` again with this version."
        ) from None
    return sweep, str(sweep_dir), kind


def run_tune(
    grid: TuneGrid,
    config: DoctorConfig,
    run_dir: Path,
    on_request: Callable[[int, LoadLevel, TimedRequest], None] | None = None,
    api_key: str | None = None,
) -> TuneOutcome:
    """The whole experiment; see the module doc."""
    requests = first_turns(
        load_workload(config.workload, classes=config.classes, max_requests=config.max_requests, seed=config.seed)
    )
    if not requests:
        raise UsageError(f"--workload {config.workload} selected no requests; widen --classes or --max-requests.")
    run_dir.mkdir(parents=True, exist_ok=True)
    workload_path = save_workload(requests, run_dir / "workload.jsonl")
    runs, servers = measure_grid(grid, config, requests, run_dir, on_request, api_key)
    sweep, sweep_dir, draft_kind = teacher_sweep(grid, config, workload_path, run_dir)

    rows = _rows(runs)
    throughput = run_throughput(runs)
    cells = analyse(rows, throughput, seed=config.seed)
    fill_from_counters(cells, rows, {(run.k, run.load.value): run.counters for run in runs if run.counters is not None})
    fits = {
        load.value: fitted for load in grid.loads if (fitted := fit_costs(cells, load.value, grid.fit_ks)) is not None
    }
    prediction = predict(cells, fits, sweep_taus(sweep))
    strict_max_k = int(config.thresholds.get("strict_max_k", 4))
    advice = recommend_grid(
        cells,
        strict_classes=config.strict_classes,
        strict_max_k=strict_max_k,
        conservative_share=float(config.thresholds.get("conservative_share", 0.95)),
    )
    profiles = {}
    for load in grid.loads:
        if (fitted := fits.get(load.value)) is None:
            continue
        name = f"cost-profile-{'c' if load.kind == CONCURRENCY else 'r'}{load_text(load.value)}.json"
        device = f"{servers[0]['model']} at {servers[0]['url']}, {load.label}"
        (run_dir / name).write_text(json.dumps(fitted.as_profile(max(max(grid.ks), 16), device), indent=2) + "\n")
        profiles[load_text(load.value)] = name
    kind = grid.loads[0].kind
    raw = {
        "schema_version": TUNE_SCHEMA_VERSION,
        "tool_version": __version__,
        "created_at": utc_now(),
        "config": config.as_dict(),
        "grid": {
            "k": list(grid.ks),
            "loads": [load.value for load in grid.loads],
            **(
                {}
                if kind == CONCURRENCY
                else {"burstiness": grid.loads[0].burstiness, "max_concurrency": grid.loads[0].max_concurrency}
            ),
            "fit_k": list(grid.fit_ks),
            "num_requests": len(requests),
        },
        "baseline_drift": baseline_drift(rows),
        "servers": servers,
        "cells": cells,
        "fits": {load_text(load): dataclasses.asdict(fitted) for load, fitted in fits.items()},
        "prediction": prediction,
        "held_out_error": held_out_error(prediction),
        "recommendation": advice,
        "engine_settings": settings_per_server(advice, draft_kind.serving, kind),
        "cost_profiles": profiles,
        "sweep_dir": sweep_dir,
    }
    # typed once, through the reader's checks: what is written is what every view (and a later read) sees
    result = TuneResult.from_json(strict_json(raw))
    (run_dir / TUNE_JSON).write_text(json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n")
    return TuneOutcome(run_dir, result)


def strict_json(value: Any) -> Any:
    """``value`` as tune.json reads back: every infinite number written "inf" (``vllm bench serve``'s result
    file writes a request rate of inf so), so tune.json stays strict JSON, and every tuple a list."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value
