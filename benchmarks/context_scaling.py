"""Peak GPU memory and analysed tokens/s of the teacher-forced pass per context length, with and without
divergence records, on a Qwen3-8B-shaped target (``--target qwen3.5-9b``: a Qwen3.5-9B-shaped
hybrid, three gated-delta-net layers to one attention layer, run through the engine's rollback cache) and a
DFlash-b16 draft (random bf16 weights built from configs by benchmarks/gpu_engine.py, no download).

For each prompt length: one teacher-forced pass over ``--output-tokens`` output tokens at K = 15
(:func:`dflash_doctor.engine.teacher.slot_table`, every slot of every anchor, as gpu_engine.py's replay
figure), then the same pass with divergence records of every slot. Printed per length: the peak GPU
memory of each pass (``torch.cuda.max_memory_allocated``, reset before it), the pass's time (CUDA events;
median of ``--repeats``, one run without a warm-up from ``--long`` tokens on, where a pass takes seconds
and its chunks have the shapes the shorter lengths warmed), analysed tokens/s (output tokens per second
of the plain pass) and the records ratio (records pass / plain pass); with ``--runs N`` every length is
measured N times in turn (one figure per run in the table) and the runs' largest disagreement is printed.
Then the memory per 1k prompt tokens between the two longest lengths, and whether the longest fitted.

Before the table, the fused (compiled) divergence columns are compared with the eager ones on one block
of real draft and target scores: the largest difference of the float columns and whether the integer
columns (ranks, top-k ids) are equal; and the draft's top-5 ids of one draft pass as recorded are compared
with their rule (a stable descending sort: equal scores lowest id first) and with torch.topk, whose
three-stage replacement (engine/divergence.py ``top_ids``) is timed beside it.

Measured on one H200 (torch 2.11, transformers 5.24 carried), 2,048 output tokens, K = 15, figures per run
(run 1 / run 2). Qwen3-8B shape, `--contexts 64,4096,16384 --runs 2` (runs agree within 2.4%):

| prompt tokens | peak GiB (pass / records) | pass ms | analysed tok/s | records ratio |
|---|---|---|---|---|
| 64 | 19.5 / 23.2 | 290 / 297 | 7,059 / 6,893 | x1.13 / x1.12 |
| 4,096 | 20.4 / 23.4 | 476 / 478 | 4,304 / 4,282 | x1.06 / x1.07 |
| 16,384 | 23.3 / 24.1 | 1,363 / 1,366 | 1,503 / 1,499 | x1.03 / x1.03 |

Before the three-stage top-5 ids, the target rows without float32 probabilities and the slot tables that
stay packed, the same pass cost x1.37 / x1.33 (64), x1.19 / x1.17 (4k), x1.08 / x1.07 (16k). The long
lengths, measured before that change (the plain pass is unchanged by it), one unwarmed run each:

| prompt tokens | peak GiB (pass / records) | pass ms | analysed tok/s |
|---|---|---|---|
| 32,768 | 26.8 / 27.2 | 5,761 / 4,131 | 356 / 496 |
| 65,536 | 34.2 / 34.8 | 9,732 / 8,998 | 210 / 228 |
| 131,072 | 48.8 / 50.0 | 27,103 / 27,240 | 76 / 75 |

0.229 GiB per 1k prompt tokens (64k -> 128k; the KV cache alone is 0.141), 17.2 GiB of weights: a 128k-token
prompt peaks at 50.0 GiB of the H200's 139.8 (before: output_hidden_states of every layer and float32 logits
of every position, 1.2 GiB per 1k tokens, out of memory past about 100k).

Qwen3.5-9B-shaped hybrid, `--target qwen3.5-9b --contexts 64,4096,16384,131072 --runs 2` (transformers' reference
PyTorch gated-delta-net and causal-conv1d kernels: flash-linear-attention and causal_conv1d were not installed):

| prompt tokens | peak GiB (pass / records) | pass ms | analysed tok/s | records ratio |
|---|---|---|---|---|
| 64 | 22.2 / 28.3 | 426 / 433 | 4,809 / 4,729 | x1.18 / x1.21 |
| 4,096 | 23.5 / 28.5 | 706 / 811 | 2,900 / 2,526 | x1.07 / x0.98 |
| 16,384 | 24.4 / 29.2 | 1,961 / 1,745 | 1,044 / 1,173 | x1.00 / x1.06 |
| 131,072 | 36.6 / 38.8 | 18,542 / 16,159 | 110 / 127 | x0.91 / x0.99 |

0.109 GiB per 1k prompt tokens (16k -> 128k: only one layer in four keeps a KV cache), 18.6 GiB of weights, a
128k-token prompt peaks at 38.8 GiB. Its pass times spread by up to 14.8% between the runs (the reference
kernels launch many small operations), so its ratios are good to about +-0.1; an earlier single run of the
same command gave x1.05, x1.27, x0.80 and x0.94. Fused vs eager columns: largest float difference 1.07e-06,
integer columns equal, on both targets. The draft's top-5 ids as recorded equal a stable descending sort in
every row; torch.topk orders ties its own way (229 of 960 rows at 152k ids, 315 at 248k) and took 1.16 ms
(1.79 ms at 248k) against 0.74 ms (1.00 ms) for the three stages.

Usage: python benchmarks/context_scaling.py [--target qwen3-8b|qwen3.5-9b|gpt-oss-20b]
       [--contexts 64,4096,16384,32768,65536,131072] [--output-tokens 2048] [--repeats 3] [--runs 1] [--tiny]
``--tiny`` runs the same code on a small config on CPU (a smoke test of the script itself; no memory figures).
"""

