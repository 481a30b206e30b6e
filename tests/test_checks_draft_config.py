"""draft-config: static DFlash config checks against the target, and the offset-probe hook."""

from __future__ import annotations

import json
import struct

from dflash_doctor.checks import CheckContext, run_checks
from dflash_doctor.inputs.config import build_config
from dflash_doctor.inputs.validation import safetensors_shapes
from dflash_doctor.rundir.run_record import Probes
from checks_fixtures import record

TARGET = {
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "vocab_size": 300,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
}


def _draft(**overrides):
    config = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": 64,
        "num_target_layers": 8,
        "block_size": 8,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
        "dflash_config": {"mask_token_id": 299, "target_layer_ids": [1, 3, 5]},
    }
    config.update(overrides)
    return config


def _check(draft, target=TARGET, k="7", shapes=None, offset_probe=None, offset_probe_drafts=None):
    run = record(probes=Probes(offset_probe=offset_probe, offset_probe_drafts=offset_probe_drafts))
    ctx = CheckContext(
        draft_config=draft, target_config=target, config=build_config(k=k), draft_weight_shapes=shapes, record=run
    )
    return run_checks(ctx, only=["draft-config"])[0]


def test_draft_config_pass_consistent_draft():
    result = _check(_draft(), shapes={"fc.weight": [64, 192]}, offset_probe={-1: 2.1, 0: 4.0, 1: 2.5})
    assert result.status == "pass", [f.message for f in result.findings]
    assert result.metrics["offset_probe"] == {-1: 2.1, 0: 4.0, 1: 2.5}


def test_draft_config_warn_rope_dtype_and_target_depth():
    result = _check(_draft(rope_theta=10000.0, torch_dtype="float16", num_target_layers=36))
    assert result.status == "warn"
    messages = [f.message for f in result.findings]
    assert "rope_theta differs: draft 10000.0 vs target 1000000.0" in messages
    assert "dtype differs: draft float16 vs target bfloat16" in messages
    assert "the draft was trained for a 36-layer target; this target has 8" in messages


def test_draft_config_fail_sizes_layers_block_and_mask():
    draft = _draft(hidden_size=32, dflash_config={"mask_token_id": 300, "target_layer_ids": [1, 5, 8]})
    result = _check(draft, k="8", shapes={"fc.weight": [32, 64]})
    assert result.status == "fail"
    failures = [f.message for f in result.findings if f.severity == "fail"]
    assert "draft hidden_size 32 differs from the target's 64" in failures
    assert "fc.weight is [32, 64] but 3 layer ids x hidden 32 needs [32, 96]" in failures
    assert "target_layer_ids [8] are outside the target's 8 layers" in failures
    assert "K 8 exceeds the 7 tokens one block of 8 drafts" in failures
    assert "mask token id 300 is outside the embedding (vocab_size 300)" in failures


def test_draft_config_fail_offset_probe_neighbour_wins():
    result = _check(_draft(), offset_probe={-1: 1.4, 0: 1.6, 1: 4.2})
    assert result.status == "fail"
    assert result.summary == "layer ids shifted by +1 give acceptance length 4.20 vs 1.60 as configured"
    assert "shift dflash_config.target_layer_ids by +1" in result.fix
    within_margin = _check(_draft(), offset_probe={0: 4.0, 1: 4.1})
    assert within_margin.status == "pass"
    assert any(
        "no shifted layer ids accept 10% more tokens than the configured ones" in f.message
        for f in within_margin.findings
    )


def test_draft_config_skips_autoregressive_drafts():
    result = run_checks(
        CheckContext(draft_config={"hidden_size": 64}, draft_kind="autoregressive"), only=["draft-config"]
    )[0]
    assert result.status == "skip"


def test_safetensors_shapes_reads_only_the_header(tmp_path):
    header = json.dumps(
        {"fc.weight": {"dtype": "F32", "shape": [4, 12], "data_offsets": [0, 192]}, "__metadata__": {"format": "pt"}}
    ).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 192)
    assert safetensors_shapes(path) == {"fc.weight": [4, 12]}


def test_draft_config_offset_probe_with_too_few_drafts_only_reports():
    result = _check(_draft(), offset_probe={-1: 1.4, 0: 1.3, 1: 1.2}, offset_probe_drafts=12)
    assert result.status != "fail"
    assert any("inconclusive" in f.message for f in result.findings)
    enough = _check(_draft(), offset_probe={-1: 1.4, 0: 1.3, 1: 1.2}, offset_probe_drafts=400)
    assert enough.status == "fail"


