"""Where a target checkpoint keeps its own multi-token-prediction (MTP) head, and how it is read.

transformers drops these weights when it loads the target (they are not part of its causal LM), so they
are read straight from the target's safetensors. Two layouts are published:

* **DeepSeek-V3 / R1, GLM-4.5 and later** (``num_nextn_predict_layers`` in config.json): MTP layer ``i``
  lives at ``model.layers.{num_hidden_layers + i}``: ``enorm`` (the token embedding's norm), ``hnorm``
  (the hidden state's norm), ``eh_proj`` [H, 2H], ``shared_head.norm``, optionally ``shared_head.head``
  and ``embed_tokens`` (absent: the target's are used), and one whole decoder block of the target's
  architecture under the same prefix. The engines zero the embedding at position 0.
* **Qwen3-Next / Qwen3.5** (``mtp_num_hidden_layers``): ``mtp.pre_fc_norm_embedding``,
  ``mtp.pre_fc_norm_hidden``, ``mtp.fc`` [H, 2H] and ``mtp.norm`` shared by the MTP layers, and
  ``mtp.layers.{i}.*`` a full-attention decoder block each; the embedding and the head are the target's.

Both are read into one naming (:data:`PARTS`), so the head module (:mod:`dflash_doctor.engine.mtp_model`)
knows a single layout: per layer ``embedding_norm``, ``hidden_norm``, ``proj``, ``block.*``,
``output_norm`` and the optional ``head`` / ``embed_tokens``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_doctor.engine.mtp_model import MtpCheckpoint
from dflash_doctor.errors import UsageError

DEEPSEEK = "deepseek-v3"
QWEN3_NEXT = "qwen3-next"
LAYOUT_NAMES = {
    DEEPSEEK: "DeepSeek-V3/GLM (num_nextn_predict_layers, model.layers.{num_hidden_layers + i}.*)",
    QWEN3_NEXT: "Qwen3-Next/Qwen3.5 (mtp_num_hidden_layers, mtp.*)",
}

#: checkpoint name of each non-block part, per layout -> the head module's name
PARTS = {
    DEEPSEEK: {
        "enorm": "embedding_norm",
        "hnorm": "hidden_norm",
        "eh_proj": "proj",
        "shared_head.norm": "output_norm",
        "shared_head.head": "head",
        "embed_tokens": "embed_tokens",
    },
    QWEN3_NEXT: {
        "pre_fc_norm_embedding": "embedding_norm",
        "pre_fc_norm_hidden": "hidden_norm",
        "fc": "proj",
        "norm": "output_norm",
    },
}


def _text_config(config_json: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint (Qwen3.5) nests the language model's fields under ``text_config``."""
    return {**config_json, **(config_json.get("text_config") or {})}


def _tensor_names(target_dir: Path) -> dict[str, Path]:
    """Every tensor name in the target's safetensors -> its file (headers only; nothing is loaded)."""
    from safetensors import safe_open

    names: dict[str, Path] = {}
    for file in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), file))
    return names


def _read(names: dict[str, Path], wanted: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in dict.fromkeys(names[name] for name in wanted):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in wanted if names[name] == file})
    return tensors


def _renamed(tensors: dict[str, torch.Tensor], prefix: str, parts: dict[str, str]) -> dict[str, torch.Tensor]:
    """The tensors under ``prefix`` with the layout's part names mapped to the head's, the rest under ``block.``."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix) :]
        part = next((p for p in parts if rest.startswith(p + ".")), None)
        out[parts[part] + rest[len(part) :] if part is not None else "block." + rest] = tensor
    return out


def read_mtp_checkpoint(target_dir: Path, config_json: dict[str, Any], target_name: str) -> MtpCheckpoint:
    """The MTP head of the target in ``target_dir``; a target without one (or whose config names one its
    weights lack) is a :class:`UsageError` naming the target and the layouts read."""
    config = _text_config(config_json)
    first = int(config.get("num_hidden_layers", 0))
    layouts = " and ".join(LAYOUT_NAMES.values())
    nextn = config.get("num_nextn_predict_layers", config.get("num_mtp_layers"))  # transformers saves the second name
    if nextn:
        layout, count = DEEPSEEK, int(nextn)
        prefixes = [f"model.layers.{first + i}." for i in range(count)]
    elif config.get("mtp_num_hidden_layers"):
        layout, count = QWEN3_NEXT, int(config["mtp_num_hidden_layers"])
        prefixes = [f"mtp.layers.{i}." for i in range(count)]
    else:
        raise UsageError(
            f"the target {target_name} has no MTP head (its config.json names neither num_nextn_predict_layers "
            f"nor mtp_num_hidden_layers; read: {layouts}); pass a target that ships one, or another --draft."
        )
    names = _tensor_names(target_dir)
    missing = next((p for p in prefixes if not any(n.startswith(p) for n in names)), None)
    if layout == QWEN3_NEXT and missing is None and "mtp.fc.weight" not in names:
        missing = "mtp.fc"
    if missing is not None:
        raise UsageError(
            f"the target {target_name} names {count} MTP layer(s) in config.json but its safetensors hold no "
            f"{missing.rstrip('.')}.* tensors (a conversion may have dropped them); pass the original checkpoint."
        )
    if layout == DEEPSEEK:
        tensors = _read(names, [n for n in names if any(n.startswith(p) for p in prefixes)])
        layers = [_renamed(tensors, prefix, PARTS[DEEPSEEK]) for prefix in prefixes]
    else:
        tensors = _read(names, [n for n in names if n.startswith("mtp.")])
        shared = {
            PARTS[QWEN3_NEXT][part] + name[len(f"mtp.{part}") :]: tensor
            for name, tensor in tensors.items()
            for part in PARTS[QWEN3_NEXT]
            if name.startswith(f"mtp.{part}.")
        }
        layers = [
            {**shared, **{"block." + name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}}
            for prefix in prefixes
        ]
    return MtpCheckpoint(layout=layout, layers=layers, first_layer_index=first, zero_first_embedding=layout == DEEPSEEK)
