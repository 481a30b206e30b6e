"""Ablation of `train-draft`'s levers on the demo pair: short runs of each variant, held-out tau of each.

Why a script: the model card's ablation table must come from measured numbers, and on one GPU the data
(the target's own answers) is generated once and shared by every variant, and so is the frozen target's
pass over it (the taps every row trains on). Every row trains the same number of steps from the same seed
and is measured on the same held-out requests (the `mix` eval split, which never overlaps the training
prompts: other templates, other questions), so the rows differ only by their lever. Each row is also
measured on training sequences it was trained on, which tells under-fitting (both low) from poor
generalisation (train high, held-out low).

Data and training use the target in ``--dtype`` (bfloat16 on CUDA: batched generation of the answers is
the slow part and bf16 halves its memory traffic); the held-out requests are answered and verified by the
float32 target, as the demo serves it. The caches land in ``--out`` under the same keys `train-draft`
uses, so a later `train-draft --dtype bfloat16 --out <same dir>` with the same data flags generates
nothing. Rows already in ``ablation.json`` are kept and skipped (a run cut short continues), and rows
that would not end before ``--deadline`` are left for the next run.

Usage (GPU): python scripts/draft_ablation.py --out runs/draft --steps 400 --extra-word-problems 3000
    --self-written-prompts 2000
Smoke test (CPU, tiny sizes): python scripts/draft_ablation.py --out /tmp/abl --steps 2 --tiny
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from dflash_doctor.engine.dflash_model import DFlashDraftModel, default_target_layer_ids
from dflash_doctor.models.loading import demo_target_path, load_causal_lm, resolve_model_dir
from dflash_doctor.models.pair import stop_ids_of
from dflash_doctor.models.training import (
    DEFAULT_NUM_TAPS,
    SELF_WRITTEN_PROMPTS_FILE,
    TrainConfig,
    choose_mask_token_id,
    data_cache_key,
    draft_config_for_target,
    extract_features,
    held_out_steps,
    init_draft_from_target,
    prepare_sequences,
    prepare_training_data,
    self_written_prompts,
    tau_by_class,
    train_dflash_draft,
)
from dflash_doctor.inputs.workloads import extra_word_problems, load_workload

LR = 1e-3
FLOAT32_EVAL_FILE = "eval_sequences_float32.jsonl"  # held-out answers of the float32 target (the served one)
TRAIN_PROBE_REQUESTS = 48  # training requests (greedy answers) measured like the held-out ones


def variants(samples: int, batch_size: int) -> list[dict]:
    """Rows of the table: the reference, then one lever at a time on top of it."""
    reference = {
        "name": f"reference: all prompts, greedy + {samples} sampled answers, scratch, 2 layers, gamma 7, block 16, "
        f"batch {batch_size}",
        "lever": "reference",
        "answers": "sampled",
        "init": False,
        "layers": 2,
        "gamma": 7.0,
        "block": 16,
        "batch": batch_size,
    }
    # ordered by what the longer run's recipe depends on, so a run cut short by --deadline measures those first
    return [
        reference,
        {**reference, "name": "init from the target's last layers", "lever": "init", "init": True},
        {**reference, "name": "3 layers", "lever": "layers3", "layers": 3},
        {**reference, "name": "gamma 4 (steeper slot decay)", "lever": "gamma4", "gamma": 4.0},
        {
            **reference,
            "name": f"batch {4 * batch_size} (4x the sequences seen)",
            "lever": "batch4",
            "batch": 4 * batch_size,
        },
        {**reference, "name": "greedy answers only (no sampled ones)", "lever": "answers", "answers": "greedy"},
        {**reference, "name": "block size 8 (served K = 7)", "lever": "block8", "block": 8},
        {**reference, "name": "gamma 12 (flatter slot decay)", "lever": "gamma12", "gamma": 12.0},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--dtype", default=None, help="Target dtype for data and training (default: bfloat16 on CUDA, else float32)."
    )
    parser.add_argument("--extra-word-problems", type=int, default=3000)
    parser.add_argument("--self-written-prompts", type=int, default=2000)
    parser.add_argument("--samples-per-prompt", type=int, default=3)
    parser.add_argument("--generation-batch-size", type=int, default=2048)
    parser.add_argument("--eval-requests", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--rows", default="", help="Comma-separated levers to run (default: all).")
    parser.add_argument(
        "--deadline", type=float, default=None, help="Unix time: rows that would end after it are left for a later run."
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: a handful of requests, short answers.")
    args = parser.parse_args()
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    deadline = args.deadline or time.time() + 1e9
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_model_dir(str(demo_target_path()))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = load_causal_lm(target_dir, dtype=dtype, device=device)
    served = load_causal_lm(target_dir, dtype="float32", device=device)
    stop_ids = stop_ids_of(target, tokenizer)
    template = tokenizer.chat_template
    key = data_cache_key(target_dir, max_new_tokens=args.max_new_tokens, dtype=dtype, chat_template=template)
    served_key = data_cache_key(target_dir, max_new_tokens=args.max_new_tokens, dtype="float32", chat_template=template)

    held_out = load_workload("mix", split="eval", max_requests=args.eval_requests)
    eval_records = prepare_sequences(
        served,
        tokenizer,
        held_out,
        cache_path=out / FLOAT32_EVAL_FILE,
        cache_key=served_key,
        max_new_tokens=args.max_new_tokens,
        stop_ids=stop_ids,
        batch_size=args.generation_batch_size,
    )
    base = load_workload("mix", split="train", max_requests=12 if args.tiny else None)
    extra = extra_word_problems(args.extra_word_problems) if args.extra_word_problems else []
    written = (
        self_written_prompts(
            target,
            tokenizer,
            args.self_written_prompts,
            cache_path=out / SELF_WRITTEN_PROMPTS_FILE,
            cache_key=key,
            stop_ids=stop_ids,
            batch_size=args.generation_batch_size,
        )
        if args.self_written_prompts
        else []
    )
    records, _ = prepare_training_data(
        target,
        tokenizer,
        base + extra + written,
        [],
        out_dir=out,
        cache_key=key,
        max_new_tokens=args.max_new_tokens,
        stop_ids=stop_ids,
        samples_per_prompt=args.samples_per_prompt,
        batch_size=args.generation_batch_size,
        progress=False,
    )
    data_seconds = time.perf_counter() - started
    records = [r for r in records if len(r.token_ids) >= r.prompt_length + 2]
    greedy = [
        i for i, r in enumerate(records) if r.turn < 1000
    ]  # sampled answers are stored as turn 1000 * (s + 1) + t
    probe_ids = sorted({records[i].request_id for i in greedy})[:: max(1, len(greedy) // TRAIN_PROBE_REQUESTS)][
        :TRAIN_PROBE_REQUESTS
    ]
    train_probe = [records[i] for i in greedy if records[i].request_id in set(probe_ids)]
    used_ids = {t for r in records for t in r.token_ids}
    mask = choose_mask_token_id(tokenizer, target.config, used_ids, template)
    layer_ids = default_target_layer_ids(target.config.num_hidden_layers, DEFAULT_NUM_TAPS)
    print(
        f"data: {len(base)} mix + {len(extra)} extra GSM + "
        f"{len(written)} target-written prompts; {len(greedy)} greedy + "
        f"{len(records) - len(greedy)} sampled sequences, "
        f"{sum(len(r.response_ids) for r in records):,} response tokens; "
        f"{len(eval_records)} held-out turns; {data_seconds:.0f} s",
        flush=True,
    )

    t0 = time.perf_counter()
    probe = DFlashDraftModel(
        draft_config_for_target(
            target.config, block_size=16, num_layers=1, mask_token_id=mask, target_layer_ids=layer_ids
        )
    )
    features = extract_features(
        target,
        [r.token_ids for r in records],
        probe.hidden_state_indices,
        batch_size=64,
        device=device,
        dtype=torch.bfloat16 if device == "cuda" else None,
    )
    print(f"features: {time.perf_counter() - t0:.0f} s", flush=True)

    results_path = out / "ablation.json"
    summary = json.loads(results_path.read_text()) if results_path.is_file() else {"rows": []}
    done = {row["lever"] for row in summary["rows"]}
    wanted = {lever.strip() for lever in args.rows.split(",") if lever.strip()}
    for row in variants(args.samples_per_prompt, args.batch_size):
        if row["lever"] in done or (wanted and row["lever"] not in wanted):
            continue
        per_sequence = max((r["train_seconds"] / r["sequences_seen"] for r in summary["rows"]), default=1e-3)
        estimate = 30.0 + per_sequence * args.steps * row["batch"] * max(1.0, row["layers"] / 2)
        if time.time() + estimate > deadline:
            print(f"left for a later run (about {estimate:.0f} s): {row['name']}", flush=True)
            continue
        torch.manual_seed(0)
        draft = DFlashDraftModel(
            draft_config_for_target(
                target.config,
                block_size=row["block"],
                num_layers=row["layers"],
                mask_token_id=mask,
                target_layer_ids=layer_ids,
            )
        )
        if row["init"]:
            init_draft_from_target(draft, target)
        chosen = greedy if row["answers"] == "greedy" else range(len(records))
        config = TrainConfig(
            steps=args.steps,
            batch_size=row["batch"],
            lr=LR,
            loss_decay_gamma=row["gamma"],
            device=device,
            log_every=max(1, args.steps // 10),
        )
        t0 = time.perf_counter()
        result = train_dflash_draft(
            target,
            [records[i].token_ids for i in chosen],
            [records[i].prompt_length for i in chosen],
            config,
            draft,
            features=[features[i] for i in chosen],
        )
        train_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        tau = tau_by_class(held_out_steps(served, result.draft, eval_records, stop_ids=stop_ids))
        train_tau = tau_by_class(held_out_steps(target, result.draft, train_probe, stop_ids=stop_ids))
        eval_seconds = time.perf_counter() - t0
        size_mb = sum(p.numel() for p in result.draft.parameters()) * 4 / 1e6
        summary["rows"].append(
            {
                **row,
                "steps": args.steps,
                "sequences_seen": args.steps * row["batch"],
                "num_sequences": result.num_sequences,
                "train_seconds": train_seconds,
                "eval_seconds": eval_seconds,
                "size_mb_float32": size_mb,
                "final_train_loss": result.log[-1]["loss"],
                "tau": tau,
                "train_tau": train_tau,
            }
        )
        summary.update(
            {
                "data_seconds": data_seconds,
                "steps": args.steps,
                "lr": LR,
                "dtype": dtype,
                "eval_requests": len({r.request_id for r in eval_records}),
                "train_probe_requests": len(probe_ids),
            }
        )
        results_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(
            f"{row['name']}: "
            + ", ".join(f"{c} {v['tau']:.2f} [{v['tau_ci'][0]:.2f}, {v['tau_ci'][1]:.2f}]" for c, v in tau.items())
            + f"; train-set overall {train_tau['overall']['tau']:.2f} "
            f"({train_seconds:.0f} s train, {eval_seconds:.0f} s eval, "
            f"{size_mb:.0f} MB)",
            flush=True,
        )
        del draft, result
        if device == "cuda":
            torch.cuda.empty_cache()

    if summary["rows"]:
        classes = list(summary["rows"][0]["tau"])
        lines = [
            "| variant | sequences seen | " + " | ".join(classes) + " | train-set overall | train s |",
            "|---|---|" + "---|" * (len(classes) + 2),
        ]
        for row in summary["rows"]:
            cells = [
                f"{row['tau'][c]['tau']:.2f} [{row['tau'][c]['tau_ci'][0]:.2f}, {row['tau'][c]['tau_ci'][1]:.2f}]"
                for c in classes
            ]
            lines.append(
                f"| {row['name']} | {row['sequences_seen']:,} | "
                + " | ".join(cells)
                + f" | {row['train_tau']['overall']['tau']:.2f} | {row['train_seconds']:.0f} |"
            )
        (out / "ablation.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