# The DFlash variants' rules (causality, layer-id convention, reserved mask row, own lm_head, draft sampling).


def _findings(result, severity):
    return [f.message for f in result.findings if f.severity == severity]


def _engine_check(draft, *, engine=None, temperature=0.0, target=TARGET):
    ctx = CheckContext(
        draft_config=draft,
        target_config=target,
        config=build_config(k="7", temperature=temperature),
        engine_config=engine,
    )
    return run_checks(ctx, only=["draft-config"])[0]


def test_causality_pass_warn_fail():
    assert _check(_draft(is_causal=True)).status == "pass"
    only_nested = _check(_draft(dflash_config={"mask_token_id": 299, "target_layer_ids": [1, 3, 5], "causal": True}))
    assert only_nested.status == "warn"
    assert _findings(only_nested, "warn") == ["causality is set only by dflash_config.causal = True"]
    contradiction = _check(
        _draft(is_causal=False, dflash_config={"mask_token_id": 299, "target_layer_ids": [1, 3, 5], "causal": True})
    )
    assert "is_causal False contradicts dflash_config.causal True" in _findings(contradiction, "fail")


def test_mixed_sliding_layers_warn_only_for_vllm():
    mixed = _draft(layer_types=["sliding_attention", "full_attention"], sliding_window=64, use_sliding_window=True)
    assert _engine_check(mixed, engine={"engine": "sglang"}).status == "pass"
    assert _findings(_engine_check(mixed, engine={"engine": "vllm"}), "warn") == [
        "the draft mixes sliding and full attention layers"
    ]


def test_layer_ids_in_plus_one_convention_fail():
    assert _check(_draft(dflash_config={"mask_token_id": 299, "target_layer_ids": [2, 4, 7]})).status == "pass"
    shifted = _check(_draft(dflash_config={"mask_token_id": 299, "target_layer_ids": [2, 4, 8]}))
    assert (
        "target_layer_ids [2, 4, 8] look like the +1 convention (speculators aux ids, GGUF target_layers)"
        in _findings(shifted, "fail")
    )
    assert "[1, 3, 7]" in shifted.fix or any("[1, 3, 7]" in (f.fix or "") for f in shifted.findings)


def test_speculators_ids_are_converted_and_reported():
    speculators = {
        "speculators_model_type": "dflash",
        "mask_token_id": 299,
        "aux_hidden_state_layer_ids": [2, 4, 8],
        "block_size": 8,
        "transformer_layer_config": {
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 300,
            "rope_theta": 1000000.0,
        },
    }
    result = _check(speculators)
    assert result.status == "pass", [f.message for f in result.findings]
    assert result.metrics["target_layer_ids"] == [1, 3, 7] and result.metrics["dialect"] == "speculators"
    assert "speculators layer ids [2, 4, 8] read as [1, 3, 7]" in _findings(result, "info")


def test_mask_row_pass_and_fail():
    assert _check(_draft(), target={**TARGET, "eos_token_id": 2, "pad_token_id": 0}).status == "pass"
    clash = _check(_draft(), target={**TARGET, "eos_token_id": 299, "pad_token_id": 299})
    assert "mask token id 299 is the target's eos token" in _findings(clash, "fail")


def test_own_lm_head_warn_and_draft_vocabulary_info():
    shapes = {"fc.weight": [64, 192]}
    assert _check(_draft(), shapes=shapes).status == "pass"
    own = _check(_draft(), shapes={**shapes, "lm_head.weight": [300, 64]})
    assert _findings(own, "warn") == ["the draft ships its own lm_head.weight"]


def test_draft_sample_method_pass_warn():
    draft = _draft()
    greedy_engine = {"engine": "vllm", "draft_sample_method": "greedy"}
    assert (
        _engine_check(draft, engine=greedy_engine, temperature=0.0).status == "pass"
    )  # greedy decoding: no difference
    assert (
        _engine_check(draft, engine={"engine": "vllm", "draft_sample_method": "probabilistic"}, temperature=0.8).status
        == "pass"
    )
    mismatch = _engine_check(draft, engine=greedy_engine, temperature=0.8)
    assert _findings(mismatch, "warn") == [
        "the engine drafts greedy but the draft was evaluated with probabilistic drafts"
    ]


