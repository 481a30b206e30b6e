"""Scaling the teacher-forced analysis over GPUs, with random bf16 weights built from configs.

1. ``data-parallel`` (run it under torchrun): every rank builds a Qwen3-8B-shaped target and a
   DFlash-b16-shaped draft on its GPU, replays its share of the requests (by expected work) through
   :func:`dflash_doctor.replay.sharding.replay_into` (the code ``sweep``/``check`` run) and rank 0 merges.
   Rank 0 prints analysed tokens/s (output tokens teacher-forced at every K, per wall second from the
   common start to the merged run directory) and writes them to ``--json``. Run it with 1 and with 2
   processes, then ``ratio`` prints the scaling.
2. ``placed``: one process, a Qwen2.5-72B-shaped target (about 145 GB in bf16, more than one GPU) placed
   over ``--devices`` by :func:`dflash_doctor.models.placement.placement_of`, with its draft on the first GPU,
   through the same replay end to end.

Weights are created on the meta device and materialised straight on their GPU (no CPU copy).

Usage:
  torchrun --nproc-per-node 1 benchmarks/distributed_scaling.py data-parallel --json dp1.json
  torchrun --nproc-per-node 2 benchmarks/distributed_scaling.py data-parallel --json dp2.json
  python benchmarks/distributed_scaling.py ratio dp1.json dp2.json
  python benchmarks/distributed_scaling.py placed --devices cuda:0,cuda:1
``--tiny`` runs the same code with small shapes on CPU (a smoke test of the script itself).
Give both runs the same ``OMP_NUM_THREADS`` (torchrun sets 1 per rank when it starts several, none for
one, which alone skews the ratio).

Measured on 2 x H200 (torch 2.11, transformers 5.17), OMP_NUM_THREADS=8, 64 requests x 128 new tokens, K = 1..15:
1 GPU 276 analysed tokens/s, 2 GPUs 489 (ranks 14.1 s and 16.2 s, merge 0.5 s): 1.77x. The 72B-shaped
target (145.4 GB bf16) placed over 2 GPUs: 6 requests x 128 tokens end to end, 28.5 analysed tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash_doctor.models.placement import dispatch, placement_of
from dflash_doctor.replay import sharding
from dflash_doctor.models.draft_kinds import Sampling, get_draft_kind
from dflash_doctor.engine.dflash_model import DFlashConfig, DFlashDraftModel, rope_inverse_frequencies
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.stats.metrics import summarize
from dflash_doctor.models.pair import Pair, stop_ids_of
from dflash_doctor.rundir.run_record import ModelInfo
from dflash_doctor.replay.stream import replay_teacher
from dflash_doctor.rundir.run_record import RunMeta, RunRecord
from dflash_doctor.rundir.writer import RunWriter, utc_now
from dflash_doctor.inputs.workloads import Request

QWEN3_8B = (
    Qwen3Config,
    Qwen3ForCausalLM,
    dict(
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
    ),
)
QWEN25_72B = (
    Qwen2Config,
    Qwen2ForCausalLM,
    dict(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, intermediate_size=29568
    ),
)
TINY = (
    Qwen3Config,
    Qwen3ForCausalLM,
    dict(
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    ),
)
CLASSES = ("math", "code", "chat")
WORDS = (
    "the",
    "number",
    "of",
    "apples",
    "def",
    "return",
    "list",
    "hello",
    "friend",
    "seven",
    "times",
    "print",
    "why",
    "is",
)


def random_init(model: torch.nn.Module) -> None:
    """Random weights in place: N(0, 0.02) matrices, unit norms (what an untrained checkpoint looks like)."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.02)
            else:
                parameter.fill_(1.0)


def build_target(family, vocab: int, devices: list[str], dtype: torch.dtype) -> torch.nn.Module:
    """The target on meta, each module materialised on its device (placed over several), then random."""
    config_type, model_type, shape = family
    config = config_type(
        **shape, vocab_size=vocab, max_position_embeddings=8192, rope_theta=1e6, tie_word_embeddings=False
    )
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = model_type(config).to(dtype)
    placement = placement_of(model, devices) if len(devices) > 1 else {"": devices[0]}
    for name, device in placement.items():
        model.get_submodule(name).to_empty(device=device)
    random_init(model)
    rotary = model.model.rotary_emb  # its inverse frequencies are buffers computed at construction: rebuild them
    model.model.rotary_emb = type(rotary)(config=config).to(devices[0])
    if len(devices) > 1:
        dispatch(model, placement, devices[0])
    return model.eval()


