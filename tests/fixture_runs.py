"""Synthetic but realistic run directories for the report, compare and dashboard tests.

A fixture run is written through :class:`dflash_doctor.rundir.writer.RunWriter`, exactly as the engine
writes one, so every view is tested against the real on-disk contract (run.json + three Parquet
tables) without loading a model. The numbers behave like a real chain draft:

* each class has its own per-slot acceptance (math > code > chat), decaying with the slot, and each
  request draws its own quality around the class value, so request-level bootstrap CIs are honest;
* ``degrade`` scales every acceptance probability down, like a draft that no longer matches an
  updated target (what ``compare`` must flag);
* a drafted token's text can be the hostile string :data:`HOSTILE_TOKEN_TEXT`, which every HTML
  view must show as text and never execute.

Nothing here is random beyond ``numpy.random.default_rng(seed)``: the same arguments give the same
run (except ``created_at``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from dflash_doctor.stats.deviations import categorize
from dflash_doctor.stats.metrics import summarize, truncate_steps
from dflash_doctor.rundir.tables import REQUESTS_SCHEMA, STEPS_SCHEMA
from dflash_doctor.rundir.run_record import RunMeta, RunRecord
from dflash_doctor.rundir.writer import RunWriter, utc_now
from dflash_doctor.rundir.run_record import StepCosts
from dflash_doctor.stats.speedup import build_sweep, recommend

HOSTILE_TOKEN_TEXT = "<script>alert(1)</script>"

FIXTURE_K_MAX = 8
# P(slot 1 accepted | slots before accepted) per class; later slots decay by SLOT_DECAY each.
CLASS_ACCEPTANCE = {"math": 0.88, "code": 0.8, "chat": 0.62}
DEFAULT_CLASS_ACCEPTANCE = 0.7
SLOT_DECAY = 0.03
REQUEST_QUALITY_SD = 0.04  # spread of per-request acceptance around its class value
OUTPUT_TOKENS_PER_REQUEST = 48
VOCAB_SIZE = 512
NUM_BOOTSTRAP_RESAMPLES = 400  # enough for stable fixture CIs, cheap enough for many fixtures per test run
# Measured-looking step costs (seconds) for the sweep: draft is one pass (flat in K), verify grows.
T_DECODE_S = 0.020
T_DRAFT_S = 0.004
T_VERIFY_BASE_S = 0.021
T_VERIFY_PER_TOKEN_S = 0.0012

_WORDS = [
    "the",
    " of",
    " and",
    " to",
    " in",
    " is",
    " x",
    " =",
    " +",
    " 2",
    " def",
    " return",
    "(",
    ")",
    ":",
    " for",
    " i",
    " range",
    " sum",
    " answer",
    " We",
    " so",
    " then",
    " print",
    "\n",
    " total",
    " each",
    " number",
    " if",
    " else",
    " value",
    " list",
    " step",
    " it",
    " can",
    " be",
    " a",
    " that",
    " this",
]


def _token_text(token_id: int) -> str:
    return _WORDS[token_id % len(_WORDS)] if token_id % 7 else f"<tok{token_id}>"


def _token_category(token_id: int) -> str:
    """The category the engine would record for this fixture token (``<tokN>`` pieces are special tokens)."""
    text = _token_text(token_id)
    return categorize(text.replace(" ", "Ġ"), text, special=text.startswith("<tok"))


def _slot_acceptance(base: float, num_slots: int) -> np.ndarray:
    """Conditional acceptance per slot (1-based slot i -> index i-1), decaying like real drafts do."""
    return np.clip(base - SLOT_DECAY * np.arange(num_slots), 0.02, 0.99)


def _request_rows(
    rng: np.random.Generator,
    request_id: str,
    cls: str,
    k: int,
    num_output_tokens: int,
    degrade: float,
    hostile: bool,
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """Simulate one request's speculative decode: one steps row per step, K tokens rows per step."""
    class_base = CLASS_ACCEPTANCE.get(cls, DEFAULT_CLASS_ACCEPTANCE)
    request_base = float(np.clip(class_base + rng.normal(0.0, REQUEST_QUALITY_SD), 0.05, 0.99)) * (1.0 - degrade)
    slot_accept = _slot_acceptance(request_base, k)
    steps: list[dict[str, Any]] = []
    tokens: list[dict[str, Any]] = []
    output_ids: list[int] = []
    hostile_pending = hostile
    step = 0
    while len(output_ids) < num_output_tokens:
        position = len(output_ids)
        target_ids = rng.integers(0, VOCAB_SIZE, size=k + 1)
        survive = rng.random(k) < slot_accept
        num_accepted = int(np.argmin(survive)) if not survive.all() else k
        draft_ids = target_ids[:k].copy()
        if num_accepted < k:
            draft_ids[num_accepted] = (target_ids[num_accepted] + 1 + rng.integers(0, VOCAB_SIZE - 1)) % VOCAB_SIZE
        for offset in range(1, k + 1):
            accepted = offset <= num_accepted
            idx = offset - 1
            first_rejected = offset == num_accepted + 1
            draft_text = _token_text(int(draft_ids[idx]))
            if first_rejected and hostile_pending:
                draft_text = HOSTILE_TOKEN_TEXT
                hostile_pending = False
            matches = int(draft_ids[idx]) == int(target_ids[idx])
            target_prob = float(rng.uniform(0.55, 0.99) if matches else rng.uniform(0.005, 0.3))
            draft_prob_target = float(rng.uniform(0.5, 0.97) if matches else rng.uniform(0.01, 0.4))
            tokens.append(
                {
                    "request_id": request_id,
                    "class": cls,
                    "step": step,
                    "position": position + offset - 1,
                    "offset": offset,
                    "draft_token": int(draft_ids[idx]),
                    "target_token": int(target_ids[idx]),
                    "draft_text": draft_text,
                    "target_text": _token_text(int(target_ids[idx])),
                    "accepted": accepted,
                    "target_prob_of_draft": target_prob,
                    "draft_prob_of_target": draft_prob_target,
                    "target_rank_in_draft": 0 if matches else int(rng.integers(1, 20)),
                    "kl_target_draft": float(rng.gamma(1.0, 0.05 if matches else 0.8)),
                    "total_variation": float(rng.uniform(0.0, 0.2) if matches else rng.uniform(0.3, 0.9)),
                    "target_entropy": float(rng.gamma(2.0, 0.4)),
                    "target_top1_margin": max(0.0, 2.0 * target_prob - 1.0) if matches else 0.5 * (1.0 - target_prob),
                    "draft_topk_ids": [
                        int(draft_ids[idx]),
                        int(target_ids[idx]),
                        int((draft_ids[idx] + 3) % VOCAB_SIZE),
                    ],
                    "target_topk_ids": [
                        int(target_ids[idx]),
                        int(draft_ids[idx]),
                        int((target_ids[idx] + 5) % VOCAB_SIZE),
                    ],
                    "target_category": _token_category(int(target_ids[idx])),
                    "draft_category": _token_category(int(draft_ids[idx])),
                }
            )
        bonus = int(target_ids[num_accepted])
        output_ids.extend(int(t) for t in draft_ids[:num_accepted])
        output_ids.append(bonus)
        steps.append(
            {
                "request_id": request_id,
                "class": cls,
                "step": step,
                "position": position,
                "k": k,
                "num_drafted": k,
                "num_accepted": num_accepted,
                "bonus_token": bonus,
                "draft_time_s": T_DRAFT_S * float(rng.uniform(0.9, 1.1)),
                "verify_time_s": (T_VERIFY_BASE_S + T_VERIFY_PER_TOKEN_S * k) * float(rng.uniform(0.9, 1.1)),
            }
        )
        step += 1
    num_drafts = len(steps)
    num_accepted_total = sum(s["num_accepted"] for s in steps)
    text = "".join(_token_text(t) for t in output_ids)
    request = {
        "request_id": request_id,
        "class": cls,
        "subclass": f"{cls}-synthetic",
        "turn": 1,
        "prompt_num_tokens": int(rng.integers(20, 200)),
        "output_token_ids": output_ids,
        "output_text": (HOSTILE_TOKEN_TEXT + text) if hostile else text,
        "num_output_tokens": len(output_ids),
        "num_steps": num_drafts,
        "num_drafts": num_drafts,
        "num_draft_tokens": num_drafts * k,
        "num_accepted_tokens": num_accepted_total,
        "tau": 1.0 + num_accepted_total / num_drafts,
        "stop_reason": "length",
        "wall_time_s": sum(s["draft_time_s"] + s["verify_time_s"] for s in steps),
    }
    return request, steps, tokens


