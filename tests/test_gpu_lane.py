"""The GPU lane: the commands end to end on CUDA, typed as a user types them (`python -m dflash_doctor ...` in a
subprocess, the shell's way), on the shapes users serve.

- dense: a Qwen3-shaped target (hidden 512, 8 layers, the Qwen3 vocabulary of 151,936 ids) with the real Qwen3
  tokenizer and chat template, and a 2-layer DFlash draft tapping three of its layers;
- hybrid: a Qwen3.5-shaped target (three gated-delta-net layers to one attention layer), same tokenizer, with and
  without flash-linear-attention (transformers runs the gated delta rule through its Triton kernels when it
  is importable, through its own torch code when not).

Random weights built from configs (no download); the prompts are the built-in `demo` workload. Run by
`scripts/gpu-tests.sh` on a CUDA machine (`pytest -m gpu`); the default test command deselects the `gpu` mark
(pyproject.toml's addopts), and a `-m gpu` run on a machine without CUDA fails at once instead of passing empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from checks_fixtures import npm_tokenizer_dir

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def cuda_machine() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the GPU lane (-m gpu) needs a CUDA device; torch sees none", pytrace=False)


BLOCK = 8
K = str(BLOCK - 1)
WORKLOAD = ("--workload", "demo", "--max-requests", "6", "--max-new-tokens", "48")
SHAPE = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1024,
    vocab_size=151_936,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    # peaked logits: float32 argmax ties between two devices' roundings stay out of reach
    initializer_range=0.08,
)
HYBRID = dict(
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
)
# a gap between two logits, relative to the largest, within which two kernels' summation orders may pick
# differently (flash-linear-attention's chunked kernel, which verifies K + 1 tokens, and its recurrent one, which
# decodes one, sum in different orders)
NEAR_TIE = 2e-3
# run with transformers' torch fallback of the gated delta rule, as on a machine without flash-linear-attention
WITHOUT_FLA = "import sys; sys.modules['fla'] = None; sys.modules['causal_conv1d'] = None; "


def _save_pair(folder: Path, target_config) -> tuple[Path, Path]:
    """The target (float32, seeded) and a DFlash draft for it, saved as a user's local folders. The random
    DFlash draft is rejected nearly always, so `check` rightly fails its speculative-k checks with it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_doctor.engine.dflash_model import DFlashConfig, DFlashDraftModel
    from dflash_doctor.models.loading import save_dflash_draft

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(target_config).float().eval()
    target.save_pretrained(folder / "target")
    AutoTokenizer.from_pretrained(npm_tokenizer_dir("qwen3")).save_pretrained(folder / "target")
    text = target_config.get_text_config()
    draft = (
        DFlashDraftModel(
            DFlashConfig(
                hidden_size=text.hidden_size,
                num_hidden_layers=2,
                num_attention_heads=text.num_attention_heads,
                num_key_value_heads=text.num_key_value_heads,
                head_dim=text.head_dim,
                intermediate_size=text.intermediate_size,
                vocab_size=text.vocab_size,
                block_size=BLOCK,
                target_layer_ids=[1, 4, 7],
                mask_token_id=151_669,
                num_target_layers=text.num_hidden_layers,
            )
        )
        .float()
        .eval()
    )
    save_dflash_draft(draft, folder / "draft")
    return folder / "target", folder / "draft"


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[Path, Path]:
    from transformers import Qwen3Config

    return _save_pair(tmp_path_factory.mktemp("dense"), Qwen3Config(**SHAPE))


