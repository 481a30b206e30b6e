"""`dflash-doctor check` end to end: load, replay every K, probe, run every check, write the run and reports.

Order matters for the user: a bad input fails before any model work; the expensive replay runs once
(teacher-forced, every K) and every check reads its results; the run directory and reports are written
even when a check fails, so CI keeps the evidence.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_doctor import runner
from dflash_doctor.config import DoctorConfig
from dflash_doctor.engine.live import speculative_generate
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, walk_schedule
from dflash_doctor.loading import read_config, weights_fingerprint
from dflash_doctor.schema import write_run_json

PROBE_REQUESTS = 3  # requests replayed again for the lossless check and the layer-offset probe


@dataclasses.dataclass
class ReplayedTurn:
    """A first turn the teacher-forced replay generated: reused by the probes (no second generation)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    max_new_tokens: int


def first_turns(run_dir: Path, requests, config: DoctorConfig, limit: int) -> list[ReplayedTurn]:
    from dflash_doctor.schema import load_run

    table = load_run(run_dir, tables=("requests",)).requests
    table = table[table["turn"] == 0].head(limit)
    by_id = {r.id: r for r in requests}
    turns = []
    for row in table.itertuples(index=False):
        request = by_id[row.request_id]
        turns.append(ReplayedTurn(row.request_id, [], list(row.output_token_ids), runner.max_new_tokens_for(request, config)))
    return turns


@torch.inference_mode()
def lossless_probe(engine: runner.Engine, requests, config: DoctorConfig, turns: list[ReplayedTurn]) -> dict[str, Any]:
    """The live loop must reproduce the target's own (unbatched) greedy decoding; report the first divergence."""
    from dflash_doctor.engine.live import plain_generate
    from dflash_doctor.workloads import encode_request_turn

    by_id = {r.id: r for r in requests}
    k = max(config.k)
    result: dict[str, Any] = {"num_requests": 0, "num_identical": 0, "dtype": config.dtype, "divergences": []}
    for turn in turns:
        prompt = torch.tensor(encode_request_turn(engine.tokenizer, by_id[turn.request_id], [], chat_template=engine.chat_template),
                              device=engine.target.device)
        live = speculative_generate(engine.target, engine.proposer, prompt, k=k, max_new_tokens=turn.max_new_tokens,
                                    stop_ids=engine.stop_ids, record_tokens=False).output_ids
        plain = plain_generate(engine.target, prompt, max_new_tokens=turn.max_new_tokens, stop_ids=engine.stop_ids).output_ids
        result["num_requests"] += 1
        if live == plain:
            result["num_identical"] += 1
            continue
        position = next(i for i, (a, b) in enumerate(zip(live + [-1], plain + [-1])) if a != b)
        engine.target.reset()
        logits = engine.target.forward(torch.cat([prompt, torch.tensor(plain[:position], device=prompt.device)])).logits[-1]
        engine.target.reset()
        top2 = logits.topk(2).values
        result["divergences"].append({
            "request_id": turn.request_id,
            "position": position,
            "speculative_token": live[position] if position < len(live) else -1,
            "plain_token": plain[position] if position < len(plain) else -1,
            "speculative_text": engine.decode_token(live[position]) if position < len(live) else "",
            "plain_text": engine.decode_token(plain[position]) if position < len(plain) else "",
            "top2_margin": float(top2[0] - top2[1]),
        })
    return result


@torch.inference_mode()
def layer_offset_probe(engine: runner.Engine, requests, config: DoctorConfig, turns: list[ReplayedTurn]) -> tuple[dict[int, float], int]:
    """tau at the full block with the draft's target layer ids shifted by -1, 0 and +1 (REFERENCE.md section 1).

    A draft trained on layers ``l`` reads the right features only at offset 0; a neighbour beating it
    means the configured ids are off by one (vLLM PR #42704, llama.cpp #25792). Also returns the number
    of drafts behind offset 0's tau, so the check can tell a verdict from noise.
    """
    from dflash_doctor.workloads import encode_request_turn

    draft = engine.draft_model
    cfg = draft.config
    num_layers = engine.target.model.config.num_hidden_layers
    k = engine.proposer.max_k
    by_id = {r.id: r for r in requests}
    taus: dict[int, float] = {}
    drafts_at_zero = 0
    for offset in (-1, 0, 1):
        ids = [l + offset for l in cfg.target_layer_ids]
        if min(ids) < 0 or max(ids) >= num_layers:
            continue
        shifted = copy.copy(draft)
        shifted.config = dataclasses.replace(cfg, target_layer_ids=ids)
        target = TargetModel(engine.target.model)
        proposer = DFlashProposer(shifted, target)
        target.hidden_state_indices = proposer.needs.hidden_state_indices
        drafts = accepted = 0
        for turn in turns:
            prompt = encode_request_turn(engine.tokenizer, by_id[turn.request_id], [], chat_template=engine.chat_template)
            table, _ = slot_table(target, proposer, TeacherSequence(prompt, turn.output_ids), k, record_divergence=False)
            steps = [s for s in walk_schedule(table.matches, turn.output_ids, k, turn.max_new_tokens, engine.stop_ids) if s["num_drafted"]]
            drafts += len(steps)
            accepted += sum(s["num_accepted"] for s in steps)
        taus[offset] = 1.0 + accepted / drafts if drafts else float("nan")
        drafts_at_zero = drafts if offset == 0 else drafts_at_zero
    return taus, drafts_at_zero


