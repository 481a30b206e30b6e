"""From a DoctorConfig to a run directory: load the pair, build the proposer, replay the workload.

``replay``, ``sweep`` and ``check`` share this module; each view later reads only the run directory.
"""

from __future__ import annotations

import datetime as _dt
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dflash_doctor.config import DoctorConfig
from dflash_doctor.engine.live import GenerationResult, speculative_generate
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.proposers.base import Proposer
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.errors import UsageError
from dflash_doctor.loading import (
    DEMO_DRAFT_DIR,
    demo_target_path,
    fingerprint,
    load_causal_lm,
    load_draft,
    resolve_model_dir,
)
from dflash_doctor.schema import RunWriter, load_run, new_run_meta, write_run_json
from dflash_doctor.workloads import Request, encode_request_turn, load_workload, read_chat_template


@dataclass
class Engine:
    """A loaded target + draft pair and everything needed to replay requests through it."""

    target: TargetModel
    proposer: Proposer
    draft_model: torch.nn.Module
    tokenizer: Any
    stop_ids: frozenset[int]
    models_meta: dict[str, Any]
    target_dir: Path
    draft_dir: Path
    chat_template: str | None = None
    token_text: dict[int, str] = field(default_factory=dict)

    def decode_token(self, token_id: int) -> str:
        """One token's text, memoised (views show tokens without loading a tokenizer)."""
        text = self.token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self.token_text[token_id] = text
        return text