def build_draft(shape: dict, vocab: int, mask_id: int, device: str, dtype: torch.dtype) -> DFlashDraftModel:
    layers = shape["num_hidden_layers"]
    ids = [1 + i * (layers - 2) // 4 for i in range(5)] if layers >= 12 else [1, 2, 3]
    head_dim = shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    cfg = DFlashConfig(
        hidden_size=shape["hidden_size"],
        num_hidden_layers=5 if layers >= 12 else 2,
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=head_dim,
        intermediate_size=shape["intermediate_size"],
        vocab_size=vocab,
        block_size=16,
        target_layer_ids=ids,
        mask_token_id=mask_id,
        num_target_layers=layers,
    )
    with torch.device("meta"):
        draft = DFlashDraftModel(cfg).to(dtype)
    draft.to_empty(device=device)
    random_init(draft)
    draft.inv_freq = rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(
        device
    )  # a buffer computed at construction
    return draft.eval()


def build_pair(family, tokenizer, devices: list[str], dtype: torch.dtype) -> Pair:
    vocab = len(tokenizer)
    target_model = build_target(family, vocab, devices, dtype)
    draft_model = build_draft(family[2], vocab, tokenizer.pad_token_id or 0, devices[0], dtype)
    kind = get_draft_kind("dflash")
    target = TargetModel(target_model)
    dtype_name, device = str(dtype).removeprefix("torch."), ",".join(devices)
    return Pair(
        target=target,
        draft_model=draft_model,
        kind=kind,
        proposer=kind.build(draft_model, target, Sampling()),
        tokenizer=tokenizer,
        stop_ids=stop_ids_of(target_model, tokenizer),
        target_dir=Path("random"),
        draft_dir=Path("random"),
        draft_config={},
        target_info=ModelInfo(
            id="random-target", revision_or_hash="random", dtype=dtype_name, device=device, kind="target"
        ),
        draft_info=ModelInfo(
            id="random-draft",
            revision_or_hash="random",
            dtype=dtype_name,
            device=device,
            kind="dflash",
            facts=kind.facts(draft_model),
        ),
    )


def workload(num_requests: int, prompt_words: int) -> list[Request]:
    """Raw prompts of about ``prompt_words`` tokens in three classes (distinct, so no two are alike)."""
    return [
        Request(
            id=f"{CLASSES[i % 3]}-{i}",
            request_class=CLASSES[i % 3],
            prompt=" ".join(WORDS[(i * 7 + j * (i % 5 + 1)) % len(WORDS)] for j in range(prompt_words)),
        )
        for i in range(num_requests)
    ]


def analyse(pair: Pair, requests: list[Request], run_dir: Path, max_new_tokens: int):
    """Every K of the block teacher-forced over the target's own continuations, as ``sweep`` does."""
    ks = tuple(range(1, 16))

    def replay(writer, mine):
        start = time.perf_counter()
        result = replay_teacher(
            pair, mine, ks=ks, max_new_tokens=max_new_tokens, temperature=0.0, seed=0, exact_blocks=False, writer=writer
        )
        print(
            f"rank {sharding.current_ranks().rank}: {len(mine)} "
            f"requests replayed in {time.perf_counter() - start:.2f} s "
            "(before the merge)",
            flush=True,
        )
        return result

    writer, merged = sharding.replay_into(
        run_dir,
        RunRecord(meta=RunMeta(command="sweep", created_at=utc_now())).to_json(),
        requests,
        replay,
        sharding.work_of(pair.tokenizer, max_new_tokens, ks[-1]),
    )
    writer.close()
    return merged


def synchronise(devices: list[str]) -> None:
    for device in devices:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)


