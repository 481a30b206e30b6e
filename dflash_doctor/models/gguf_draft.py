"""llama.cpp DFlash drafts (GGUF, ``general.architecture = dflash``) read into the z-lab layout.

llama.cpp serves DFlash and DFlash 2 drafts from GGUF files written by its ``convert_hf_to_gguf.py``
(``conversion/qwen.py`` ``DFlashModel``; PyPI ``llama-cpp-python`` 0.3.36 sdist, ``vendor/llama.cpp``,
commit 0c1e570). This module inverts that converter: the ``dflash.*`` metadata becomes a z-lab
``config.json`` and the tensors get their Hugging Face names back (the table below is the converter's
``gguf-py/gguf/tensor_mapping.py`` read backwards), so a GGUF draft runs through the same module and
proposer as its safetensors original. What the file holds:

* ``dflash.target_layers`` are ours **plus one** (the converter writes ``i + 1``), like speculators ids.
* ``dflash.logit_scale`` / ``final_logit_softcapping`` / ``embedding_scale`` are ``output_multiplier`` /
  ``final_logit_softcapping`` / ``input_embedding_scale``; ``dflash.attention.causal`` is ``is_causal``;
  ``dflash.attention.sliding_window`` + ``_pattern`` are the window and ``layer_types``.
* MiMo: ``blk.N.attn_sinks`` (per-head sink logits) and ``dflash.attention.value_scale``.
* DFlash 2: ``dflash.conv_kernel_size`` / ``conv_group_size`` / ``selector_rank`` / ``selector_top_k`` and
  the ``blk.N.{attn,ffn}_conv_{base,proj}`` / ``selector_{predecessor,successor,hidden}`` tensors.
* ``d2t`` (a reduced draft vocabulary) holds absolute target ids (the converter adds ``arange``).

* DSpark (``--spec-type draft-dspark``): ``markov_w1`` / ``markov_w2`` (the Markov head) and ``conf_proj``
  (the confidence head), read when ``dflash.sample_from_anchor`` is false (speculators exports).

Refused by name: anchor-first DSpark files, a scaled Markov head (``markov_w2.scale``), post norms, layer scales,
partial RoPE and any ``dflash.*`` key or tensor this table does not know. The conversion runs once per
file (keyed by its SHA-256) into the user cache, as GGUF targets are (:mod:`dflash_doctor.models.loading`).
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_doctor.engine.dflash_model import DFLASH2_ARCHITECTURE, DFLASH_ARCHITECTURE, DSPARK_ARCHITECTURE
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.validation import check_config_keys

#: ``dflash.<key>`` -> the z-lab config key it fills (top level, or ``dflash_config.<key>``).
CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "block_size": "block_size",
    "vocab_size": "vocab_size",
    "attention.causal": "is_causal",
    "logit_scale": "dflash_config.output_multiplier",
    "final_logit_softcapping": "dflash_config.final_logit_softcapping",
    "embedding_scale": "dflash_config.input_embedding_scale",
    "conv_kernel_size": "dflash_config.conv_kernel_size",
    "conv_group_size": "dflash_config.conv_group_size",
    "selector_rank": "dflash_config.selector_rank",
    "selector_top_k": "dflash_config.selector_top_k",
    "sample_from_anchor": "dflash_config.sample_from_anchor",
    "attention.value_scale": "dflash_config.attention_value_scale",
}
#: ``dflash.<key>`` read by a rule of its own below.
SPECIAL_KEYS = frozenset(
    {
        "target_layers",
        "attention.value_length",
        "attention.sliding_window",
        "attention.sliding_window_pattern",
        "has_confidence_head",
        "hidden_act",
    }
)
#: Keys llama.cpp reads that change the draft in ways the z-lab module has no counterpart for.
REFUSED_KEYS = {
    "attention.scale": "a non-standard attention scale",
    "rope.dimension_count": "partial rotary embeddings",
    "rope.dimension_sections": "M-RoPE sections",
    "hyper_connection_count": "the DeepSeek-V4 DSpark backbone",
}

#: GGUF tensor name (``{bid}`` = layer) -> Hugging Face name, from llama.cpp's tensor_mapping.py.
TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "enc.output_norm.weight": "hidden_norm.weight",
    "output_norm.weight": "norm.weight",
    "token_embd.weight": "embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "blk.{bid}.attn_norm.weight": "layers.{bid}.input_layernorm.weight",
    "blk.{bid}.attn_q.weight": "layers.{bid}.self_attn.q_proj.weight",
    "blk.{bid}.attn_k.weight": "layers.{bid}.self_attn.k_proj.weight",
    "blk.{bid}.attn_v.weight": "layers.{bid}.self_attn.v_proj.weight",
    "blk.{bid}.attn_output.weight": "layers.{bid}.self_attn.o_proj.weight",
    "blk.{bid}.attn_q.bias": "layers.{bid}.self_attn.q_proj.bias",
    "blk.{bid}.attn_k.bias": "layers.{bid}.self_attn.k_proj.bias",
    "blk.{bid}.attn_v.bias": "layers.{bid}.self_attn.v_proj.bias",
    "blk.{bid}.attn_output.bias": "layers.{bid}.self_attn.o_proj.bias",
    "blk.{bid}.attn_q_norm.weight": "layers.{bid}.self_attn.q_norm.weight",
    "blk.{bid}.attn_k_norm.weight": "layers.{bid}.self_attn.k_norm.weight",
    "blk.{bid}.attn_sinks.weight": "layers.{bid}.self_attn.attention_sink_bias",
    "blk.{bid}.ffn_norm.weight": "layers.{bid}.post_attention_layernorm.weight",
    "blk.{bid}.ffn_gate.weight": "layers.{bid}.mlp.gate_proj.weight",
    "blk.{bid}.ffn_up.weight": "layers.{bid}.mlp.up_proj.weight",
    "blk.{bid}.ffn_down.weight": "layers.{bid}.mlp.down_proj.weight",
    "blk.{bid}.attn_conv_base": "layers.{bid}.attention_conv.base_kernel",
    "blk.{bid}.attn_conv_proj.weight": "layers.{bid}.attention_conv.kernel_projection.weight",
    "blk.{bid}.ffn_conv_base": "layers.{bid}.mlp_conv.base_kernel",
    "blk.{bid}.ffn_conv_proj.weight": "layers.{bid}.mlp_conv.kernel_projection.weight",
    "selector_predecessor.weight": "candidate_selector.predecessor_codebook.weight",
    "selector_successor.weight": "candidate_selector.successor_codebook.weight",
    "selector_hidden.weight": "candidate_selector.hidden_projection.weight",
    "markov_w1.weight": "markov_head.markov_w1.weight",
    "markov_w2.weight": "markov_head.markov_w2.weight",
    "conf_proj.weight": "confidence_head.proj.weight",
    "conf_proj.bias": "confidence_head.proj.bias",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.")


# GGUF metadata value types (gguf-py's GGUFValueType) -> struct format of one value; 8 is a string, 9 an array
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_general_fields(path: Path) -> dict[str, str] | None:
    """The text fields under ``general.`` of a GGUF file, without the prefix (``architecture``, ``name``,
    ``basename``, ``size_label``, ``organization``...); None when the file cannot be read here.

    Read straight from the metadata section (magic, version, counts, then key/value pairs) instead of through
    gguf-py's GGUFReader, which maps every field and tensor of the file: 3 s for the demo target's tokenizer
    arrays on every command that names a GGUF target, twice (the loader and the target-identity check), for a
    few strings. Every length is checked against the file's size, so a damaged or crafted header ends in None.
    """
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                return None
            order = (
                "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"
            )  # a big-endian file's version reads swapped
            if struct.unpack_from(order + "I", data, 4)[0] < 2:
                return None  # version 1 had 32-bit counts; no current tool writes it
            (kv_count,) = struct.unpack_from(order + "Q", data, 16)
            offset = 24
            size = len(data)

            def take(count: int) -> int:
                nonlocal offset
                if count < 0 or offset + count > size:
                    raise ValueError("past the end of the file")
                offset += count
                return offset - count

            def string() -> bytes:
                (length,) = struct.unpack_from(order + "Q", data, take(8))
                start = take(length)
                return data[start : start + length]

            fields: dict[str, str] = {}
            for _ in range(kv_count):
                key = string().decode("utf-8", "replace")
                (kind,) = struct.unpack_from(order + "I", data, take(4))
                if kind == _STRING:
                    value = string()
                    if key.startswith("general."):
                        fields[key.removeprefix("general.")] = value.decode("utf-8", "replace")
                elif kind == _ARRAY:
                    item, length = struct.unpack_from(order + "IQ", data, take(12))
                    if item == _STRING:
                        for _ in range(length):
                            string()
                    elif item in _SCALAR_FORMATS:
                        take(length * struct.calcsize(_SCALAR_FORMATS[item]))
                    else:
                        return None  # nested arrays: no GGUF writer emits them
                elif kind in _SCALAR_FORMATS:
                    take(struct.calcsize(_SCALAR_FORMATS[kind]))
                else:
                    return None
            return fields
    except (ValueError, OSError, struct.error):
        return None


def gguf_architecture(path: Path) -> str | None:
    """``general.architecture`` of a GGUF file (None when absent or unreadable: the model converter then
    refuses the file with its own sentence)."""
    return (gguf_general_fields(path) or {}).get("architecture")


def _fields(reader) -> dict[str, Any]:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith(("tokenizer.ggml.", "GGUF.")) and name not in (
            "tokenizer.ggml.mask_token_id",
            "tokenizer.ggml.tokens",
        ):
            continue  # the tokenizer is the target's; only the mask id and the vocabulary size matter here
        out[name] = len(field.data) if name == "tokenizer.ggml.tokens" else field.contents()
    return out


def _config(fields: dict[str, Any], names: list[str], source: str) -> tuple[dict[str, Any], list[int]]:
    """The z-lab config.json of the draft and the file's layer ids (ours + 1)."""
    arch_keys = {k.removeprefix("dflash."): v for k, v in fields.items() if k.startswith("dflash.")}
    for key, meaning in REFUSED_KEYS.items():
        if key in arch_keys:
            raise UsageError(
                f"{source}: dflash.{key} asks for {meaning}, which this tool does not model; use a draft without it."
            )
    unknown = sorted(
        k for k in arch_keys if k not in CONFIG_KEYS and k not in SPECIAL_KEYS and not k.startswith("rope.scaling.")
    )
    if unknown:
        raise UsageError(
            f"{source}: GGUF key dflash.{unknown[0]} is not a DFlash "
            "draft key this tool understands; report the format "
            "(docs/draft-formats.md lists what is read)."
        )
    scaling = {k: v for k, v in arch_keys.items() if k.startswith("rope.scaling.")}
    if scaling.get("rope.scaling.type", "none") != "none":
        raise UsageError(
            f"{source}: dflash.rope.scaling.type = {scaling['rope.scaling.type']!r} "
            "is not read by this tool; use a draft without RoPE scaling."
        )
    if arch_keys.get("hidden_act", "silu") != "silu":
        raise UsageError(
            f"{source}: dflash.hidden_act {arch_keys['hidden_act']!r} is not silu, the DFlash MLP; use a DFlash draft."
        )
    if "target_layers" not in arch_keys:
        raise UsageError(
            f"{source} has no dflash.target_layers (llama.cpp refuses it too); convert the draft from a config "
            "that states dflash_config.target_layer_ids."
        )
    if "tokenizer.ggml.mask_token_id" not in fields:
        raise UsageError(
            f"{source} has no tokenizer.ggml.mask_token_id; convert the "
            "draft from a config that states dflash_config.mask_token_id."
        )
    layers = arch_keys["target_layers"]
    if not (
        isinstance(layers, list)
        and layers
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in layers)
    ):
        raise UsageError(
            f"{source}: dflash.target_layers is {layers!r}, not a list of integer layer ids >= 1 (the converter writes "
            "ours + 1); convert the draft again from its config.json."
        )
    mask = fields["tokenizer.ggml.mask_token_id"]
    if not (isinstance(mask, int) and not isinstance(mask, bool) and mask >= 0):
        raise UsageError(
            f"{source}: tokenizer.ggml.mask_token_id is {mask!r}, not an integer token id >= 0; convert the draft "
            "again from its config.json."
        )
    pattern = arch_keys.get("attention.sliding_window_pattern")
    if pattern is not None and not (isinstance(pattern, list) and all(isinstance(swa, bool) for swa in pattern)):
        raise UsageError(
            f"{source}: dflash.attention.sliding_window_pattern is {pattern!r}, not a list of true/false per layer; "
            "convert the draft again from its config.json."
        )
    if arch_keys.get("attention.sliding_window") and not (pattern or "block_count" in arch_keys):
        raise UsageError(
            f"{source}: dflash.attention.sliding_window is set but neither dflash.block_count nor "
            "dflash.attention.sliding_window_pattern says which layers "
            "use it; convert the draft again from its config.json."
        )
    has_selector, has_markov = "selector_hidden.weight" in names, "markov_w1.weight" in names
    if has_markov and arch_keys.get("sample_from_anchor", True):  # llama.cpp's default when the key is absent
        raise UsageError(
            f"{source}: a DSpark GGUF with dflash.sample_from_anchor = "
            f"{arch_keys.get('sample_from_anchor', True)} (absent: true) "
            "predicts position p + k + 1 from slot k, the anchor-first "
            "layout this tool does not model; use one converted "
            "from a speculators export (sample_from_anchor false)."
        )
    architecture = DFLASH2_ARCHITECTURE if has_selector else DSPARK_ARCHITECTURE if has_markov else DFLASH_ARCHITECTURE
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "rope_scaling": None,
        "dflash_config": {},
    }
    for key, value in arch_keys.items():
        name = CONFIG_KEYS.get(key)
        if name is None:
            continue
        if name.startswith("dflash_config."):
            config["dflash_config"][name.removeprefix("dflash_config.")] = value
        else:
            config[name] = value
    check_config_keys(config, f"{source} (its dflash.* metadata read as config.json)")
    value_length = arch_keys.get("attention.value_length", config.get("head_dim"))
    if value_length != config.get("head_dim"):
        raise UsageError(
            f"{source}: dflash.attention.value_length {value_length} differs from key_length {config.get('head_dim')}; "
            "a DFlash draft has one head size."
        )
    config.setdefault("vocab_size", fields.get("tokenizer.ggml.tokens"))
    config.setdefault("block_size", 16)  # llama.cpp's default when dflash.block_size is absent (common/speculative.cpp)
    window = arch_keys.get("attention.sliding_window")
    if window:
        pattern = pattern or [True] * config["num_hidden_layers"]
        config.update(
            use_sliding_window=True,
            sliding_window=window,
            layer_types=["sliding_attention" if swa else "full_attention" for swa in pattern],
        )
    if has_markov:  # llama.cpp's confidence head always reads [hidden; markov_w1[prev]]
        config["dflash_config"]["confidence_head"] = "conf_proj.weight" in names
    if any(name.endswith(".attn_sinks.weight") for name in names):  # MiMo's per-head sinks (vLLM: attention_sink_bias)
        config["dflash_config"]["attention_sink_bias"] = True
    source_ids = list(layers)
    config["dflash_config"].update(mask_token_id=mask, target_layer_ids=[i - 1 for i in source_ids])
    return config, source_ids


