"""What rolling back a hybrid target costs per speculative step, side by side with a full-attention target
of the same size. Random weights built from configs, no download.

Two targets of one shape: a Qwen3.5-shaped hybrid (three gated-delta-net layers to one attention layer)
and a Qwen3-shaped full-attention model with the same hidden size, depth and MLP. One step is a verify
forward over K + 1 tokens at a fixed context followed by the rollback to the kept length (1 + n accepted):

- full attention: crop the key/value rows;
- hybrid, the engine's design (engine/cache.py, ``rerun="mixers"``): snapshot the recurrent states before
  the forward, restore them, crop the attention rows and call each recurrent mixer again on the hidden
  states it received, cut to the 1 + n kept positions (nothing when all K are accepted);
- hybrid, ``rerun="model"``: the same snapshot, then the whole model over the 1 + n kept tokens;
- hybrid, per-position states without a custom kernel: verify token by token, K + 1 forwards of one
  token each, so that the state after every position exists and is simply kept.

Printed: milliseconds per step (the fastest of --repeats: other work on a shared machine only adds time) for
n = 0, K / 2 and K accepted, the hybrid / full ratio of each, and the rollback's own share. ``--device cuda`` runs it on
a GPU in bf16.

Usage: python benchmarks/hybrid_rollback.py [--device cpu] [--hidden 512] [--layers 8] [--context 512] [--k 15]
"""

from __future__ import annotations

import argparse

import torch
from gpu_engine import Clock
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

from dflash_doctor.engine.cache import RollbackCache, snapshot_states
from dflash_doctor.engine.target import TargetModel


def shapes(hidden: int, layers: int, vocab: int) -> tuple:
    heads = max(hidden // 128, 2)
    common = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=128 if hidden >= 256 else hidden // heads,
        vocab_size=vocab,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
    )
    linear_heads = max(hidden // 256, 1)
    hybrid = Qwen3_5TextConfig(
        **common,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (layers // 4),
        linear_num_key_heads=linear_heads,
        linear_num_value_heads=2 * linear_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )
    return {"full attention": Qwen3Config(**common), "hybrid": hybrid}


@torch.inference_mode()
def measure(
    model, context: torch.Tensor, k: int, accepted: int, repeats: int, clock: Clock, rerun: str
) -> tuple[float, float]:
    """(seconds per step, seconds of its rollback), the fastest of ``repeats``: verify K + 1 tokens, keep
    1 + ``accepted``; ``rerun``: the rollback cache's mode, or "token by token"."""
    target = TargetModel(model)
    token_by_token = rerun == "token by token"
    if not token_by_token:
        target.cache = RollbackCache(model, rerun)
    target.forward(context, taps=())
    base = target.cache_length
    block = torch.randint(10, model.config.vocab_size - 10, (k + 1,), device=context.device)
    steps, rollbacks = [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        if token_by_token:
            kept = {}

            def verify():
                for i in range(k + 1):
                    target.forward(block[i : i + 1], taps=())
                    if i == accepted:  # the state after the last kept position is the one the next step starts from
                        kept["cache"] = target.cache

            forward_s = clock.time(verify)[0]
            rollback_s = 0.0  # keeping a state is a pointer swap in an engine that stores one per position
        else:
            forward_s = clock.time(lambda: target.forward(block, taps=()))[0]
            rollback_s = clock.time(lambda: target.crop(base + 1 + accepted))[0]
        steps.append(forward_s + rollback_s)
        rollbacks.append(rollback_s)
        _rebuild(target, context)
    fastest = min(range(1, len(steps)), key=lambda i: steps[i])
    return steps[fastest], rollbacks[fastest]


def _rebuild(target: TargetModel, context: torch.Tensor) -> None:
    """Back to the bare context for the next repeat (untimed): a rollback keeps no snapshot of the states
    before the step, as the live loop never goes back past a kept token."""
    target.reset()
    target.forward(context, taps=())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--hybrid-rollbacks",
        default="mixers,model,token by token",
        help="which of the hybrid's rollbacks to measure, comma-separated",
    )
    args = parser.parse_args()
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    clock = Clock(args.device, cpu_time=True)  # one torch thread on a CPU
    if args.device == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    models = {}
    for name, config in shapes(args.hidden, args.layers, args.vocab).items():
        config._attn_implementation = "sdpa"
        with torch.device(args.device):
            models[name] = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    sizes = ", ".join(f"{name} {sum(p.numel() for p in m.parameters()) / 1e6:.1f}M" for name, m in models.items())
    print(
        f"torch {torch.__version__} on {args.device} ({dtype}); "
        f"parameters: {sizes}; context {args.context}, K = {args.k}, "
        f"fastest of {args.repeats}"
    )
    context = torch.randint(10, args.vocab - 10, (args.context,), device=args.device)
    decode = {name: measure(m, context, 0, 0, args.repeats, clock, "mixers")[0] for name, m in models.items()}
    snapshot = TargetModel(models["hybrid"])
    snapshot.forward(context, taps=())
    snapshot_s = min(clock.time(lambda: snapshot_states(snapshot.cache.cache))[0] for _ in range(args.repeats))
    print(
        f"one-token decode step (verify 1, keep 1): full attention {decode['full attention'] * 1e3:.2f} ms, hybrid "
        f"{decode['hybrid'] * 1e3:.2f} ms, ratio {decode['hybrid'] / decode['full attention']:.2f}; the hybrid's "
        f"snapshot of its recurrent states, within each of its forwards: {snapshot_s * 1e3:.2f} ms"
    )
    print("per step: ms, ratio to full attention, (rollback ms, its share of the step)")
    rollbacks = args.hybrid_rollbacks.split(",")
    print(f"{'accepted n':>10} {'full attn':>10}" + "".join(f" {'hybrid, ' + r:>36}" for r in rollbacks))
    for accepted in (0, args.k // 2, args.k):
        full, _ = measure(models["full attention"], context, args.k, accepted, args.repeats, clock, "mixers")
        cells = []
        for rerun in rollbacks:
            step, rollback = measure(models["hybrid"], context, args.k, accepted, args.repeats, clock, rerun)
            cell = f"{step * 1e3:.2f} x{step / full:.2f}"
            cells.append(cell if rerun == "token by token" else f"{cell} ({rollback * 1e3:.2f}, {rollback / step:.0%})")
        print(f"{accepted:>10} {full * 1e3:>10.2f}" + "".join(f" {cell:>36}" for cell in cells))


if __name__ == "__main__":
    main()
