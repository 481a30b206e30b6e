"""GPU figures for the engine (issues 2 and 4), on a Qwen3-8B-shaped target and a DFlash-b16-shaped draft
with random bf16 weights built from configs (no download).

1. Live loop: time per draft/verify step vs the floor of ONE target forward over B tokens plus ONE draft
   block forward, measured in the same run (ratio printed; aim <= 1.15).
2. Teacher-forced replay: analysed tokens per second over one long sequence, and the achieved share of
   the GPU's bf16 matrix rate (FLOPs counted from the shapes; pass --peak-tflops for your GPU).

Usage: python benchmarks/gpu_engine.py [--tiny] [--peak-tflops 790]
``--tiny`` runs the same code on a small config on CPU (a smoke test of the script itself).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_doctor.engine.dflash_model import DFlashConfig, DFlashDraftModel
from dflash_doctor.engine.live import speculative_generate
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table

QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936)
TINY = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=1000)


def build(shape: dict, device: str, dtype: torch.dtype):
    config = Qwen3Config(**shape, max_position_embeddings=8192, rope_theta=1e6, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        target = Qwen3ForCausalLM(config).to(dtype).eval()
    layers = shape["num_hidden_layers"]
    ids = [1, 9, 17, 25, 33] if layers == 36 else [1, 2, 3]
    draft_cfg = DFlashConfig(
        hidden_size=shape["hidden_size"], num_hidden_layers=5 if layers == 36 else 2,
        num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"], intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"],
        block_size=16, target_layer_ids=ids, mask_token_id=shape["vocab_size"] - 1, num_target_layers=layers,
    )
    with torch.device(device):
        draft = DFlashDraftModel(draft_cfg).to(dtype).eval()
    return target, draft


def cuda_time(fn, repeats: int, device: str) -> float:
    """Median seconds per call (CUDA-synchronised)."""
    times = []
    for _ in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times = sorted(times[2:])
    return times[len(times) // 2]


@torch.inference_mode()
def live_step_vs_floor(target_model, draft, device: str, context: int, new_tokens: int) -> None:
    block = draft.config.block_size
    target = TargetModel(target_model, draft.hidden_state_indices)
    proposer = DFlashProposer(draft, target)
    prompt = torch.randint(0, target_model.config.vocab_size - 2, (context,), device=device)
    for record in (True, False):  # the first run also warms up kernels for every shape
        speculative_generate(target, proposer, prompt, k=block - 1, max_new_tokens=16, record_tokens=record)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = speculative_generate(target, proposer, prompt, k=block - 1, max_new_tokens=new_tokens, record_tokens=record)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        prefill = cuda_time(lambda: (target.reset(), target.forward(prompt)), 3, device)
        step = (wall - prefill) / len(result.steps)
        # The floor at the same context: one verify forward over B tokens, one draft block forward.
        target.reset()
        prefill_out = target.forward(prompt)
        proposer.start(prompt, prefill_out.features)
        base = target.cache_length
        tokens = prompt[:block]

        def verify():
            target.forward(tokens)
            target.crop(base)

        floor = cuda_time(verify, 20, device) + cuda_time(lambda: proposer.propose(1, block - 1, block - 1), 20, device)
        label = "with per-token records" if record else "without per-token records"
        print(f"live loop step ({label}): {step * 1e3:.2f} ms over {len(result.steps)} steps; floor {floor * 1e3:.2f} ms "
              f"(verify over {block} tokens + one draft block); ratio {step / floor:.3f}")


@torch.inference_mode()
def teacher_throughput(target_model, draft, device: str, length: int, peak_tflops: float) -> None:
    target = TargetModel(target_model, draft.hidden_state_indices)
    proposer = DFlashProposer(draft, target)
    vocab = target_model.config.vocab_size
    ids = torch.randint(0, vocab - 2, (length,)).tolist()
    sequence = TeacherSequence(ids[:64], ids[64:])
    k = draft.config.block_size - 1
    slot_table(target, proposer, TeacherSequence(ids[:64], ids[64:256]), k, record_divergence=False)  # warm-up
    seconds = cuda_time(lambda: slot_table(target, proposer, sequence, k, record_divergence=False), 3, device)
    anchors = len(sequence.output_ids) - 1
    t_params = sum(p.numel() for p in target_model.parameters()) - target_model.get_input_embeddings().weight.numel()
    d_params = sum(p.numel() for p in draft.parameters())
    h, v = target_model.config.hidden_size, vocab
    rows = anchors * (k + 1)
    flops = 2 * t_params * length + 2 * d_params * rows + 2 * h * v * anchors * k
    print(f"teacher-forced replay: {anchors} anchors x K={k} in {seconds:.3f} s = {anchors / seconds:,.0f} analysed tokens/s; "
          f"{flops / seconds / 1e12:.1f} TFLOP/s = {100 * flops / seconds / 1e12 / peak_tflops:.1f}% of {peak_tflops:.0f} TFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 dense matrix rate of the GPU")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    target_model, draft = build(TINY if args.tiny else QWEN3_8B, device, dtype)
    live_step_vs_floor(target_model, draft, device, context=128 if args.tiny else 1024, new_tokens=32 if args.tiny else 96)
    teacher_throughput(target_model, draft, device, length=256 if args.tiny else 2112, peak_tflops=args.peak_tflops)


if __name__ == "__main__":
    main()