def _tensor(tensor) -> torch.Tensor:
    """A GGUF tensor as float32 (dequantised) or int64, in Hugging Face (numpy) dimension order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if tensor.tensor_type in (GGMLQuantizationType.I64, GGMLQuantizationType.I32):
        return torch.from_numpy(np.array(tensor.data, dtype=np.int64).reshape(shape))
    return torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape))


def _hf_name(name: str, source: str) -> str:
    match = _BLOCK.match(name)
    pattern = name if match is None else name.replace(match.group(0), "blk.{bid}.", 1)
    hf = TENSOR_NAMES.get(pattern)
    if hf is None:
        raise UsageError(
            f"{source}: GGUF tensor {name} is not part of a DFlash draft this tool reads (post norms, "
            "layer output scales and RoPE frequency tables are not modelled); use a DFlash draft without it."
        )
    return hf if match is None else hf.replace("{bid}", match.group(1))


def read_gguf_draft(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(z-lab config.json, safetensors state) of a llama.cpp DFlash GGUF draft; refuses what it cannot map."""
    from gguf import GGUFReader

    source = str(path)
    try:
        reader = GGUFReader(source)
    # a lying count or offset fails anywhere in the parser; all mean a damaged file
    except Exception as exc:  # noqa: BLE001
        raise UsageError(
            f"{source} could not be read as a GGUF file ({type(exc).__name__}: {str(exc)[:120]}); "
            "download or convert the draft again."
        ) from None
    names = [t.name for t in reader.tensors]
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == "d2t":
            continue
        state[_hf_name(tensor.name, source)] = _tensor(tensor)
    config, source_ids = _config(_fields(reader), names, source)
    if "markov_head.markov_w1.weight" in state:
        config["dflash_config"]["markov_rank"] = int(state["markov_head.markov_w1.weight"].shape[1])
    if "d2t" in names:
        absolute = _tensor(next(t for t in reader.tensors if t.name == "d2t")).reshape(-1)
        state["d2t"] = absolute - torch.arange(absolute.numel())  # speculators' relative form: target = draft id + d2t
        config["draft_vocab_size"] = int(absolute.numel())
    config["dflash_doctor"] = {
        "source_format": {"dialect": "gguf", "layer_id_offset": 1, "source_layer_ids": source_ids, "file": source}
    }
    return config, state


def write_converted(path: Path, out_dir: Path) -> Path:
    """``out_dir`` holding config.json + model.safetensors of the GGUF draft at ``path``."""
    from safetensors.torch import save_file

    config, state = read_gguf_draft(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file({k: v.contiguous() for k, v in state.items()}, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir
