"""A K sweep two ways on CPU: teacher-forced replay (one pass answers every K) vs the live loop run once per K.

SmolLM2-135M-Instruct with a weaker autoregressive draft (the target with 4-bit fake-quantised decoder
weights), K = 1..15, over the same few prompts of the built-in ``demo`` workload at temperature 0.

* live: ``speculative_generate`` once per K and prompt, with per-token records (as ``replay`` runs it);
* teacher: the target's greedy continuations (one batched ``generate`` over all prompts), ONE teacher-forced
  ``slot_table`` at K = 15 with divergence records, then ``walk_schedule`` per K (as ``sweep`` runs it).

Prints both wall times, their ratio (the teacher-forced sweep aims to be >= 20x faster) and tau per K side by side; the
teacher's steps must equal the live loop's exactly, and the script says whether they did.

    python benchmarks/sweep_vs_live.py [--requests 3] [--max-new-tokens 32] [--k-max 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.step_records import StepRecord
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, token_rows, walk_schedule
from dflash_doctor.engine.batched import generate_greedy_batch
from engine_overhead import demo_prompts, load_smollm2_pair

STEP_KEYS = ("position", "num_drafted", "num_accepted", "bonus_token")


def pooled_tau(steps_per_prompt: list[list[StepRecord]]) -> float:
    """tau = 1 + accepted / drafts over all prompts (bonus included, vLLM's definition)."""
    drafts = [s for steps in steps_per_prompt for s in steps if s.num_drafted > 0]
    return 1.0 + sum(s.num_accepted for s in drafts) / len(drafts) if drafts else float("nan")


def step_keys(steps: list[StepRecord]) -> list[tuple]:
    return [tuple(getattr(s, key) for key in STEP_KEYS) for s in steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3, help="demo-workload requests (stratified over classes)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--k-max", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    pair = load_smollm2_pair()
    model, draft, stop_ids = pair.target_model, pair.quantized_draft, pair.stop_ids
    prompts = demo_prompts(pair.tokenizer, args.requests)
    ks = list(range(1, args.k_max + 1))
    max_new = args.max_new_tokens
    print(
        f"CPU, torch {torch.__version__}, {torch.get_num_threads()} threads; SmolLM2-135M-Instruct fp32 target, "
        f"4-bit fake-quantised draft; {len(prompts)} prompts x {max_new} new tokens; K = 1..{args.k_max}"
    )
    plain_generate(TargetModel(model), prompts[0], max_new_tokens=4)  # warm-up

    started = time.perf_counter()
    teacher_steps: dict[int, list[list[dict]]] = {k: [] for k in ks}
    # As `sweep` does: the greedy continuations of all prompts in one batched generate.
    outputs = generate_greedy_batch(model, [p.tolist() for p in prompts], max_new_tokens=max_new, stop_ids=stop_ids)
    for prompt, output in zip(prompts, outputs):
        table, _ = slot_table(
            TargetModel(model), AutoregressiveProposer(draft), TeacherSequence(prompt.tolist(), output), max(ks)
        )
        for k in ks:
            steps = walk_schedule(table.matches[:, :k], output, k, max_new, stop_ids)
            teacher_steps[k].append(steps)
        token_rows(table, teacher_steps[max(ks)][-1], output)  # the tokens table a sweep writes
    teacher_s = time.perf_counter() - started

    live_steps: dict[int, list[list[dict]]] = {k: [] for k in ks}
    live_s_by_k: dict[int, float] = {}
    for k in ks:
        started = time.perf_counter()
        for prompt in prompts:
            result = speculative_generate(
                TargetModel(model),
                AutoregressiveProposer(draft),
                prompt,
                k=k,
                max_new_tokens=max_new,
                stop_ids=stop_ids,
            )
            live_steps[k].append(result.steps)
        live_s_by_k[k] = time.perf_counter() - started
    live_s = sum(live_s_by_k.values())

    print(f"\n{'K':>3} {'tau live':>9} {'tau teacher':>12} {'steps equal':>12} {'live s':>8}")
    all_equal = True
    for k in ks:
        equal = all(step_keys(a) == step_keys(b) for a, b in zip(live_steps[k], teacher_steps[k]))
        all_equal &= equal
        print(
            f"{k:>3} {pooled_tau(live_steps[k]):9.4f} "
            f"{pooled_tau(teacher_steps[k]):12.4f} {'yes' if equal else 'NO':>12} "
            f"{live_s_by_k[k]:8.2f}"
        )
    print(f"\nlive loop, once per K: {live_s:8.2f} s")
    print(f"teacher-forced replay: {teacher_s:8.2f} s  (greedy continuation + one pass at K={max(ks)} + walks)")
    print(
        f"ratio: {live_s / teacher_s:.1f}x less wall time; per-step "
        f"results identical for every K: {'yes' if all_equal else 'NO'}"
    )


if __name__ == "__main__":
    main()
