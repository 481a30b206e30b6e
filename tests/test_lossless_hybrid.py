"""The lossless check on hybrid targets: which kernels the target ran, the verify and decode paths
scored again at a divergence, and the rule that tells the kernels' numerics from an engine defect.

On a CPU in float32 with transformers' torch fallbacks: tiny Qwen3.5 / Qwen3-Next targets (three gated-delta-net
layers to one attention layer) and the tiny Llama target, built from configs in-process.
"""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

from dflash_doctor.checks import CheckContext, run_checks
from dflash_doctor.engine import cache as engine_cache
from dflash_doctor.engine.cache import RollbackCache, crop_key_values
from dflash_doctor.engine.kernels import kernel_paths, resolve_kernel
from dflash_doctor.engine.live import GenerationResult, plain_generate, speculative_generate
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.inputs.config import build_config
from dflash_doctor.inputs.workloads import load_workload
from dflash_doctor.models.loading import save_dflash_draft
from dflash_doctor.models.pair import load_pair
from dflash_doctor.replay.probes import lossless_probe, rescore, verify_forwards
from dflash_doctor.replay.turns import Turn, first_turn_prompt
from dflash_doctor.rundir.run_record import Divergence, LosslessProbe, Probes, RunMeta, RunRecord
from checks_fixtures import record
from target_families import tiny_family_target
from tiny_models import tiny_dflash, tiny_target, tiny_tokenizer, write_workload

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 42, 8, 9, 33, 61]
MAX_NEW = 24
K = 3


# ------------------------------------------------------------------------------------------ kernel paths


def test_kernel_paths_name_the_torch_fallbacks_of_a_hybrid_and_plain_attention_of_a_llama():
    """Read from the loaded modules: each gated-delta-net class's chunked and recurrent entry points resolve to
    transformers' torch code on a CPU (flash-linear-attention is not installed here, and would not run on a CPU);
    a Llama target has attention only."""
    common = {"dtype": "float32", "device": "cpu", "attention": "sdpa", "float32 matmul": "highest"}
    assert kernel_paths(tiny_target()) == common
    for family, mixer in (("qwen3_5", "Qwen3_5GatedDeltaNet"), ("qwen3_next", "Qwen3NextGatedDeltaNet")):
        paths = kernel_paths(tiny_family_target(family))
        assert paths.items() >= common.items()
        assert paths[f"{mixer}.torch_chunk_gated_delta_rule"] == "transformers torch_chunk_gated_delta_rule"
        assert paths[f"{mixer}.torch_recurrent_gated_delta_rule"] == "transformers torch_recurrent_gated_delta_rule"


def test_a_dispatcher_resolves_to_the_installed_package_only_on_a_device_it_supports(monkeypatch):
    """transformers' own dispatcher over a stand-in flash-linear-attention: its kernel on CUDA, the torch code on
    a CPU (where transformers falls back at call time), as :func:`kernel_paths` reports them."""

    def chunk_gated_delta_rule(query, key, value, g, beta):
        return query

    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule.chunk"
    fla = types.ModuleType("fla")
    fla.ops = types.SimpleNamespace(
        gated_delta_rule=types.SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule)
    )  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fla", fla)

    def torch_chunk_gated_delta_rule(query, key, value, g, beta):
        return query

    dispatcher = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")(torch_chunk_gated_delta_rule)
    assert resolve_kernel(dispatcher, "cuda") == ("torch_chunk_gated_delta_rule", "fla chunk_gated_delta_rule")
    assert resolve_kernel(dispatcher, "cpu") == (
        "torch_chunk_gated_delta_rule",
        f"{__name__} torch_chunk_gated_delta_rule",
    )
    assert resolve_kernel(torch_chunk_gated_delta_rule, "cuda") is None  # a plain function dispatches nothing


# ------------------------------------------------------------------------------- the two paths, measured


def _recorded_rows(target: TargetModel, generate) -> tuple[GenerationResult, dict[int, torch.Tensor]]:
    """``generate()``'s result and every row of logits its target forwards computed, by the cache position
    that row scores from (instrumentation of this test: the engine keeps no logits)."""
    rows: dict[int, torch.Tensor] = {}
    forward = target.forward

    def recording(token_ids, taps=None, logits_from=0):
        start = target.cache_length
        out = forward(token_ids, taps=taps, logits_from=logits_from)
        first = start + max(0, min(logits_from, len(token_ids) - 1))
        rows.update({first + i: row.clone() for i, row in enumerate(out.logits)})
        return out

    target.forward = recording  # type: ignore[method-assign]
    try:
        return generate(), rows
    finally:
        del target.forward


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_the_decode_path_is_plain_decoding_and_the_verify_path_the_live_loops_forwards(family):
    """With a self-draft every block is accepted, so the live loop's forwards are exactly its committed blocks:
    re-scored along :func:`verify_forwards` every position gives the live loop's own logits bit for bit, and
    one token per forward gives plain decoding's."""
    model = tiny_target() if family == "llama" else tiny_family_target(family)
    target, prompt = TargetModel(model), torch.tensor(PROMPT)
    live, live_rows = _recorded_rows(
        target,
        lambda: speculative_generate(
            target, AutoregressiveProposer(copy.deepcopy(model)), prompt, k=K, max_new_tokens=MAX_NEW
        ),
    )
    plain, plain_rows = _recorded_rows(target, lambda: plain_generate(target, prompt, max_new_tokens=MAX_NEW))
    output = live.output_ids
    assert output == plain.output_ids and len(live.steps) < MAX_NEW // 2  # blocks of several tokens were verified
    for position in range(1, len(output)):
        lengths = verify_forwards(live.steps, position)
        assert lengths is not None and max(lengths) > 1
        row = len(PROMPT) + position - 1
        assert torch.equal(rescore(target, prompt, output, lengths, position), live_rows[row])
        assert torch.equal(rescore(target, prompt, output, [1] * position, position), plain_rows[row])