def test_unreadable_dialect_fails_with_the_key():
    result = _check(_draft(dflash_config={"mask_token_id": 299, "target_layer_ids": [1, 3, 5], "use_swa": True}))
    assert result.status == "fail"
    assert "dflash_config.use_swa = True" in result.findings[0].message


def test_missing_layer_ids_fail_names_every_engines_guess():
    """A Qwen3-8B-shaped pair (36 target layers, 5 draft layers): the engines' guesses differ (z-lab and SGLang
    spread five taps, vLLM taps its three EAGLE-3 defaults), so the check fails instead of picking one."""
    draft = _draft(num_hidden_layers=5, num_target_layers=36, dflash_config={"mask_token_id": 299})
    result = _check(draft, target=dict(TARGET, num_hidden_layers=36))
    assert result.status == "fail"
    assert "states no target_layer_ids" in result.summary
    assert "z-lab dflash 0.1.0 [1, 9, 17, 25, 33]; SGLang [1, 9, 17, 25, 33]; vLLM [1, 17, 32]" in result.summary
    deeper = _check(
        draft, target=dict(TARGET, num_hidden_layers=28)
    )  # SGLang follows the served target, z-lab the config
    assert "z-lab dflash 0.1.0 [1, 9, 17, 25, 33]; SGLang [1, 7, 13, 19, 25]; vLLM [1, 13, 24]" in deeper.summary


def test_served_block_size_and_one_causality_for_all_layers():
    sglang = {"engine": "sglang", "dflash_block_size": 16, "speculative_num_draft_tokens": 16, "drafted_tokens": 15}
    ctx = CheckContext(draft_config=_draft(), target_config=TARGET, config=build_config(k="7"), engine_config=sglang)
    result = run_checks(ctx, only=["draft-config"])[0]
    assert result.status == "fail"
    assert "the engine drafts blocks of 16 but the draft was trained with block_size 8" in [
        f.message for f in result.findings
    ]
    mixed = _check(
        _draft(
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=64,
            use_sliding_window=True,
        )
    )
    messages = [f.message for f in mixed.findings]
    assert any("llama.cpp applies one causality to every draft layer" in m for m in messages)
    assert any(
        m.startswith("serving the whole block of 8 takes: vLLM speculative_config.num_speculative_tokens = 7")
        and "SGLang --speculative-num-draft-tokens = 8" in m
        and "llama.cpp --spec-draft-n-max = 7 (default 3" in m
        for m in messages
    )
    explicit = _check(_draft(num_hidden_layers=2, is_causal=True, layer_types=["sliding_attention", "full_attention"]))
    assert not any("one causality" in f.message for f in explicit.findings)


def test_engine_method_must_match_a_dspark_draft():
    dspark = _draft(
        architectures=["DSparkDraftModel"],
        dflash_config={
            "mask_token_id": 299,
            "target_layer_ids": [1, 3, 5],
            "markov_rank": 8,
            "sample_from_anchor": False,
        },
    )
    vllm = {"engine": "vllm", "method": "dflash", "num_speculative_tokens": 7, "drafted_tokens": 7}
    result = run_checks(
        CheckContext(draft_config=dspark, target_config=TARGET, config=build_config(k="7"), engine_config=vllm),
        only=["draft-config"],
    )[0]
    assert "the engine serves this DSpark draft with method dflash" in [f.message for f in result.findings]
    plain = run_checks(
        CheckContext(
            draft_config=_draft(),
            target_config=TARGET,
            config=build_config(k="7"),
            engine_config=dict(vllm, method="dspark"),
        ),
        only=["draft-config"],
    )[0]
    assert plain.status == "fail" and "the engine serves this DFlash draft with method dspark" in plain.summary


def test_draft_config_offset_probe_ignores_a_relative_gain_of_almost_nothing():
    """A draft broken by something else accepts almost nothing at every offset: 0.15 vs 0.13 tokens per draft is
    15% more, but 0.02 tokens, noise rather than a shift (seen
    with an EAGLE-3 head served with a flipped norm switch)."""
    result = _check(_draft(), offset_probe={-1: 1.15, 0: 1.13}, offset_probe_drafts=400)
    assert result.status != "fail", result.summary