@pytest.fixture(scope="module")
def close_draft(dense) -> Path:
    """An autoregressive draft that agrees with the dense target on nearly every token (its weights plus 1%
    noise): the pair a `check` passes, so its exit code is 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, _ = dense
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + 0.01 * torch.randn_like(parameter))
    folder = target.parent / "close-draft"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(target).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> tuple[Path, Path]:
    from transformers import Qwen3_5TextConfig

    return _save_pair(tmp_path_factory.mktemp("hybrid"), Qwen3_5TextConfig(**SHAPE, **HYBRID))


def doctor(*args, prelude: str = "") -> subprocess.CompletedProcess:
    """`dflash-doctor ARGS` in its own process; ``prelude`` is Python run before the CLI starts."""
    code = f"{prelude}import sys; from dflash_doctor.cli import main; sys.argv[0] = 'dflash-doctor'; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=900,
    )


def ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "Traceback" not in result.stderr, result.stderr[-6000:]


def outputs(run: Path) -> dict[str, list[int]]:
    requests = pd.read_parquet(run / "requests.parquet")
    return {rid: list(ids) for rid, ids in zip(requests["request_id"], requests["output_token_ids"])}


def steps(run: Path) -> list[tuple]:
    table = pd.read_parquet(run / "steps.parquet").sort_values(["request_id", "position"])
    return list(table[["request_id", "position", "num_drafted", "num_accepted"]].itertuples(index=False, name=None))


def check_status(run: Path, check_id: str) -> str:
    checks = json.loads((run / "run.json").read_text())["checks"]
    return next(c for c in checks if c["id"] == check_id)["status"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_check_on_cuda_exits_0_and_is_lossless(dense, close_draft, tmp_path, dtype):
    """`check` on a pair that deserves a pass, in both dtypes: exit 0, and in bfloat16 the lossless check does
    not fail a lossless engine (the verify pass and the target's own decoding round differently there)."""
    target, _ = dense
    result = doctor(
        "check",
        "--target",
        target,
        "--draft",
        close_draft,
        *WORKLOAD,
        "--k",
        "4",
        "--device",
        "cuda",
        "--dtype",
        dtype,
        "--out",
        tmp_path / "check",
    )
    ok(result)
    assert lossless_holds(tmp_path / "check", dtype)
    assert json.loads((tmp_path / "check" / "run.json").read_text())["summary"]["overall"]["mean_acceptance_length"] > 2


def lossless_check(run: Path) -> dict:
    """The lossless check's entry of run.json (status, message, details): what a failed assertion shows."""
    return next(c for c in json.loads((run / "run.json").read_text())["checks"] if c["id"] == "lossless")


def lossless_holds(run: Path, dtype: str) -> bool:
    """The lossless check on an engine that is lossless: a pass in float32; in bfloat16 not a failure (the batched
    verify pass and one-token decoding round differently there, and where that parts the texts the check warns,
    measured on the H200: `warn`)."""
    return check_status(run, "lossless") in ({"pass"} if dtype == "float32" else {"pass", "warn"})


def reaches_a_verdict(result: subprocess.CompletedProcess, run: Path, dtype: str) -> None:
    """`check` with a random DFlash draft: a verdict, never a crash. The draft is rejected nearly always, so its
    K checks fail and the exit code is 1 (the code of a failed check); the replay itself stays lossless."""
    statuses = {c["status"] for c in json.loads((run / "run.json").read_text())["checks"]}
    assert result.returncode == (1 if "fail" in statuses else 0), result.stderr[-6000:]
    assert "Traceback" not in result.stderr and "could not compile" not in result.stderr, result.stderr[-6000:]
    assert lossless_holds(run, dtype), lossless_check(run)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_check_of_a_dflash_draft_on_cuda_reaches_a_verdict_with_token_records(dense, tmp_path, dtype):
    """The command of the report that started this lane (a Triton error in the compiled divergence columns ended
    it) reaches its verdict, with the per-token records written (a run this small computes them eagerly; the
    compiled columns have their own test below)."""
    target, draft = dense
    run = tmp_path / "check"
    result = doctor(
        "check",
        "--target",
        target,
        "--draft",
        draft,
        *WORKLOAD,
        "--k",
        K,
        "--device",
        "cuda",
        "--dtype",
        dtype,
        "--out",
        run,
    )
    reaches_a_verdict(result, run, dtype)
    tokens = pd.read_parquet(run / "tokens.parquet")
    assert len(tokens) > 0 and tokens["target_topk_ids"].map(len).eq(5).all()


def test_float32_replay_on_cuda_equals_the_cpus_token_for_token(dense, tmp_path):
    target, draft = dense
    runs = {}
    for device in ("cuda", "cpu"):
        runs[device] = tmp_path / device
        ok(
            doctor(
                "replay",
                "--target",
                target,
                "--draft",
                draft,
                *WORKLOAD,
                "--k",
                K,
                "--device",
                device,
                "--dtype",
                "float32",
                "--out",
                runs[device],
            )
        )
    assert outputs(runs["cuda"]) == outputs(runs["cpu"])
    assert steps(runs["cuda"]) == steps(runs["cpu"])
    cuda, cpu = (pd.read_parquet(runs[d] / "tokens.parquet") for d in ("cuda", "cpu"))
    assert cuda["draft_token"].tolist() == cpu["draft_token"].tolist()
    assert cuda["target_topk_ids"].map(list).tolist() == cpu["target_topk_ids"].map(list).tolist()


def test_sweep_and_compare_on_cuda(dense, tmp_path):
    target, draft = dense
    for name in ("a", "b"):
        ok(
            doctor(
                "sweep",
                "--target",
                target,
                "--draft",
                draft,
                *WORKLOAD,
                "--k",
                "1-7",
                "--device",
                "cuda",
                "--dtype",
                "bfloat16",
                "--out",
                tmp_path / name,
            )
        )
    result = doctor("compare", tmp_path / "a", tmp_path / "b")
    ok(result)


@pytest.mark.parametrize("fla", ["with", "without"])
def test_hybrid_replay_on_cuda_equals_hf_greedy_generate(hybrid, tmp_path, fla):
    """The engine rolls a hybrid's recurrent state back on rejection: its output must be the target's own greedy
    text, here against transformers' `generate` on the same GPU and dtype (raw prompts, so that the test
    tokenises them exactly as the tool does)."""
    if fla == "with":
        import fla  # noqa: F401 - scripts/gpu-tests.sh installs the `hybrid` extra; a missing one is a lane failure
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, draft = hybrid
    prompts = {
        f"{cls}-{i}": f"Question {i} about {cls}: explain step by step what happens next."
        for i in range(2)
        for cls in ("chat", "code", "math")
    }
    workload = tmp_path / "prompts.jsonl"
    workload.write_text(
        "".join(
            json.dumps({"id": rid, "class": rid.split("-")[0], "prompt": text}) + "\n" for rid, text in prompts.items()
        )
    )
    out = tmp_path / "replay"
    ok(
        doctor(
            "replay",
            "--target",
            target,
            "--draft",
            draft,
            "--workload",
            workload,
            "--max-new-tokens",
            "48",
            "--k",
            K,
            "--device",
            "cuda",
            "--dtype",
            "float32",
            "--out",
            out,
            prelude=WITHOUT_FLA if fla == "without" else "",
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).cuda().eval()
    produced = outputs(out)
    assert sorted(produced) == sorted(prompts)
    for rid, text in prompts.items():
        ids = torch.tensor([tokenizer(text)["input_ids"]], device="cuda")
        with torch.inference_mode():
            greedy = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=len(produced[rid]),
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        expected = greedy.sequences[0, ids.shape[1] :].tolist()
        ours = [int(token) for token in produced[rid]]
        parted = next((i for i, (a, b) in enumerate(zip(expected, ours)) if a != b), None)
        if fla == "without" or parted is None:
            assert ours == expected, rid
            continue
        # flash-linear-attention verifies K + 1 tokens with its chunked kernel and `generate` decodes one token with
        # its recurrent one: two summation orders, so where two logits are within their rounding the texts may
        # part (H200, torch 2.11, fla 0.6: one request of six, at a gap of 4.6e-4 of the largest logit). Up to
        # that point they must agree, and the point must be such a near tie.
        scores = greedy.scores[parted][0].float()
        gap = (scores[expected[parted]] - scores[ours[parted]]).item()
        assert 0 <= gap <= NEAR_TIE * scores.abs().max().item(), (rid, parted, gap)


def test_hybrid_check_and_sweep_on_cuda_in_bfloat16(hybrid, tmp_path):
    target, draft = hybrid
    run = tmp_path / "check"
    reaches_a_verdict(
        doctor(
            "check",
            "--target",
            target,
            "--draft",
            draft,
            *WORKLOAD,
            "--k",
            K,
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--out",
            run,
        ),
        run,
        "bfloat16",
    )
    ok(
        doctor(
            "sweep",
            "--target",
            target,
            "--draft",
            draft,
            *WORKLOAD,
            "--k",
            "1-7",
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--out",
            tmp_path / "sweep",
        )
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_check_on_cuda_is_not_called_lossy_for_its_kernels_numerics(hybrid, tmp_path, dtype):
    """Measured on an H200: on the Qwen3.5 shape with flash-linear-attention, `check --dtype float32` failed
    lossless at a top-2 margin of 0.002 (the verify pass runs fla's chunked kernel, plain decoding its recurrent
    one). The engine is lossless, so the check passes or warns, never fails; a warning carries each divergence's
    two kernel paths measured, and the probe records the fla kernels it found in the loaded target."""
    import fla  # noqa: F401 - scripts/gpu-tests.sh installs the `hybrid` extra; a missing one is a lane failure

    target, draft = hybrid
    run = tmp_path / "check"
    result = doctor(
        "check",
        "--target",
        target,
        "--draft",
        draft,
        "--workload",
        "demo",
        "--max-requests",
        "6",
        "--max-new-tokens",
        "96",
        "--k",
        K,
        "--device",
        "cuda",
        "--dtype",
        dtype,
        "--out",
        run,
    )
    assert "Traceback" not in result.stderr, result.stderr[-6000:]
    lossless = lossless_check(run)
    assert lossless["status"] in ("pass", "warn"), lossless
    probe = json.loads((run / "run.json").read_text())["probes"]["lossless"]
    assert probe["kernels"]["Qwen3_5GatedDeltaNet.torch_chunk_gated_delta_rule"] == "fla chunk_gated_delta_rule"
    assert probe["kernels"]["dtype"] == dtype and probe["kernels"]["device"] == "cuda"
    for divergence in probe["divergences"]:
        assert divergence["path_disagreement"] is not None and divergence["decode_top2"] is not None, divergence


def test_hybrid_replay_partings_from_hf_generate_are_the_kernels_numerics(hybrid, tmp_path):
    """Where replay (the live loop: fla's chunked kernel verifies K + 1 tokens) parts from transformers' `generate`
    (its recurrent kernel decodes one), is it numerics? One kernel path gives identical tokens: the engine's own
    plain decoding equals `generate` on every request. At each parting the position, scored again on the same
    prefix through the live loop's forwards and through one-token forwards, parts as the outputs did, or the
    parting margin is within the two paths' measured disagreement."""
    import fla  # noqa: F401 - scripts/gpu-tests.sh installs the `hybrid` extra; a missing one is a lane failure
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_doctor.engine.live import plain_generate
    from dflash_doctor.engine.step_records import StepRecord
    from dflash_doctor.engine.target import TargetModel
    from dflash_doctor.replay.probes import rescore, verify_forwards

    target, draft = hybrid
    prompts = {
        f"{cls}-{i}": f"Question {i} about {cls}: explain step by step what happens next."
        for i in range(2)
        for cls in ("chat", "code", "math")
    }
    workload = tmp_path / "prompts.jsonl"
    workload.write_text(
        "".join(
            json.dumps({"id": rid, "class": rid.split("-")[0], "prompt": text}) + "\n" for rid, text in prompts.items()
        )
    )
    out = tmp_path / "replay"
    ok(
        doctor(
            "replay",
            "--target",
            target,
            "--draft",
            draft,
            "--workload",
            workload,
            "--max-new-tokens",
            "96",
            "--k",
            K,
            "--device",
            "cuda",
            "--dtype",
            "float32",
            "--out",
            out,
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).cuda().eval()
    engine = TargetModel(model)
    produced = outputs(out)
    live_steps = steps(out)
    for rid, text in prompts.items():
        ids = torch.tensor([tokenizer(text)["input_ids"]], device="cuda")
        ours = [int(token) for token in produced[rid]]
        with torch.inference_mode():
            greedy = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=len(ours),
                eos_token_id=None,
                pad_token_id=0,
            )
        expected = greedy[0, ids.shape[1] :].tolist()
        assert plain_generate(engine, ids[0], max_new_tokens=len(ours)).output_ids == expected, rid
        parted = next((i for i, (a, b) in enumerate(zip(expected, ours)) if a != b), None)
        if parted is None:
            continue
        records = [
            StepRecord(step=n, position=position, k=int(K), num_drafted=drafted, num_accepted=accepted, bonus_token=-1)
            for n, (request, position, drafted, accepted) in enumerate(s for s in live_steps if s[0] == rid)
        ]
        lengths = verify_forwards(records, parted)
        assert lengths is not None, rid
        verify = rescore(engine, ids[0], ours, lengths, parted)
        decode = rescore(engine, ids[0], expected, [1] * parted, parted)
        disagreement = (verify - decode).abs().max().item()
        margin = (decode[expected[parted]] - decode[ours[parted]]).item()
        parts_as_outputs = int(verify.argmax()) == ours[parted] and int(decode.argmax()) == expected[parted]
        assert parts_as_outputs or 0 <= margin <= disagreement, (rid, parted, margin, disagreement)


def test_train_draft_runs_a_few_steps_on_cuda_and_its_draft_replays(dense, tmp_path):
    target, _ = dense
    out = tmp_path / "trained"
    ok(
        doctor(
            "train-draft",
            "--target",
            target,
            *WORKLOAD,
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--num-layers",
            "1",
            "--block-size",
            str(BLOCK),
            "--steps",
            "20",
            "--batch-size",
            "4",
            "--eval-requests",
            "0",
            "--out",
            out,
        )
    )
    ok(
        doctor(
            "replay",
            "--target",
            target,
            "--draft",
            out,
            *WORKLOAD,
            "--k",
            K,
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--out",
            tmp_path / "replay",
        )
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="check --devices needs two GPUs")
def test_check_devices_spreads_the_requests_over_two_gpus(dense, tmp_path):
    target, draft = dense
    one, two = tmp_path / "one", tmp_path / "two"
    ok(
        doctor(
            "replay",
            "--target",
            target,
            "--draft",
            draft,
            *WORKLOAD,
            "--k",
            K,
            "--device",
            "cuda:0",
            "--dtype",
            "float32",
            "--out",
            one,
        )
    )
    ok(
        doctor(
            "check",
            "--target",
            target,
            "--draft",
            draft,
            *WORKLOAD,
            "--k",
            K,
            "--devices",
            "cuda:0,cuda:1",
            "--dtype",
            "float32",
            "--out",
            two,
        )
    )
    assert outputs(one) == outputs(two)


def test_a_failing_compiler_on_cuda_gives_the_compiled_columns_eagerly(monkeypatch):
    """The fallback on the device it exists for: the eager columns equal the compiled ones (integer columns
    exactly, float columns to float32 rounding), on bf16 scores over the Qwen3 vocabulary; so do the eager
    blocks a run computes before compiling pays."""
    from dflash_doctor.engine import divergence
    from dflash_doctor.engine.divergence import TargetRows, divergence_tensor

    generator = torch.Generator(device="cuda").manual_seed(0)
    target_logits = (torch.randn(40, 151_936, device="cuda", generator=generator) * 3).bfloat16()
    draft_logits = (torch.randn(20, 7, 151_936, device="cuda", generator=generator) * 3).bfloat16()
    rows = TargetRows.of(target_logits, pad=7).windows(0, 20, 7)
    anchors = torch.tensor([0, 3, 8, 19], device="cuda")
    tokens = draft_logits[anchors].argmax(-1)
    divergence._fused_columns.cache_clear()
    blocked = divergence_tensor(draft_logits[anchors], tokens, rows, anchors)  # far below COMPILE_AFTER_SCORES
    fused = divergence._fused_columns()
    compiled = fused(draft_logits[anchors], tokens, *rows._fields(), anchors)
    assert fused.failure is None

    def compile_that_fails(fn, **options):
        def run(*args):
            raise RuntimeError("an Inductor failure")

        return run

    monkeypatch.setattr(torch, "compile", compile_that_fails)
    divergence._fused_columns.cache_clear()
    try:
        failing = divergence._fused_columns()
        eager = failing(draft_logits[anchors], tokens, *rows._fields(), anchors)
        assert failing.failure is not None
    finally:
        divergence._fused_columns.cache_clear()
    for other in (eager, blocked):
        assert torch.equal(compiled[..., 7:], other[..., 7:]) and torch.equal(compiled[..., 2], other[..., 2])
        torch.testing.assert_close(compiled, other, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ the other speculators


@pytest.fixture(scope="module")
def eagle3_head(dense) -> Path:
    """A random EAGLE-3 head for the dense target (speculators layout, a draft vocabulary of 4,096 ids through d2t,
    aux layers 1, 4, 6): rarely accepted, which is enough to hold the two devices to the same drafts."""
    from eagle3_heads import save_speculators_head
    from dflash_doctor.engine.eagle3_model import Eagle3Config, Eagle3DraftModel

    target, _ = dense
    torch.manual_seed(2)
    config = Eagle3Config(
        layer_type="qwen3",
        hidden_size=SHAPE["hidden_size"],
        num_attention_heads=SHAPE["num_attention_heads"],
        num_key_value_heads=SHAPE["num_key_value_heads"],
        head_dim=SHAPE["head_dim"],
        intermediate_size=SHAPE["intermediate_size"],
        rms_norm_eps=1e-6,
        target_hidden_size=SHAPE["hidden_size"],
        target_vocab_size=SHAPE["vocab_size"],
        draft_vocab_size=4096,
        aux_layer_ids=[1, 4, 6],
    )
    head = Eagle3DraftModel(config, own_embedding=False, own_lm_head=True).float()
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.08) if parameter.dim() > 1 else parameter.fill_(1.0)
        head.d2t.copy_(torch.arange(4096) * 30)  # draft id i -> target id 31 i: spread over the vocabulary
    return save_speculators_head(head, target.parent / "eagle3", verifier=str(target), k=4)


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory) -> Path:
    """A Qwen3.5-shaped target of attention layers only, with a Qwen3.5-layout MTP head written into its checkpoint
    (``mtp.*``: its block a copy of the target's first layer, random fc and norms), as a user's local folder.
    Attention only because the devices must compute the same target: with gated-delta-net layers a CUDA machine runs
    flash-linear-attention's kernels and a CPU transformers' torch code, which part at near ties (on the H200,
    2026-12-04, the float32 mtp replays of the hybrid target parted between the devices in several of the 10 turns)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5TextConfig

    target, _ = _save_pair(
        tmp_path_factory.mktemp("mtp"), Qwen3_5TextConfig(**SHAPE, layer_types=["full_attention"] * 8)
    )
    tensors = load_file(target / "model.safetensors")
    torch.manual_seed(3)
    hidden = SHAPE["hidden_size"]
    tensors.update(
        {
            name.replace("model.layers.0.", "mtp.layers.0."): tensor.clone()
            for name, tensor in tensors.items()
            if name.startswith("model.layers.0.")
        }
    )
    tensors.update(
        {
            "mtp.fc.weight": torch.randn(hidden, 2 * hidden) * 0.05,
            "mtp.pre_fc_norm_embedding.weight": torch.ones(hidden),
            "mtp.pre_fc_norm_hidden.weight": torch.ones(hidden),
            "mtp.norm.weight": torch.ones(hidden),
        }
    )
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (target / "config.json").write_text(json.dumps(config))
    return target


def _same_replay_on_both_devices(target: Path, draft: Path | str, tmp_path: Path) -> None:
    runs = {}
    for device in ("cuda", "cpu"):
        runs[device] = tmp_path / device
        ok(
            doctor(
                "replay",
                "--target",
                target,
                "--draft",
                draft,
                *WORKLOAD,
                "--k",
                "4",
                "--device",
                device,
                "--dtype",
                "float32",
                "--out",
                runs[device],
            )
        )
    assert outputs(runs["cuda"]) == outputs(runs["cpu"])
    assert steps(runs["cuda"]) == steps(runs["cpu"])
    cuda, cpu = (pd.read_parquet(runs[d] / "tokens.parquet") for d in ("cuda", "cpu"))
    assert cuda["draft_token"].tolist() == cpu["draft_token"].tolist()


def test_eagle3_replay_on_cuda_equals_the_cpus_token_for_token(dense, eagle3_head, tmp_path):
    target, _ = dense
    _same_replay_on_both_devices(target, eagle3_head, tmp_path)


def test_mtp_replay_on_cuda_equals_the_cpus_token_for_token(mtp_target, tmp_path):
    _same_replay_on_both_devices(mtp_target, "mtp", tmp_path)


def test_head_to_head_of_every_speculator_kind_on_cuda_in_bfloat16(dense, eagle3_head, tmp_path):
    """DFlash, EAGLE-3, n-gram and suffix decoding on one target
    and one set of turns: a table and a verdict, no crash."""
    target, draft = dense
    out = tmp_path / "h2h"
    result = doctor(
        "check",
        "--target",
        target,
        "--draft",
        draft,
        "--draft",
        eagle3_head,
        "--draft",
        "ngram",
        "--draft",
        "suffix",
        *WORKLOAD,
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--out",
        out,
    )
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr[-6000:]
    table = json.loads((out / "head_to_head.json").read_text())
    assert [s["name"] for s in table["speculators"]] == ["draft", "eagle3", "ngram", "suffix"]