from __future__ import annotations

import argparse
import statistics
from typing import NamedTuple

import torch
from gpu_engine import BLOCK_SIZE, TARGETS, Clock, build

from dflash_doctor.engine import divergence
from dflash_doctor.engine.divergence import TargetRows, divergence_tensor
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table

GIB = 2**30


def peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / GIB if device == "cuda" else float("nan")


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def fused_against_eager(target: TargetModel, proposer: DFlashProposer, device: str) -> list[str]:
    """The compiled columns against the eager ones on one block of real scores (a GPU runs the compiled ones),
    and the draft's top-5 ids of one draft pass (64 anchors x K slots, the head's dtype) against their rule and
    torch.topk, with both timed side by side."""
    vocab = target.head.weight.shape[0]
    ids = torch.randint(0, vocab - 2, (160,), device=device)
    sequence = TeacherSequence(ids[:32].tolist(), ids[32:].tolist())
    _, (logits, features) = slot_table(target, proposer, sequence, BLOCK_SIZE - 1, record_divergence=False)
    anchors = torch.arange(32, 32 + 64)
    draft_logits = proposer.slot_logits(anchors, BLOCK_SIZE - 1)
    rows = TargetRows.of(logits, pad=BLOCK_SIZE - 1).windows(0, 64, BLOCK_SIZE - 1)
    tokens = draft_logits.argmax(dim=-1)
    chosen = torch.tensor([0, 3, 7, 15, 40, 63], device=device)
    fused = divergence_tensor(draft_logits[chosen], tokens[chosen], rows, chosen)
    eager = divergence._columns(draft_logits[chosen], tokens[chosen], rows.take(chosen))
    floats, integers = slice(0, 7), slice(7, None)
    worst = (fused[..., floats] - eager[..., floats]).abs().max().item()
    scores = draft_logits.flatten(0, 1)
    by_rule = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : divergence.TOP_K]
    by_topk = scores.topk(divergence.TOP_K, dim=-1).indices
    recorded = divergence_tensor(draft_logits, tokens, rows)[..., 7 : 7 + divergence.TOP_K].flatten(0, 1).long()
    clock = Clock(device)
    topk_s = clock.median(lambda: scores.topk(divergence.TOP_K, dim=-1), 5)
    stages_s = clock.median(lambda: divergence.top_ids(scores), 5)
    return [
        f"fused vs eager columns: largest float difference {worst:.2e}, integer columns equal: "
        f"{torch.equal(fused[..., integers], eager[..., integers])}",
        f"draft top-5 ids of {scores.shape[0]} slots ({str(scores.dtype).removeprefix('torch.')}, vocab {vocab:,}), as "
        f"recorded: equal to a stable descending sort's in every row: {torch.equal(recorded, by_rule)}; torch.topk's "
        f"differ in {int((by_topk != by_rule).any(dim=-1).sum())} rows (ties); torch.topk {topk_s * 1e3:.2f} ms, "
        f"three stages (eager) {stages_s * 1e3:.2f} ms",
    ]


class Figures(NamedTuple):
    """One prompt length, measured once: the plain pass and the pass with divergence records."""

    pass_s: float
    pass_peak_gib: float
    records_s: float
    records_peak_gib: float

    @property
    def ratio(self) -> float:
        return self.records_s / self.pass_s


