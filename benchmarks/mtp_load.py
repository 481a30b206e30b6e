"""What loading a large MoE target's MTP head costs: the head built on the meta device taking the checkpoint's
tensors (engine/mtp_model.py ``build_mtp_head``) against building it with random weights first and copying the
checkpoint into them (how it was built before 2026-12-04), side by side in one run.

A DeepSeek-V3-shaped MTP layer with fewer, narrower experts (``--experts``, ``--hidden``) is written once as a
target checkpoint in bfloat16 (random tensors; only the MTP layer and the config, which is all the head reads).
Each way then runs in a fresh process, so that its peak resident memory is its own: read the checkpoint, build
the head in ``--dtype``, report wall seconds and the peak RSS above the process's RSS once the checkpoint is read.

Usage: python benchmarks/mtp_load.py [--experts 32] [--hidden 2048] [--dtype bfloat16|float32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config

from dflash_doctor.engine.mtp_model import MtpHead, MtpLayer, _fuse_experts, build_mtp_head, decoder_layer_class
from dflash_doctor.models.mtp_format import read_mtp_checkpoint


def _config(hidden: int, experts: int) -> DeepseekV3Config:
    return DeepseekV3Config(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=hidden // 2 * 3 // 2,
        n_routed_experts=experts,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        num_hidden_layers=1,
        first_k_dense_replace=0,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=hidden // 2,
        kv_lora_rank=hidden // 4,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        vocab_size=32000,
        num_nextn_predict_layers=1,
    )


def write_target(folder: Path, hidden: int, experts: int) -> None:
    """config.json and the MTP layer's tensors under DeepSeek-V3's checkpoint names (experts one by one)."""
    config = _config(hidden, experts)
    with torch.device("meta"):
        block = decoder_layer_class(config)(config, 1)
    prefix = "model.layers.1."
    tensors = {}
    for name, tensor in block.state_dict().items():
        stem, _, kind = name.rpartition(".")
        if tensor.dim() == 3:  # fused experts: one tensor per expert and projection, as checkpoints store them
            parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
            rows = tensor.shape[1] // len(parts)
            for e in range(tensor.shape[0]):
                for part in parts:
                    tensors[f"{prefix}{stem}.{e}.{part}.weight"] = (
                        torch.randn(rows, tensor.shape[2], dtype=torch.bfloat16) * 0.02
                    )
        else:
            tensors[prefix + name] = torch.randn(tensor.shape, dtype=torch.bfloat16) * 0.02
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{name}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, dtype=torch.bfloat16) * 0.02
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(config.to_json_string())


def build_random_first(checkpoint, target_config, *, dtype: torch.dtype) -> MtpHead:
    """The earlier way: modules with random float32 weights, the checkpoint copied into them, then cast."""
    config = copy.deepcopy(target_config.get_text_config())
    layer_class = decoder_layer_class(target_config)
    layers = []
    for i, tensors in enumerate(checkpoint.layers):
        layer = MtpLayer(
            config,
            layer_class(config, checkpoint.first_layer_index + i),
            own_head=checkpoint.has_own("head"),
            own_embedding=checkpoint.has_own("embed_tokens"),
        )
        layer.load_state_dict(_fuse_experts(tensors, set(layer.state_dict())), strict=True)
        layers.append(layer)
    return (
        MtpHead(layers, checkpoint.layout, checkpoint.first_layer_index, checkpoint.zero_first_embedding)
        .to(dtype=dtype)
        .eval()
    )


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(folder: Path, way: str, dtype_name: str) -> dict:
    """One load in this process: seconds and peak RSS above the RSS after reading the checkpoint."""
    config_json = json.loads((folder / "config.json").read_text())
    target_config = DeepseekV3Config.from_pretrained(folder)
    checkpoint = read_mtp_checkpoint(folder, config_json, "bench")
    dtype = getattr(torch, dtype_name)
    before = _rss_mib()
    start = time.perf_counter()
    if way == "meta":
        head = build_mtp_head(checkpoint, target_config, dtype=dtype, device="cpu", target_name="bench")
    else:
        head = build_random_first(checkpoint, target_config, dtype=dtype)
    seconds = time.perf_counter() - start
    parameters = sum(p.numel() for p in head.parameters())
    return {"seconds": seconds, "peak_above_mib": _rss_mib() - before, "parameters": parameters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("FOLDER", "WAY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(Path(args.child[0]), args.child[1], args.dtype)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_target(folder, args.hidden, args.experts)
        size_mib = (folder / "model.safetensors").stat().st_size / 2**20
        results: dict[str, list[dict]] = {"meta": [], "random-first": []}
        for repeat in range(args.repeats):
            order = ["meta", "random-first"] if repeat % 2 == 0 else ["random-first", "meta"]
            for way in order:
                out = subprocess.run(
                    [sys.executable, __file__, "--dtype", args.dtype, "--child", str(folder), way],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                results[way].append(json.loads(out.strip().splitlines()[-1]))
    parameters = results["meta"][0]["parameters"]
    print(
        f"MTP layer: {parameters / 1e9:.2f}B parameters ({args.experts} experts, hidden {args.hidden}), checkpoint "
        f"{size_mib:.0f} MiB bf16, head built in {args.dtype}, {args.repeats} repeats (order alternated), fastest shown"
    )
    best = {
        way: (min(r["seconds"] for r in rows), min(r["peak_above_mib"] for r in rows)) for way, rows in results.items()
    }
    for way, (seconds, peak) in best.items():
        print(f"  {way:<13} {seconds:7.2f} s   peak RSS above the read checkpoint {peak:8.0f} MiB")
    print(
        f"  random-first / meta: time x{best['random-first'][0] / best['meta'][0]:.1f}, "
        f"peak memory x{best['random-first'][1] / max(best['meta'][1], 1.0):.1f}"
    )


if __name__ == "__main__":
    main()