def _largest_disagreement(model) -> tuple[float, float]:
    """The largest difference between the verify and decode paths' logits over the positions of a plain output,
    with the blocks a draft that accepts some tokens and rejects others verified, and the largest logit."""
    target, prompt = TargetModel(model), torch.tensor(PROMPT)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    live = speculative_generate(target, AutoregressiveProposer(draft), prompt, k=K, max_new_tokens=MAX_NEW)
    worst = largest = 0.0
    for position in range(1, len(live.output_ids)):
        lengths = verify_forwards(live.steps, position)
        assert lengths is not None
        verify = rescore(target, prompt, live.output_ids, lengths, position)
        decode = rescore(target, prompt, live.output_ids, [1] * position, position)
        worst, largest = max(worst, float((verify - decode).abs().max())), max(largest, float(decode.abs().max()))
    return worst, largest


def test_the_paths_disagree_on_a_hybrid_and_only_by_float32_rounding_on_attention():
    """The hybrid's chunked and recurrent gated-delta-rule code sum in different orders: its two paths measurably
    disagree. The Llama target's differ only by float32 matmul rounding of different shapes: within a few dozen
    float32 steps at the size of its logits."""
    eps = torch.finfo(torch.float32).eps
    for family in ("qwen3_5", "qwen3_next"):
        worst, _ = _largest_disagreement(tiny_family_target(family))
        assert worst > 0, family
    worst, largest = _largest_disagreement(tiny_target())
    assert worst <= 64 * eps * largest


# ------------------------------------------------------------------------------------------ the rule


KERNELS = {
    "dtype": "float32",
    "device": "cuda",
    "attention": "sdpa",
    "float32 matmul": "highest",
    "Qwen3_5GatedDeltaNet.torch_chunk_gated_delta_rule": "fla chunk_gated_delta_rule",
    "Qwen3_5GatedDeltaNet.torch_recurrent_gated_delta_rule": "fla fused_recurrent_gated_delta_rule",
}


def _divergence(verify_top2, decode_top2, margin, disagreement) -> Divergence:
    """The reported H200 case: request mt-bench/81 parts at output token 60 between 1234 and 987."""
    return Divergence(
        request_id="mt-bench/81",
        position=60,
        speculative_token=1234,
        plain_token=987,
        speculative_text=" four",
        plain_text=" 4",
        top2_margin=margin,
        top1_logit=15.0,
        verify_top2=verify_top2,
        verify_margin=margin,
        decode_top2=decode_top2,
        decode_margin=margin,
        path_disagreement=disagreement,
    )


def _judge(*divergences: Divergence, dtype: str = "float32", kernels=KERNELS):
    probe = LosslessProbe(
        num_requests=3, num_identical=3 - len(divergences), dtype=dtype, divergences=list(divergences), kernels=kernels
    )
    return run_checks(CheckContext(record=record(probes=Probes(lossless=probe))), only=["lossless"])[0]


def test_a_float32_divergence_the_kernel_paths_part_on_warns_naming_the_kernels():
    result = _judge(_divergence([1234, 987], [987, 1234], margin=0.002, disagreement=0.0015))
    assert result.status == "warn", result
    assert result.summary.startswith("1 of 3 requests diverge from plain decoding, explained by the target's kernels")
    assert "disagree by up to 0.0015 in the logits, enough to flip a top-2 margin of 0.002" in result.summary
    evidence = result.findings[0].evidence
    assert "request mt-bench/81, output token 60" in evidence
    assert "Qwen3_5GatedDeltaNet runs fla chunk_gated_delta_rule, fla fused_recurrent_gated_delta_rule" in evidence
    assert "attention sdpa" in evidence and "float32 matmul highest" in evidence
    assert result.fix.startswith("confirm with a target whose verify and decode passes run one kernel")
    assert result.metrics["num_kernel_numerics_divergences"] == 1


def test_a_margin_within_the_measured_disagreement_warns_even_where_both_paths_pick_one_token():
    """The re-scoring need not reproduce the flip itself: a runner-up within the paths' disagreement can flip."""
    assert _judge(_divergence([987, 1234], [987, 1234], margin=0.002, disagreement=0.003)).status == "warn"