def data_parallel(args, tokenizer, dtype) -> None:
    import torch.distributed as dist

    ranks = sharding.current_ranks()
    device = "cpu" if args.tiny else f"cuda:{ranks.local_rank}"
    pair = build_pair(TINY if args.tiny else QWEN3_8B, tokenizer, [device], dtype)
    warm = workload(3, 16)
    with (
        tempfile.TemporaryDirectory() as scratch,
        RunWriter(Path(scratch) / "warm", {}) as writer,
    ):  # warm kernels, this rank alone
        replay_teacher(
            pair,
            warm,
            ks=tuple(range(1, 16)),
            max_new_tokens=16,
            temperature=0.0,
            seed=0,
            exact_blocks=False,
            writer=writer,
        )
    synchronise([device])
    if ranks.sharded:
        dist.init_process_group(backend="gloo")  # replay_into gathers over it, then closes it
        dist.barrier()
    requests = workload(args.requests, args.prompt_words)
    start = time.perf_counter()
    merged = analyse(pair, requests, Path(args.run_dir), args.max_new_tokens)  # other ranks leave here (SystemExit)
    seconds = time.perf_counter() - start
    tokens = sum(row["num_output_tokens"] for row in merged.request_rows)
    tau = summarize(merged.steps_frame(), merged.requests_frame(), seed=0).overall.mean_acceptance_length
    result = {
        "gpus": ranks.world_size,
        "requests": len(merged.request_rows),
        "analysed_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tau_k15": tau,
    }
    print(
        f"data-parallel over {ranks.world_size} rank(s): "
        f"{len(merged.request_rows)} requests, {tokens} tokens analysed at "
        f"K=1..15 in {seconds:.2f} s = {tokens / seconds:,.0f} analysed tokens/s (tau at K=15 {tau:.3f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result))


def placed(args, tokenizer, dtype) -> None:
    devices = args.devices.split(",")
    started = time.perf_counter()
    pair = build_pair(TINY if args.tiny else QWEN25_72B, tokenizer, devices, dtype)
    synchronise(devices)
    built = time.perf_counter() - started
    params = sum(p.numel() * p.element_size() for p in pair.target.model.parameters()) / 1e9
    per_device = {d: round(torch.cuda.memory_allocated(d) / 2**30, 1) for d in devices if d.startswith("cuda")}
    print(
        f"placed target: {params:.1f} GB of bf16 weights over {', '.join(devices)} "
        f"(built in {built:.1f} s); GiB allocated per GPU {per_device}"
    )
    requests = workload(args.requests, args.prompt_words)
    start = time.perf_counter()
    merged = analyse(pair, requests, Path(args.run_dir), args.max_new_tokens)
    synchronise(devices)
    seconds = time.perf_counter() - start
    tokens = sum(row["num_output_tokens"] for row in merged.request_rows)
    summary = summarize(merged.steps_frame(), merged.requests_frame(), seed=0)
    peak = {d: round(torch.cuda.max_memory_allocated(d) / 2**30, 1) for d in devices if d.startswith("cuda")}
    print(
        f"placed target end to end: {len(merged.request_rows)} requests, "
        f"{tokens} tokens analysed at K=1..15 in {seconds:.2f} s "
        f"= {tokens / seconds:,.1f} analysed tokens/s; tau at K=15 {summary.overall.mean_acceptance_length:.3f}; "
        f"classes {sorted(summary.by_class)}; peak GiB per GPU {peak}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"devices": devices, "weights_gb": params, "tokens": tokens, "seconds": seconds, "peak_gib": peak}
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="Scaling the teacher-forced analysis over GPUs.")
    parser.add_argument("mode", choices=("data-parallel", "placed", "ratio"))
    parser.add_argument("files", nargs="*", help="ratio: the 1-GPU and the 2-GPU --json files")
    parser.add_argument("--tokenizer", default=str(Path.home() / ".cache/dflash-doctor/test-tokenizers/qwen3"))
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-words", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--devices", default="cuda:0,cuda:1")
    parser.add_argument("--run-dir", default=os.path.join(tempfile.gettempdir(), "distributed-scaling-run"))
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.mode == "ratio":
        one, two = (json.loads(Path(f).read_text()) for f in args.files)
        print(
            f"analysed tokens/s: 1 GPU {one['tokens_per_s']:,.0f}, {two['gpus']} GPUs {two['tokens_per_s']:,.0f}; "
            f"scaling {two['tokens_per_s'] / one['tokens_per_s']:.2f}x"
        )
        return
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    (data_parallel if args.mode == "data-parallel" else placed)(args, tokenizer, dtype)


if __name__ == "__main__":
    main()