def check_context(engine: runner.Engine, requests, config: DoctorConfig, meta: dict[str, Any], extras: dict[str, Any]):
    """Everything the checks read, gathered once from the loaded pair, the run and the probes."""
    from transformers import AutoTokenizer

    from dflash_doctor.checks.base import CheckContext
    from dflash_doctor.checks.engine_config import parse_engine_config

    draft_config = read_config(engine.draft_dir)
    draft_tokenizer = None
    if engine.models_meta["draft"]["kind"] != "dflash":
        try:
            draft_tokenizer = AutoTokenizer.from_pretrained(engine.draft_dir)
        except (OSError, ValueError):
            draft_tokenizer = None
    recorded = draft_config.get("dflash_doctor") or {}
    corpus = [m["content"] for r in requests for m in (r.messages or []) if isinstance(m.get("content"), str)]
    corpus += [r.prompt for r in requests if r.prompt]
    return CheckContext(
        target_tokenizer=engine.tokenizer,
        draft_tokenizer=draft_tokenizer,
        target_config=engine.target.model.config,
        draft_config=draft_config,
        draft_kind=engine.models_meta["draft"]["kind"],
        environment=meta["environment"],
        engine_config=parse_engine_config(config.engine_config) if config.engine_config else None,
        corpus=corpus,
        target_template=engine.chat_template or getattr(engine.tokenizer, "chat_template", None),
        draft_template=getattr(draft_tokenizer, "chat_template", None) if draft_tokenizer is not None else None,
        draft_training_template=recorded.get("chat_template"),
        run_meta=meta,
        config=config,
        extras={"draft_weight_shapes": draft_weight_shapes(engine.draft_dir), **extras},
    )


def draft_weight_shapes(draft_dir: Path) -> dict[str, list[int]]:
    """Tensor shapes of the draft's safetensors (headers only), for draft-config's fc / own-head rules."""
    from dflash_doctor.checks.draft_config import read_safetensors_shapes

    shapes: dict[str, list[int]] = {}
    for file in sorted(Path(draft_dir).glob("*.safetensors")):
        shapes.update({name.removeprefix("model."): shape for name, shape in read_safetensors_shapes(file).items()})
    return shapes


def run_doctor(config: DoctorConfig, *, scenario=None, only=(), skip=(), exact_blocks: bool = False, console=None):
    """The whole `check`: returns (run_dir, check results, meta)."""
    from dflash_doctor.checks.base import run_checks
    from dflash_doctor.report import render_reports

    requests = runner.select_requests(config)
    engine = runner.load_engine(config)
    if scenario is not None:
        requests, config = scenario.apply(engine, requests, config)
    served_k = max(config.k) if config.k else None  # the K the user serves, when they said
    if served_k is not None:
        runner.check_k_fits(engine, config.k)
    max_k = max(runner.default_k(engine), served_k or 0)
    sweep_config = dataclasses.replace(config, k=tuple(range(1, max_k + 1)))
    run_dir = Path(config.out) if config.out else runner.default_run_dir("check")
    meta = runner.start_meta(sweep_config, engine, "check")
    meta["scenario"] = scenario.name if scenario is not None else None
    meta["served_k"] = served_k
    with runner.ProgressReporter(sum(r.num_turns for r in requests), console) as progress:
        steps_by_k = runner.teacher_replay(engine, requests, sweep_config, run_dir, meta, progress, exact_blocks=exact_blocks)
    runner.sweep_summary(engine, sweep_config, steps_by_k, meta)

    turns = first_turns(run_dir, requests, sweep_config, PROBE_REQUESTS)
    extras: dict[str, Any] = {
        "output_token_ids": [t for ids in _output_ids(run_dir) for t in ids],
        "prompt_format": {
            "num_raw_prompts": sum(r.prompt is not None for r in requests),
            "num_templated": sum(r.messages is not None for r in requests),
        },
        "target_weights_fingerprint": weights_fingerprint(engine.target.model),
        "served_k": served_k,
    }
    if config.temperature == 0:
        extras["lossless"] = lossless_probe(engine, requests, sweep_config, turns)
    if engine.models_meta["draft"]["kind"] == "dflash":
        extras["offset_probe"], extras["offset_probe_drafts"] = layer_offset_probe(engine, requests, sweep_config, turns)
    ctx_config = dataclasses.replace(config, k=(served_k,) if served_k else ())
    ctx = check_context(engine, requests, ctx_config, meta, extras)
    results = run_checks(ctx, only=only, skip=skip)
    meta["checks"] = [r.to_dict() for r in results]
    meta["probes"] = {k: v for k, v in extras.items() if k in ("lossless", "offset_probe", "offset_probe_drafts", "prompt_format", "served_k", "target_weights_fingerprint")}
    write_run_json(run_dir, meta)
    render_reports(run_dir)
    return run_dir, results, meta


def _output_ids(run_dir: Path) -> list[list[int]]:
    from dflash_doctor.schema import load_run

    return [list(np.asarray(ids).tolist()) for ids in load_run(run_dir, tables=("requests",)).requests["output_token_ids"]]