def _checks() -> list[dict[str, Any]]:
    """One check per status, with findings of every severity, as the checks runner writes them."""
    return [
        {
            "id": "tokenizer_match",
            "status": "pass",
            "summary": "Target and draft tokenizers encode the probe corpus identically.",
            "metrics": {"num_probe_texts": 200, "num_mismatches": 0},
            "findings": [
                {
                    "severity": "info",
                    "message": "Vocab sizes agree (512 rows, 512 tokens).",
                    "evidence": "config.vocab_size=512, len(tokenizer)=512",
                    "fix": "",
                }
            ],
        },
        {
            "id": "chat_template",
            "status": "warn",
            "summary": "Draft was trained with thinking on; serving renders enable_thinking=False.",
            "metrics": {"num_conversations": 12, "num_byte_diffs": 3},
            "findings": [
                {
                    "severity": "warn",
                    "message": "Rendered prompts differ in 3 of 12 conversations (<think> block).",
                    "evidence": "first diff at byte 118: '<think>\\n\\n</think>' vs ''",
                    "fix": "Serve with enable_thinking matching the draft's training data (z-lab #133).",
                }
            ],
        },
        {
            "id": "layer_offset",
            "status": "fail",
            "summary": "A neighbouring target-layer offset accepts more than the configured one.",
            "metrics": {"tau_offset_minus1": 3.0, "tau_offset_0": 2.0, "tau_offset_plus1": 1.7},
            "findings": [
                {
                    "severity": "fail",
                    "message": "Offset -1 gives tau 3.0 vs 2.0 at the configured ids.",
                    "evidence": "target_layer_ids=[1, 9, 17, 25]",
                    "fix": "Shift target_layer_ids by -1 (hidden_states[l + 1] convention, vLLM PR #42704).",
                }
            ],
        },
        {"id": "engine_flags", "status": "skip", "summary": "No --engine-config given.", "metrics": {}, "findings": []},
        {
            "id": "lossless",
            "status": "error",
            "summary": "The check raised RuntimeError: probe model missing.",
            "metrics": {},
            "findings": [
                {
                    "severity": "fail",
                    "message": "RuntimeError: probe model missing",
                    "evidence": "Traceback (most recent call last): ...",
                    "fix": "",
                }
            ],
        },
    ]


