"""Per-step acceptance of our live loop vs the official ``dflash_generate`` on the real demo pair.

For the shipped demo draft and its sliding / scaled / DFlash 2 variants (tests/official_dflash.py), runs
the first turns of a workload through the official loop and through ours under both end-of-request
conventions, and prints per variant: requests, outputs equal, steps compared and equal (all steps under
the ``official`` convention; steps whose official block was full under ``vllm``), and tau both sides.
CPU-friendly: ``--max-requests`` and ``--max-new-tokens`` bound the run.

    .venv/bin/python benchmarks/official_parity.py --max-requests 24 --max-new-tokens 96 --k 15
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from official_dflash import REAL_VARIANTS, official_generate, real_variant  # noqa: E402

from dflash_doctor.engine.schedule import CONVENTIONS  # noqa: E402
from dflash_doctor.engine.live import speculative_generate  # noqa: E402
from dflash_doctor.engine.proposers.dflash import DFlashProposer  # noqa: E402
from dflash_doctor.engine.target import TargetModel  # noqa: E402
from dflash_doctor.models.loading import (  # noqa: E402
    DEMO_DRAFT_DIR,
    demo_target_path,
    load_causal_lm,
    load_dflash_draft,
    resolve_model_dir,
)
from dflash_doctor.models.pair import stop_ids_of  # noqa: E402
from dflash_doctor.inputs.workloads import encode_request_turn, load_workload  # noqa: E402


def compare(target_model, official_draft, ours, prompts, stop_ids, k, max_new):
    block = k + 1
    wrapped = TargetModel(target_model, ours.hidden_state_indices)
    proposer = DFlashProposer(ours, wrapped)
    row = {
        "requests": 0,
        "outputs_equal": 0,
        "steps_official": 0,
        "equal_official": 0,
        "steps_full_block": 0,
        "equal_vllm": 0,
        "official_lengths": [],
        "ours_lengths": [],
    }
    for prompt in prompts:
        official_out, official_lengths = official_generate(
            official_draft, target_model, prompt, max_new_tokens=max_new, stop_ids=sorted(stop_ids), block_size=block
        )
        results = {}
        for name in ("official", "vllm"):
            result = speculative_generate(
                wrapped,
                proposer,
                torch.tensor(prompt),
                k=k,
                max_new_tokens=max_new,
                stop_ids=frozenset(stop_ids),
                convention=CONVENTIONS[name],
                record_tokens=False,
            )
            results[name] = (result.output_ids, [s.num_accepted + 1 for s in result.steps], result.steps)
        out, lengths, _ = results["official"]
        row["requests"] += 1
        row["outputs_equal"] += out == official_out and results["vllm"][0] == official_out
        row["steps_official"] += len(official_lengths)
        row["equal_official"] += (
            sum(a == b for a, b in zip(lengths, official_lengths)) if len(lengths) == len(official_lengths) else 0
        )
        for step, length, official_length in zip(results["vllm"][2], results["vllm"][1], official_lengths):
            if max_new - step.position >= k:
                row["steps_full_block"] += 1
                row["equal_vllm"] += length == official_length
        row["official_lengths"] += official_lengths
        row["ours_lengths"] += lengths
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-requests", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--variants", default=",".join(REAL_VARIANTS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine: threads thrash)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = resolve_model_dir(str(demo_target_path()))
    target_model = load_causal_lm(target_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    stop_ids = stop_ids_of(target_model, tokenizer)
    requests = load_workload("demo", max_requests=args.max_requests, seed=0)
    prompts = [encode_request_turn(tokenizer, r, []) for r in requests]
    print(f"demo workload: {len(prompts)} first turns, {args.max_new_tokens} new tokens, K = {args.k}")
    print(
        "variant   requests  outputs=  steps(all)  equal(official conv.)  "
        "full-block steps  equal(vllm conv.)  tau official  tau ours"
    )
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    for variant in args.variants.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            path = real_variant(DEMO_DRAFT_DIR, variant, Path(tmp))
            cls = DFlash2DraftModel if variant == "dflash2" else DFlashDraftModel
            official_draft = cls.from_pretrained(path, dtype=torch.float32).eval()
            ours = load_dflash_draft(path)
        row = compare(target_model, official_draft, ours, prompts, stop_ids, args.k, args.max_new_tokens)
        tau_official = sum(row["official_lengths"]) / max(1, len(row["official_lengths"]))
        tau_ours = sum(row["ours_lengths"]) / max(1, len(row["ours_lengths"]))
        print(
            f"{variant:9} {row['requests']:8}  {row['outputs_equal']:8}  "
            f"{row['steps_official']:10}  {row['equal_official']:21}  "
            f"{row['steps_full_block']:16}  {row['equal_vllm']:17}  {tau_official:12.3f}  {tau_ours:8.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