def stop_ids_of(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


def build_proposer(kind: str, draft_model: torch.nn.Module, target: TargetModel, config: DoctorConfig, generator) -> Proposer:
    """The one place that maps a draft kind to its proposer; loops only see the Proposer interface."""
    if kind == "dflash":
        return DFlashProposer(draft_model, target)
    return AutoregressiveProposer(draft_model, temperature=config.temperature, generator=generator)


def load_engine(config: DoctorConfig, *, generator: torch.Generator | None = None) -> Engine:
    """Load the configured pair (the built-in demo pair when no model flags are given)."""
    from transformers import AutoTokenizer

    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {config.device} was asked for but no CUDA device is available; use --device cpu.")
    target_spec = config.target or str(demo_target_path())
    draft_spec = config.draft or str(DEMO_DRAFT_DIR)
    if config.draft is None and not (DEMO_DRAFT_DIR / "config.json").is_file():
        raise UsageError(f"the built-in demo draft is missing from {DEMO_DRAFT_DIR}; reinstall dflash-doctor or pass --draft.")
    target_dir = resolve_model_dir(target_spec)
    target_model = load_causal_lm(target_dir, dtype=config.dtype, device=config.device, trust_remote_code=config.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=config.trust_remote_code)
    draft = load_draft(
        draft_spec, config.draft_kind, target_dir, target_model.config,
        dtype=config.dtype, device=config.device, trust_remote_code=config.trust_remote_code,
    )
    target = TargetModel(target_model)
    proposer = build_proposer(draft.kind, draft.model, target, config, generator)
    target.hidden_state_indices = proposer.needs.hidden_state_indices
    draft_facts: dict[str, Any] = {
        "id": draft_spec,
        "revision_or_hash": fingerprint(draft.model_dir),
        "dtype": config.dtype,
        "device": config.device,
        "kind": draft.kind,
    }
    if draft.kind == "dflash":
        cfg = draft.model.config
        draft_facts.update(
            block_size=cfg.block_size,
            target_layer_ids=list(cfg.target_layer_ids),
            mask_token_id=cfg.mask_token_id,
            num_layers=cfg.num_hidden_layers,
        )
    models_meta = {
        "target": {
            "id": target_spec,
            "revision_or_hash": fingerprint(target_dir),
            "dtype": config.dtype,
            "device": config.device,
            "num_layers": target_model.config.num_hidden_layers,
            "hidden_size": target_model.config.hidden_size,
            "vocab_size": target_model.config.vocab_size,
            "attn_implementation": getattr(target_model.config, "_attn_implementation", None),
        },
        "draft": draft_facts,
    }
    chat_template = read_chat_template(config.chat_template) if config.chat_template else None
    return Engine(
        target=target,
        proposer=proposer,
        draft_model=draft.model,
        tokenizer=tokenizer,
        stop_ids=stop_ids_of(target_model, tokenizer),
        models_meta=models_meta,
        target_dir=target_dir,
        draft_dir=draft.model_dir,
        chat_template=chat_template,
    )


def select_requests(config: DoctorConfig) -> list[Request]:
    return load_workload(config.workload, classes=config.classes, max_requests=config.max_requests, seed=config.seed)


def default_run_dir(command: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{command}-{stamp}"


def max_new_tokens_for(request: Request, config: DoctorConfig) -> int:
    """A request's own limit, bounded by --max-new-tokens so the CLI flag always caps run time."""
    return min(request.max_new_tokens or config.max_new_tokens, config.max_new_tokens)


Generate = Callable[[Request, int, torch.Tensor, int], GenerationResult]  # (request, turn, prompt ids, max new) -> result


def turn_prompts(engine: Engine, request: Request, generate: Generate, config: DoctorConfig):
    """Replay a request turn by turn; a later turn is asked after the target's own answer (MT-Bench style).

    Yields (turn index, prompt ids, result) for each turn.
    """
    answers: list[str] = []
    for turn in range(request.num_turns):
        ids = encode_request_turn(engine.tokenizer, request, answers, chat_template=engine.chat_template)
        prompt = torch.tensor(ids, device=engine.target.device)
        result = generate(request, turn, prompt, max_new_tokens_for(request, config))
        answers.append(engine.tokenizer.decode(result.output_ids, skip_special_tokens=True))
        yield turn, prompt, result


def request_row(engine: Engine, request: Request, turn: int, prompt_len: int, result: GenerationResult) -> dict[str, Any]:
    drafts = [s for s in result.steps if s["num_drafted"] > 0]
    accepted = sum(s["num_accepted"] for s in drafts)
    return {
        "request_id": request.id,
        "class": request.request_class,
        "subclass": request.subclass,
        "turn": turn,
        "prompt_num_tokens": prompt_len,
        "output_token_ids": result.output_ids,
        "output_text": engine.tokenizer.decode(result.output_ids, skip_special_tokens=False),
        "num_output_tokens": len(result.output_ids),
        "num_steps": len(result.steps),
        "num_drafts": len(drafts),
        "num_draft_tokens": sum(s["num_drafted"] for s in drafts),
        "num_accepted_tokens": accepted,
        "tau": 1.0 + accepted / len(drafts) if drafts else None,
        "stop_reason": result.stop_reason,
        "wall_time_s": result.wall_time_s,
    }


def request_key(request: Request, turn: int) -> str:
    """Row id in steps/tokens tables: a multi-turn request's later turns get a ``#t<turn>`` suffix."""
    return request.id if turn == 0 else f"{request.id}#t{turn}"


def write_result_rows(writer: RunWriter, engine: Engine, request: Request, turn: int, prompt_len: int, result: GenerationResult) -> None:
    key = request_key(request, turn)
    row = request_row(engine, request, turn, prompt_len, result)
    row["request_id"] = key
    writer.add("requests", [row])
    writer.add("steps", [{"request_id": key, "class": request.request_class, **s} for s in result.steps])
    writer.add(
        "tokens",
        [
            {
                "request_id": key,
                "class": request.request_class,
                **t,
                "draft_text": engine.decode_token(t["draft_token"]),
                "target_text": engine.decode_token(t["target_token"]),
            }
            for t in result.tokens
        ],
    )
    writer.flush()


def live_replay(engine: Engine, requests: list[Request], config: DoctorConfig, run_dir: Path, meta: dict[str, Any], progress=None) -> dict[str, Any]:
    """Replay requests through the live loop at K = max(--k), streaming rows into ``run_dir``.

    Ctrl-C stops after closing the files: every finished request stays in the run directory.
    """
    k = max(config.k) if config.k else default_k(engine)
    generator = torch.Generator(device=engine.target.device).manual_seed(config.seed)
    if isinstance(engine.proposer, AutoregressiveProposer):
        engine.proposer.generator = generator

    def generate(request: Request, turn: int, prompt: torch.Tensor, max_new: int) -> GenerationResult:
        return speculative_generate(
            engine.target, engine.proposer, prompt, k=k, max_new_tokens=max_new,
            temperature=config.temperature, stop_ids=engine.stop_ids, generator=generator,
        )

    stream_replay(engine, requests, config, RunWriter(run_dir, meta), generate, progress)
    return meta


def stream_replay(engine: Engine, requests: list[Request], config: DoctorConfig, writer: RunWriter,
                  generate: Generate, progress=None, annotate=None) -> None:
    """Replay every turn through ``generate`` and stream its rows into the writer's run directory, then
    the summary.

    ``annotate(request, turn, prompt, result)`` may fill ``result.steps`` / ``result.tokens`` before the
    rows are written (teacher-forced replay). Ctrl-C closes the files first: finished requests are kept.
    """
    run_dir, meta = writer.run_dir, writer.meta
    interrupted = False
    try:
        for request in requests:
            for turn, prompt, result in turn_prompts(engine, request, generate, config):
                if annotate is not None:
                    annotate(request, turn, prompt, result)
                write_result_rows(writer, engine, request, turn, len(prompt), result)
                if progress is not None:
                    progress(result)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        meta["interrupted"] = interrupted
        writer.close()
    finalize_summary(run_dir, meta)
    if interrupted:
        raise KeyboardInterrupt


def finalize_summary(run_dir: Path, meta: dict[str, Any]) -> None:
    """Compute the summary from the tables just written and store it in run.json."""
    from dflash_doctor.metrics import summarize

    run = load_run(run_dir, tables=("requests", "steps"))
    meta["summary"].update(summarize(run.steps, run.requests, seed=meta["config"].get("seed", 0)))
    write_run_json(run_dir, meta)


def start_meta(config: DoctorConfig, engine: Engine, command: str) -> dict[str, Any]:
    from dflash_doctor.checks.environment import collect_environment

    meta = new_run_meta(config.as_dict())
    meta["command"] = command
    meta["models"] = engine.models_meta
    meta["environment"] = collect_environment(engine.models_meta["target"].get("attn_implementation"))
    return meta


class ProgressReporter:
    """Rich progress: requests done, generated tokens/s and the running tau (bonus included)."""

    def __init__(self, total_requests: int, console=None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]replay"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(), console=console, transient=False,
        )
        self.task = self.progress.add_task("replay", total=total_requests, stats="")
        self.tokens = self.drafts = self.accepted = 0
        self.started = time.perf_counter()

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def __call__(self, result: GenerationResult, request_done: bool = True) -> None:
        self.tokens += len(result.output_ids)
        drafts = [s for s in result.steps if s["num_drafted"] > 0]
        self.drafts += len(drafts)
        self.accepted += sum(s["num_accepted"] for s in drafts)
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        tau = 1 + self.accepted / self.drafts if self.drafts else float("nan")
        self.progress.update(self.task, advance=1 if request_done else 0, stats=f"{rate:6.1f} tok/s  tau {tau:.2f}")


def check_k_fits(engine: Engine, ks: tuple[int, ...]) -> None:
    """K above a block drafter's block is impossible: refuse it before any work."""
    max_k = engine.proposer.max_k
    if max_k is not None and max(ks) > max_k:
        raise UsageError(
            f"--k {max(ks)} exceeds what this draft can propose per step ({max_k} = block_size - 1); "
            f"use --k 1-{max_k}."
        )


def teacher_replay(
    engine: Engine,
    requests: list[Request],
    config: DoctorConfig,
    run_dir: Path,
    meta: dict[str, Any],
    progress=None,
    *,
    exact_blocks: bool = False,
) -> dict[int, "pd.DataFrame"]:
    """Teacher-forced replay for every K in ``config.k`` (engine/teacher.py) into ``run_dir``.

    The run directory's steps and tokens are those of the largest K; returns the steps of every K for
    the sweep. At T > 0 acceptance is drawn per slot with the exact per-slot probabilities along a
    sampled target trajectory (a Monte-Carlo walk whose expectation is the expected tau(K)).
    """
    import numpy as np
    import pandas as pd

    from dflash_doctor.engine.live import plain_generate
    from dflash_doctor.engine.teacher import TeacherSequence, slot_table, token_rows, walk_schedule

    ks = tuple(sorted(config.k))
    check_k_fits(engine, ks)
    k_max = ks[-1]
    generator = torch.Generator(device=engine.target.device).manual_seed(config.seed)
    walk_rng = np.random.default_rng(config.seed)
    block_passes = ks if (exact_blocks and engine.proposer.guesses_depend_on_k) else (k_max,)
    steps_by_k: dict[int, list[dict]] = {k: [] for k in ks}
    estimate = {
        k: "exact" if (k in block_passes or not engine.proposer.guesses_depend_on_k) else "truncated" for k in ks
    }
    meta["sweep_estimates"] = {str(k): v for k, v in estimate.items()}
    writer = RunWriter(run_dir, meta)  # before the batched generation: the run is listed from its start

    continuations = greedy_continuations(engine, requests, config) if config.temperature <= 0 else {}

    def generate(request: Request, turn: int, prompt: torch.Tensor, max_new: int) -> GenerationResult:
        known = continuations.get((request.id, turn))
        if known is not None:
            return known
        return plain_generate(
            engine.target, prompt, max_new_tokens=max_new, temperature=config.temperature,
            stop_ids=engine.stop_ids, generator=generator,
        )

    def annotate(request: Request, turn: int, prompt: torch.Tensor, result: GenerationResult) -> None:
        sequence = TeacherSequence(prompt.tolist(), result.output_ids)
        max_new = max_new_tokens_for(request, config)
        tables: dict[int, Any] = {}
        target_pass = None
        for block_k in sorted(block_passes, reverse=True):
            tables[block_k], target_pass = slot_table(
                engine.target, engine.proposer, sequence, block_k, temperature=config.temperature,
                record_divergence=block_k == k_max, target_pass=target_pass,
            )
        key = request_key(request, turn)
        for k in ks:
            table = tables.get(k, tables[k_max])
            matches = table.matches[:, :k]
            if table.accept_probs is not None:
                matches = np.cumprod(walk_rng.random(matches.shape) < table.accept_probs[:, :k], axis=1).astype(bool)
            steps = walk_schedule(matches, result.output_ids, k, max_new, engine.stop_ids)
            steps_by_k[k].extend({"request_id": key, "class": request.request_class, **s} for s in steps)
            if k == k_max:
                result.steps = [{**s, "draft_time_s": float("nan"), "verify_time_s": float("nan")} for s in steps]
                result.tokens = token_rows(tables[k_max], steps, result.output_ids, k_max)

    stream_replay(engine, requests, config, writer, generate, progress, annotate)
    return {k: pd.DataFrame(rows, columns=["request_id", "class", "step", "position", "k", "num_drafted", "num_accepted", "bonus_token"]) for k, rows in steps_by_k.items()}


def greedy_continuations(engine: Engine, requests: list[Request], config: DoctorConfig, batch_size: int = 32):
    """The target's greedy answers to every turn, generated in batches (left padding), turn by turn.

    Teacher-forced replay only needs the committed text, and batching it is what makes a sweep cheap on
    a CPU. Padding can move a logit by rounding, so a near-tie may resolve differently than in a batch-1
    live loop: the lossless check therefore compares the live loop with unbatched decoding, not with these.
    """
    import tempfile

    from dflash_doctor.training import prepare_sequences

    with tempfile.TemporaryDirectory() as scratch:
        records = prepare_sequences(
            engine.target.model, engine.tokenizer, requests, cache_path=Path(scratch) / "continuations.jsonl",
            cache_key={"purpose": "teacher-forced replay"}, max_new_tokens=config.max_new_tokens,
            stop_ids=engine.stop_ids, chat_template=engine.chat_template, batch_size=batch_size,
        )
    by_id = {r.id: r for r in requests}
    results = {}
    for record in records:
        output = record.response_ids[: max_new_tokens_for(by_id[record.request_id], config)]
        stopped = bool(output) and output[-1] in engine.stop_ids
        results[(record.request_id, record.turn)] = GenerationResult(
            output_ids=output, stop_reason="stop_token" if stopped else "max_new_tokens", wall_time_s=float("nan")
        )
    return results


def measure_step_costs(engine: Engine, ks: tuple[int, ...], *, context_tokens: int = 128, repeats: int = 5):
    """Time plain decode, verify of 1 + K tokens and drafting K tokens on this device, at a realistic context."""
    from dflash_doctor.speedup import measure_costs

    target, proposer = engine.target, engine.proposer
    device = target.device
    context = torch.randint(10, engine.tokenizer.vocab_size - 10, (context_tokens,), device=device)
    target.reset()
    prefill = target.forward(context)
    proposer.start(context, prefill.features)
    base = target.cache_length
    token = torch.tensor([int(context[-1])], device=device)

    def decode_step() -> None:
        target.forward(token)
        target.crop(base)

    def verify_step(k: int) -> None:
        target.forward(token.repeat(k + 1))
        target.crop(base)

    def draft_step(k: int) -> None:
        proposer.propose(int(token), k, k)

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    probe = sorted({k for k in (1, 2, 4, 8, 16) if k < max(ks)} | {max(ks), min(ks)})
    costs = measure_costs(decode_step, verify_step, draft_step, probe, repeats=repeats, sync=sync, device=str(device))
    target.reset()
    return costs


def sweep_summary(engine: Engine, config: DoctorConfig, steps_by_k, meta: dict[str, Any]) -> None:
    """Add ``summary.sweep`` and ``recommendation`` (costs measured here, or from --cost-profile)."""
    from dflash_doctor.speedup import build_sweep, load_cost_profile, recommend, rows_by_class

    costs = load_cost_profile(config.cost_profile) if config.cost_profile else measure_step_costs(engine, config.k)
    estimates = {int(k): v for k, v in meta["sweep_estimates"].items()}
    sweep = build_sweep(steps_by_k, costs, estimates, seed=config.seed)
    meta["summary"]["sweep"] = sweep
    strict_max_k = int(config.thresholds.get("strict_max_k", 4))
    share = float(config.thresholds.get("conservative_share", 0.95))
    meta["recommendation"] = recommend(
        rows_by_class(sweep), conservative_share=share, strict_classes=config.strict_classes, strict_max_k=strict_max_k
    )


def default_k(engine: Engine) -> int:
    """K when none was asked for: a block drafter's full block (vLLM's B - 1), else 8."""
    return engine.proposer.max_k or 8


def default_sweep_range(config: DoctorConfig, engine: Engine) -> DoctorConfig:
    """Without --k a sweep covers K = 1..default_k (1..block-1 for a block drafter, 1..8 otherwise)."""
    if config.k:
        return config
    import dataclasses

    return dataclasses.replace(config, k=tuple(range(1, default_k(engine) + 1)))