def make_fixture_run(
    path: Path | str,
    *,
    seed: int = 0,
    num_requests: int = 24,
    classes: Sequence[str] = ("math", "code", "chat"),
    with_sweep: bool = True,
    degrade: float = 0.0,
    hostile_token: bool = True,
    num_tokens_target: int | None = None,
) -> Path:
    """Write a synthetic run directory at ``path`` and return it.

    ``num_requests`` is spread round-robin over ``classes`` (0 gives an empty run that must still
    render). ``degrade`` in [0, 1) scales every acceptance probability by ``1 - degrade``.
    ``hostile_token`` puts :data:`HOSTILE_TOKEN_TEXT` as the text of the first rejected draft token
    (and at the start of the output text) of the first request. ``num_tokens_target``, when given,
    sizes the outputs so that tokens.parquet holds about that many rows (for benchmarks of large runs).
    """
    run_dir = Path(path)
    rng = np.random.default_rng(seed)
    k = FIXTURE_K_MAX
    num_output_tokens = OUTPUT_TOKENS_PER_REQUEST
    if num_tokens_target is not None and num_requests > 0:
        mean_tokens_per_step = 1.0 + 3.0 * (1.0 - degrade)
        steps_per_request = num_tokens_target / (num_requests * k)
        num_output_tokens = max(1, int(round(steps_per_request * mean_tokens_per_step)))
    meta = RunRecord(
        meta=RunMeta(command="replay", created_at=utc_now()),
        config={
            "target": "fixture/target-135m",
            "draft": "fixture/dflash-b9",
            "draft_kind": "dflash",
            "workload": "fixture",
            "k": list(range(1, k + 1)) if with_sweep else [k],
            "max_new_tokens": num_output_tokens,
            "temperature": 0.0,
            "seed": seed,
        },
    ).to_json()
    meta["created_at"] = "2026-01-01T00:00:00+00:00"
    meta["models"] = {
        "target": {
            "id": "fixture/target-135m",
            "revision_or_hash": "sha256:0f1e2d3c",
            "dtype": "float32",
            "device": "cpu",
            "kind": "target",
        },
        "draft": {
            "id": "fixture/dflash-b9",
            "revision_or_hash": "sha256:a1b2c3d4",
            "dtype": "float32",
            "device": "cpu",
            "kind": "dflash",
            "block_size": k + 1,
            "target_layer_ids": [1, 9, 17, 25],
            "mask_token_id": VOCAB_SIZE - 1,
        },
    }
    meta["environment"] = {
        "python": "3.11.9",
        "torch": "2.13.0",
        "transformers": "5.24.0",
        "tokenizers": "0.22.1",
        "cuda": None,
        "gpu": None,
        "attn_implementation": "sdpa",
    }
    meta["checks"] = _checks()
    all_requests: list[dict[str, Any]] = []
    all_steps: list[dict[str, Any]] = []
    with RunWriter(run_dir, meta) as writer:
        for index in range(num_requests):
            cls = classes[index % len(classes)]
            request, steps, tokens = _request_rows(
                rng, f"{cls}-{index:04d}", cls, k, num_output_tokens, degrade, hostile_token and index == 0
            )
            all_requests.append(request)
            all_steps.extend(steps)
            writer.add("requests", [request])
            writer.add("steps", steps)
            writer.add("tokens", tokens)
            writer.flush()
        requests_frame = pd.DataFrame(all_requests, columns=list(REQUESTS_SCHEMA.names))
        steps_frame = pd.DataFrame(all_steps, columns=list(STEPS_SCHEMA.names))
        record = RunRecord.from_json(meta)
        record.summary = summarize(steps_frame, requests_frame, num_slots=k, n_boot=NUM_BOOTSTRAP_RESAMPLES, seed=seed)
        if with_sweep and len(steps_frame):
            costs = StepCosts(
                t_decode_s=T_DECODE_S,
                t_verify_s={kk: T_VERIFY_BASE_S + T_VERIFY_PER_TOKEN_S * kk for kk in range(1, k + 1)},
                t_draft_s={kk: T_DRAFT_S for kk in range(1, k + 1)},
                source="measured",
                device="cpu",
            )
            steps_by_k = {kk: truncate_steps(steps_frame, kk) for kk in range(1, k + 1)}
            estimate_by_k = {kk: "exact" if kk == k else "truncated" for kk in range(1, k + 1)}
            priced = build_sweep(steps_by_k, costs, estimate_by_k, n_boot=NUM_BOOTSTRAP_RESAMPLES, seed=seed)
            record.summary.sweep = priced.sweep
            record.recommendation = recommend(priced.sweep.scopes(), replicates=priced.replicates)
        writer.meta = record.to_json()
    return run_dir