def measure(
    target: TargetModel, proposer: DFlashProposer, context: int, args: argparse.Namespace, device: str, clock: Clock
) -> Figures:
    vocab = target.head.weight.shape[0]
    ids = torch.randint(0, vocab - 2, (context + args.output_tokens,)).tolist()
    sequence = TeacherSequence(ids[:context], ids[context:])
    long = context >= args.long
    figures: list[float] = []
    for record in (False, True):

        def one_pass(record: bool = record) -> None:
            slot_table(target, proposer, sequence, BLOCK_SIZE - 1, record_divergence=record)

        if not long:
            one_pass()  # warm-up: every shape of this length
        reset_peak(device)
        seconds = [clock.time(one_pass)[0] for _ in range(1 if long else args.repeats)]
        figures += [statistics.median(seconds), peak_gib(device)]
    return Figures(*figures)


def per_run(values: list[float], form: str) -> str:
    """One figure per run, ``a / b``."""
    return " / ".join(form.format(v) for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--target", choices=sorted(TARGETS), default="qwen3-8b", help="the target's shape (gpu_engine.py)"
    )
    parser.add_argument(
        "--contexts", default="64,4096,16384,32768,65536,131072", help="prompt lengths, comma-separated"
    )
    parser.add_argument("--output-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=int, default=1, help="measure every length this many times (one column each)")
    parser.add_argument(
        "--long", type=int, default=32768, help="prompt length from which each pass runs once, unwarmed"
    )
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    clock = Clock(device)
    torch.manual_seed(0)
    target_model, draft = build(args.target, args.tiny, device, dtype)
    target = TargetModel(target_model, draft.hidden_state_indices)
    proposer = DFlashProposer(draft, target)
    # the records of a long run, which compiles the columns once they pay (engine/divergence.py); a run below
    # COMPILE_AFTER_SCORES computes them eagerly (benchmarks/gpu_engine.py times both)
    divergence._fused_columns().compile_after = 0
    weights = torch.cuda.memory_allocated() / GIB if device == "cuda" else float("nan")
    name = args.target + (" (tiny)" if args.tiny else "")
    print(
        f"target {name}; torch {torch.__version__}; weights (target + draft) {weights:.1f} GiB; K = {BLOCK_SIZE - 1}; "
        f"{args.output_tokens} output tokens; {args.runs} run(s)"
    )
    for line in fused_against_eager(target, proposer, device):
        print(line)
    contexts = [int(c) for c in args.contexts.split(",")]
    runs: dict[int, list[Figures]] = {context: [] for context in contexts}
    for run in range(args.runs):
        for context in contexts:
            figures = measure(target, proposer, context, args, device, clock)
            runs[context].append(figures)
            print(
                f"  run {run + 1}, {context}: "
                f"pass {figures.pass_s * 1e3:.0f} ms, peak {figures.pass_peak_gib:.1f} GiB; "
                f"records {figures.records_s * 1e3:.0f} ms, peak {figures.records_peak_gib:.1f} GiB",
                flush=True,
            )
    print(
        f"\n{name}, {args.output_tokens} output tokens, K = {BLOCK_SIZE - 1}"
        + (" (run 1 / run 2 / ...)" if args.runs > 1 else "")
    )
    print("| prompt tokens | peak GiB (pass / records) | pass ms | analysed tok/s | records ratio |")
    print("|---|---|---|---|---|")
    for context in contexts:
        figures = runs[context]
        peaks = f"{max(f.pass_peak_gib for f in figures):.1f} / {max(f.records_peak_gib for f in figures):.1f}"
        print(
            f"| {context:,} | {peaks} | {per_run([f.pass_s * 1e3 for f in figures], '{:,.0f}')} | "
            f"{per_run([args.output_tokens / f.pass_s for f in figures], '{:,.0f}')} | "
            f"{per_run([f.ratio for f in figures], 'x{:.2f}')} |"
        )
    if args.runs > 1:

        def spread(values: list[float]) -> float:
            return max(values) / min(values) - 1

        worst = max(max(spread([f.pass_s for f in runs[c]]), spread([f.ratio for f in runs[c]])) for c in contexts)
        print(f"runs agree within {100 * worst:.1f}% (largest spread of a pass time or a records ratio over the runs)")
    if len(contexts) >= 2:
        (c0, c1) = contexts[-2:]
        p0, p1 = runs[c0][0].pass_peak_gib, runs[c1][0].pass_peak_gib
        print(f"memory per 1k prompt tokens ({c0:,} -> {c1:,}): {(p1 - p0) / (c1 - c0) * 1024:.3f} GiB")
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        longest = runs[contexts[-1]][0]
        print(
            f"longest prompt ({contexts[-1]:,} tokens): peak "
            f"{max(longest.pass_peak_gib, longest.records_peak_gib):.1f} GiB "
            f"of the GPU's {total:.1f} GiB"
        )


if __name__ == "__main__":
    main()