@pytest.mark.parametrize(
    "divergence",
    [
        _divergence([987, 1234], [987, 1234], margin=0.5, disagreement=0.003),  # both paths agree: a rollback defect
        _divergence([987, 5], [987, 5], margin=0.001, disagreement=0.003),  # the speculative token is no runner-up
        _divergence([1234, 987], [1234, 987], margin=0.5, disagreement=0.003),  # the decode path is not plain's
    ],
)
def test_a_divergence_the_kernel_paths_do_not_explain_fails(divergence):
    result = _judge(divergence)
    assert result.status == "fail" and "the engine is not lossless" in result.summary
    assert "their logits differ by up to 0.003 there" in result.findings[0].evidence
    assert "KV-cache rollback" in result.fix


def test_records_without_the_paths_are_judged_as_before_and_old_run_json_reads_unchanged():
    old = Divergence("r", 3, 1, 2, "a", "b", top2_margin=0.01, top1_logit=15.0)
    assert _judge(old, kernels={}).status == "fail"  # float32: any divergence without evidence is a loss
    assert _judge(old, dtype="bfloat16", kernels={}).status == "warn"  # a bf16 near-tie, by the rounding rule
    written = RunRecord(meta=RunMeta(command="check")).to_json()  # a run.json as runs before the kernel paths wrote it
    written["probes"]["lossless"] = {
        "num_requests": 2,
        "num_identical": 1,
        "dtype": "float32",
        "divergences": [
            {
                "request_id": "r",
                "position": 3,
                "speculative_token": 1,
                "plain_token": 2,
                "speculative_text": "a",
                "plain_text": "b",
                "top2_margin": 0.01,
                "top1_logit": 15.0,
            }
        ],
    }
    run = RunRecord.from_json(written)
    assert run.probes.lossless == LosslessProbe(2, 1, "float32", [old])
    new = RunRecord(
        meta=RunMeta(command="check"),
        probes=Probes(lossless=LosslessProbe(3, 2, "float32", [_divergence([1], [2], 0.1, 0.2)], KERNELS)),
    )
    assert RunRecord.from_json(new.to_json()).probes == new.probes


# ------------------------------------------------------------------------------ the probe on a real target


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """A tiny Qwen3.5 target with its tokenizer and a random DFlash draft (rejected nearly always: every step
    rolls the recurrent states back), loaded as `check` loads them, and its plain greedy turns."""
    root = tmp_path_factory.mktemp("hybrid")
    target = tiny_family_target("qwen3_5")
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    save_dflash_draft(tiny_dflash(target, block_size=K + 1, layer_ids=(0, 2)), root / "dflash")
    config = build_config(
        target=str(root / "target"),
        draft=str(root / "dflash"),
        workload=str(write_workload(root / "workload.jsonl", per_class=1)),
        max_new_tokens=MAX_NEW,
    )
    pair = load_pair(config)
    turns = []
    for request in load_workload(config.workload, seed=config.seed):
        prompt = first_turn_prompt(pair, request)
        plain = plain_generate(pair.target, torch.tensor(prompt), max_new_tokens=MAX_NEW, stop_ids=pair.stop_ids)
        turns.append(Turn(request, 0, prompt, MAX_NEW, plain))
    return pair, turns


def _keep_rejected_tokens_in_the_recurrent_states(cache: RollbackCache, length: int) -> None:
    """A broken rollback: the key/value rows are cropped, the recurrent states keep the rejected drafts."""
    crop_key_values(cache.cache, length)
    cache.length = length


def test_the_probe_on_a_hybrid_passes_a_sound_engine_and_fails_a_broken_rollback(hybrid_pair, monkeypatch):
    """The sound engine reproduces plain decoding on the tiny hybrid, with its kernels recorded. A rollback that
    leaves the rejected drafts in the gated-delta-net states diverges, and the probe's two re-scorings (which
    roll nothing back) agree with each other and with plain decoding there, by a margin far above their
    disagreement: the check fails it, in float32 as before."""
    pair, turns = hybrid_pair
    sound = lossless_probe(pair, turns, K, "float32")
    assert (sound.num_identical, sound.divergences) == (len(turns), [])
    assert (
        sound.kernels["Qwen3_5GatedDeltaNet.torch_chunk_gated_delta_rule"]
        == "transformers torch_chunk_gated_delta_rule"
    )

    monkeypatch.setattr(engine_cache.RollbackCache, "crop", _keep_rejected_tokens_in_the_recurrent_states)
    broken = lossless_probe(pair, turns, K, "float32")
    assert broken.divergences, "the broken rollback went unnoticed"
    for divergence in broken.divergences:
        assert divergence.verify_top2 is not None and divergence.decode_top2 is not None
        assert divergence.verify_top2[0] == divergence.decode_top2[0] == divergence.plain_token
        assert divergence.path_disagreement is not None and divergence.decode_margin is not None
        assert 0 < divergence.path_disagreement < divergence.decode_margin
    result = run_checks(CheckContext(record=record(probes=Probes(lossless=broken))), only=["lossless"])[0]
    assert result.status == "fail", result
