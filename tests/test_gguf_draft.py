"""llama.cpp DFlash drafts (GGUF) load into the same module as their safetensors original, or are refused.

Two references: GGUF files written here with the names and keys llama.cpp's converter writes (tensor names
from ``gguf-py/gguf/constants.py`` and ``conversion/qwen.py`` ``DFlashModel`` of the PyPI
``llama-cpp-python`` 0.3.36 sdist, ``vendor/llama.cpp``, commit 0c1e570), checked through the draft logits
on a tiny target; and (marker ``llamacpp``) GGUF files written by that converter itself from the demo draft
and from a DFlash 2 variant of it, checked weight for weight against the safetensors load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from official_dflash import official_config, official_model, real_variant, save_official
from tiny_models import first_block_logits, tiny_dflash, tiny_target

from dflash_doctor.engine.dflash_model import DFlashConfig
from dflash_doctor.engine.dspark_model import DSparkDraftModel
from dflash_doctor.errors import UsageError
from dflash_doctor.models.gguf_draft import read_gguf_draft
from dflash_doctor.models.loading import (
    DEMO_DRAFT_DIR,
    demo_target_path,
    load_dflash_draft,
    resolve_model_dir,
    save_dflash_draft,
)

REPO = Path(__file__).resolve().parent.parent
CONVERTER = REPO / ".llama-cpp" / "0.3.36" / "llama.cpp" / "convert_hf_to_gguf.py"  # scripts/build-llama-server.sh

#: Hugging Face name -> llama.cpp GGUF name (``{}`` = layer), as constants.py names them.
LLAMA_CPP_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "input_layernorm.weight": "blk.{}.attn_norm.weight",
    "self_attn.q_proj.weight": "blk.{}.attn_q.weight",
    "self_attn.k_proj.weight": "blk.{}.attn_k.weight",
    "self_attn.v_proj.weight": "blk.{}.attn_v.weight",
    "self_attn.o_proj.weight": "blk.{}.attn_output.weight",
    "self_attn.q_norm.weight": "blk.{}.attn_q_norm.weight",
    "self_attn.k_norm.weight": "blk.{}.attn_k_norm.weight",
    "post_attention_layernorm.weight": "blk.{}.ffn_norm.weight",
    "self_attn.attention_sink_bias": "blk.{}.attn_sinks.weight",
    "mlp.gate_proj.weight": "blk.{}.ffn_gate.weight",
    "mlp.up_proj.weight": "blk.{}.ffn_up.weight",
    "mlp.down_proj.weight": "blk.{}.ffn_down.weight",
    "attention_conv.base_kernel": "blk.{}.attn_conv_base",
    "attention_conv.kernel_projection.weight": "blk.{}.attn_conv_proj.weight",
    "mlp_conv.base_kernel": "blk.{}.ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "blk.{}.ffn_conv_proj.weight",
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}


def _gguf_name(key: str) -> str:
    if key.startswith("layers."):
        _, layer, rest = key.split(".", 2)
        return LLAMA_CPP_NAMES[rest].format(layer)
    return LLAMA_CPP_NAMES[key]


def write_llama_cpp_gguf(checkpoint: Path, out: Path, *, extra_tensors=None, drop_keys=(), **extra_keys) -> Path:
    """The GGUF llama.cpp's converter writes for the official checkpoint in ``checkpoint`` (keys as DFlashModel
    .set_gguf_parameters writes them: Qwen3 hparams, block_size, target_layers = ids + 1, DFlash 2 keys)."""
    config = json.loads((checkpoint / "config.json").read_text())
    dflash = config["dflash_config"]
    writer = gguf.GGUFWriter(str(out), "dflash")
    values = {
        "dflash.block_count": config["num_hidden_layers"],
        "dflash.context_length": config["max_position_embeddings"],
        "dflash.embedding_length": config["hidden_size"],
        "dflash.feed_forward_length": config["intermediate_size"],
        "dflash.attention.head_count": config["num_attention_heads"],
        "dflash.attention.head_count_kv": config["num_key_value_heads"],
        "dflash.attention.key_length": config["head_dim"],
        "dflash.attention.value_length": config["head_dim"],
        "dflash.block_size": config["block_size"],
        "dflash.vocab_size": config["vocab_size"],
        "tokenizer.ggml.mask_token_id": dflash["mask_token_id"],
        **{
            f"dflash.{k}": dflash[k]
            for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
            if k in dflash
        },
    }
    values.update(extra_keys)
    for key, value in values.items():
        if key not in drop_keys:
            writer.add_uint32(key, int(value)) if isinstance(value, int) and not isinstance(value, bool) else (
                writer.add_bool(key, value) if isinstance(value, bool) else writer.add_float32(key, float(value))
            )
    for key, value in (
        ("dflash.attention.layer_norm_rms_epsilon", config["rms_norm_eps"]),
        ("dflash.rope.freq_base", config.get("rope_theta") or config["rope_parameters"]["rope_theta"]),
    ):
        writer.add_float32(key, value)
    if "dflash.target_layers" not in drop_keys:
        writer.add_array("dflash.target_layers", [i + 1 for i in dflash["target_layer_ids"]])
    for key, tensor in load_file(checkpoint / "model.safetensors").items():
        writer.add_tensor(_gguf_name(key), tensor.float().numpy())
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("variant", ["full", "dflash2"])
def test_llama_cpp_gguf_equals_its_safetensors_original(variant, target, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_DOCTOR_CACHE", str(tmp_path / "cache"))
    zlab_dir = save_official(official_model(official_config(target, variant, layer_ids=(0, 2))), tmp_path / "zlab")
    path = write_llama_cpp_gguf(zlab_dir, tmp_path / "draft.gguf")
    converted = resolve_model_dir(str(path))
    assert (
        converted.parent.name == "gguf-dflash" and resolve_model_dir(str(path)) == converted
    )  # converted once, then reused
    draft = load_dflash_draft(converted)
    assert draft.draft_format is not None
    assert draft.draft_format["dialect"] == "gguf" and draft.draft_format["source_layer_ids"] == [1, 3]
    assert (
        draft.config.target_layer_ids == [0, 2] and type(draft).__name__ == type(load_dflash_draft(zlab_dir)).__name__
    )
    torch.testing.assert_close(
        first_block_logits(draft, target), first_block_logits(load_dflash_draft(zlab_dir), target), rtol=0, atol=0
    )


def test_mimo_gguf_sinks_and_value_scale_equal_the_safetensors_draft(target, tmp_path, monkeypatch):
    """MiMo drafts: the converter writes attention_sink_bias as blk.N.attn_sinks.weight (filter_tensors adds
    .weight) and dflash_config.attention_value_scale as dflash.attention.value_scale."""
    monkeypatch.setenv("DFLASH_DOCTOR_CACHE", str(tmp_path / "cache"))
    zlab_dir = save_official(official_model(official_config(target, "full")), tmp_path / "zlab")
    config = json.loads((zlab_dir / "config.json").read_text())
    config["dflash_config"].update(attention_sink_bias=True, attention_value_scale=0.7)
    (zlab_dir / "config.json").write_text(json.dumps(config))
    state = load_file(zlab_dir / "model.safetensors")
    state.update({f"layers.{i}.self_attn.attention_sink_bias": torch.randn(4) for i in range(2)})
    save_file(state, zlab_dir / "model.safetensors")
    path = write_llama_cpp_gguf(zlab_dir, tmp_path / "draft.gguf", **{"dflash.attention.value_scale": 0.7})
    draft = load_dflash_draft(resolve_model_dir(str(path)))
    assert draft.config.attention_sink_bias and draft.config.attention_value_scale == pytest.approx(0.7)
    torch.testing.assert_close(
        first_block_logits(draft, target), first_block_logits(load_dflash_draft(zlab_dir), target), rtol=1e-6, atol=1e-6
    )


def test_gguf_scales_and_causality_read_as_dflash_config(target, tmp_path):
    zlab_dir = save_official(official_model(official_config(target, "full")), tmp_path / "zlab")
    path = write_llama_cpp_gguf(
        zlab_dir,
        tmp_path / "draft.gguf",
        **{
            "dflash.logit_scale": 1.1,
            "dflash.final_logit_softcapping": 3.0,
            "dflash.embedding_scale": 0.9,
            "dflash.attention.causal": True,
        },
    )
    config, _ = read_gguf_draft(path)
    assert config["is_causal"] is True
    assert config["dflash_config"]["output_multiplier"] == pytest.approx(1.1)
    assert config["dflash_config"]["final_logit_softcapping"] == pytest.approx(3.0)
    assert config["dflash_config"]["input_embedding_scale"] == pytest.approx(0.9)


def test_gguf_draft_vocabulary_keeps_target_ids(target, tmp_path):
    zlab_dir = save_official(official_model(official_config(target, "full")), tmp_path / "zlab")
    kept = np.array([0, 2, 3, 5, 6, 7, 11, 40, 96], dtype=np.int64)  # absolute target ids, as the converter writes d2t
    head = np.random.default_rng(0).standard_normal((len(kept), target.config.hidden_size)).astype(np.float32)
    path = write_llama_cpp_gguf(zlab_dir, tmp_path / "draft.gguf", extra_tensors={"d2t": kept, "output.weight": head})
    draft = load_dflash_draft(resolve_model_dir(str(path)))
    logits = first_block_logits(draft, target)
    assert set(logits.argmax(-1).tolist()) <= set(kept.tolist())
    assert torch.isinf(logits[:, [1, 4, 8]]).all() and torch.isfinite(logits[:, kept]).all()


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {
                "extra_tensors": {
                    "markov_w1.weight": np.zeros((97, 4), np.float32),
                    "markov_w2.weight": np.zeros((97, 4), np.float32),
                }
            },
            r"DSpark GGUF with dflash.sample_from_anchor = True \(absent: true\)",
        ),
        (
            {"extra_tensors": {"blk.0.attn_post_norm.weight": np.ones(32, np.float32)}},
            "GGUF tensor blk.0.attn_post_norm.weight is not part",
        ),
        ({"dflash.rope.dimension_count": 4}, "dflash.rope.dimension_count asks for partial rotary embeddings"),
        ({"dflash.spec_magic": 1}, "GGUF key dflash.spec_magic is not a DFlash draft key"),
        ({"drop_keys": ("dflash.target_layers",)}, "has no dflash.target_layers"),
    ],
)
def test_gguf_refusals_name_the_key_or_tensor(change, message, target, tmp_path):
    zlab_dir = save_official(official_model(official_config(target, "full")), tmp_path / "zlab")
    path = write_llama_cpp_gguf(zlab_dir, tmp_path / "draft.gguf", **change)
    with pytest.raises(UsageError, match=message):
        read_gguf_draft(path)


def _convert(model_dir: Path, out: Path, target_dir: Path) -> Path:
    """llama.cpp's own convert_hf_to_gguf.py (f32: weights exact) on a draft folder."""
    command = [
        sys.executable,
        str(CONVERTER),
        str(model_dir),
        "--outtype",
        "f32",
        "--outfile",
        str(out),
        "--target-model-dir",
        str(target_dir),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.llamacpp
@pytest.mark.parametrize("variant", ["demo", "dflash2"])
def test_converter_written_gguf_loads_weight_for_weight(variant, demo_target_dir, tmp_path, monkeypatch):
    target_dir = (
        demo_target_dir  # the converter reads the target's tokenizer (converted once per session, in the user cache)
    )
    monkeypatch.setenv("DFLASH_DOCTOR_CACHE", str(tmp_path / "cache"))  # the draft's GGUF converts from scratch
    draft_dir = DEMO_DRAFT_DIR if variant == "demo" else real_variant(DEMO_DRAFT_DIR, variant, tmp_path / variant)
    path = _convert(draft_dir, tmp_path / "draft.gguf", target_dir)
    from_gguf, original = load_dflash_draft(resolve_model_dir(str(path))), load_dflash_draft(draft_dir)
    assert from_gguf.draft_format is not None and from_gguf.draft_format["dialect"] == "gguf"
    assert type(from_gguf) is type(original) and from_gguf.config.target_layer_ids == original.config.target_layer_ids
    for field in (
        "block_size",
        "mask_token_id",
        "head_dim",
        "rope_theta",
        "rms_norm_eps",
        "is_causal",
        "conv_kernel_size",
        "selector_top_k",
    ):
        assert getattr(from_gguf.config, field) == getattr(original.config, field), field
    ours, theirs = original.state_dict(), from_gguf.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert torch.equal(theirs[key], value), key


def test_dspark_gguf_equals_its_safetensors_original(target, tmp_path, monkeypatch):
    """llama.cpp's DSparkModel converter writes markov_w1 / markov_w2 / conf_proj and dflash.sample_from_anchor
    (false for speculators exports, which is the layout read here)."""
    monkeypatch.setenv("DFLASH_DOCTOR_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(5)
    draft = tiny_dflash(target)
    config = DFlashConfig(
        **{**draft.config.__dict__, "architecture": "DSparkDraftModel", "markov_rank": 4, "confidence_head": True}
    )
    dspark = DSparkDraftModel(config)
    with torch.no_grad():
        for param in dspark.parameters():
            param.normal_(0, 0.3)
    original = save_dflash_draft(dspark.eval(), tmp_path / "dspark")
    path = write_llama_cpp_gguf(
        original, tmp_path / "draft.gguf", **{"dflash.sample_from_anchor": False, "dflash.has_confidence_head": True}
    )
    loaded = load_dflash_draft(resolve_model_dir(str(path)))
    assert type(loaded) is DSparkDraftModel and loaded.config.markov_rank == 4 and loaded.config.confidence_head
    torch.testing.assert_close(
        first_block_logits(loaded, target), first_block_logits(load_dflash_draft(original), target), rtol=0, atol=0
    )


def _fields_by_gguf_py(path: Path) -> dict[str, str]:
    fields = gguf.GGUFReader(str(path)).fields
    general = {
        key.removeprefix("general."): field.contents() for key, field in fields.items() if key.startswith("general.")
    }
    return {key: value for key, value in general.items() if isinstance(value, str)}


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_general_fields_read_from_the_header_equal_gguf_pys_reading(tmp_path, endian):
    """The metadata reader that skips the tensors and the tokenizer arrays reads what gguf-py's GGUFReader reads,
    in both byte orders, past arrays of every kind; a damaged or crafted header gives None, at once."""
    from dflash_doctor.models.gguf_draft import gguf_general_fields

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    writer.add_name("Tiny Llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "é", "a" * 300])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    writer.add_float64("some.scale", 0.25)
    writer.add_bool("some.flag", True)
    writer.add_string("general.organization", "Örg")
    writer.add_tensor("token_embd.weight", np.ones((3, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = _fields_by_gguf_py(path)
    assert expected == {"architecture": "llama", "name": "Tiny Llama", "organization": "Örg"}
    assert gguf_general_fields(path) == expected

    demo = Path(demo_target_path())
    assert gguf_general_fields(demo) == _fields_by_gguf_py(demo)

    whole = path.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    for cut in (3, 10, 30, 60, 200):  # all inside the metadata: the 300-character token ends past byte 200
        truncated.write_bytes(whole[:cut])
        assert gguf_general_fields(truncated) is None, cut
    order = "<" if endian == gguf.GGUFEndian.LITTLE else ">"
    crafted = tmp_path / "crafted.gguf"  # 2**60 pairs announced, and a key 2**62 bytes long
    crafted.write_bytes(
        whole[:16] + np.array([2**60], dtype=order + "u8").tobytes() + np.array([2**62], dtype=order + "u8").tobytes()
    )
    assert gguf_general_fields(crafted) is None
    assert gguf_general_fields(tmp_path / "missing.gguf") is None