# ------------------------------------------------------------------------------------ a journal written by hand


def request_rows(request_id: str, num_steps: int) -> dict[str, list[dict]]:
    """A request's rows in the three tables: ``num_steps`` steps drafting 2 tokens, the first accepted."""
    steps = [
        {
            "request_id": request_id,
            "class": "math",
            "step": s,
            "position": 1 + 2 * s,
            "k": 2,
            "num_drafted": 2,
            "num_accepted": 1,
            "bonus_token": 5,
            "draft_time_s": 0.01,
            "verify_time_s": 0.02,
        }
        for s in range(num_steps)
    ]
    tokens = [
        {
            "request_id": request_id,
            "class": "math",
            "step": s,
            "position": 1 + 2 * s + j,
            "offset": j + 1,
            "draft_token": 7,
            "target_token": 7 if j == 0 else 8,
            "accepted": j == 0,
        }
        for s in range(num_steps)
        for j in range(2)
    ]
    request = {
        "request_id": request_id,
        "class": "math",
        "subclass": "gsm",
        "turn": 0,
        "prompt_num_tokens": 10,
        "output_token_ids": [7] * (2 * num_steps + 1),
        "output_text": "x",
        "num_output_tokens": 2 * num_steps + 1,
        "num_steps": num_steps,
        "num_drafts": num_steps,
        "num_draft_tokens": 2 * num_steps,
        "num_accepted_tokens": num_steps,
        "tau": 2.0,
        "stop_reason": "max_new_tokens",
        "wall_time_s": 0.1,
    }
    return {"steps": steps, "tokens": tokens, "requests": [request]}


def write_request(writer: RunWriter, request_id: str, num_steps: int = 3) -> None:
    for table, rows in request_rows(request_id, num_steps).items():
        writer.add(table, rows)
    writer.flush()
