"""A new EAGLE-3 head for a target, and the folder it is saved as (the speculators layout vLLM serves with
``"method": "eagle3"``).

Why this shape: the head is one decoder layer of the target's own kind and width (a Llama layer, or a Qwen3
layer for a Qwen3 target), so its ``transformer_layer_config`` is the target's config with one layer, which
vLLM and :mod:`dflash_doctor.models.eagle3_format` both read. The head ships no embedding (vLLM then shares
the target's, and so does the replay), starts its ``norm`` from the target's final norm and its ``lm_head``
from the target's head rows of the draft vocabulary, so that before any training its first-pass output
already scores tokens the way the target's last layer does; ``fc`` and the layer start random.

The draft vocabulary is the ``draft_vocab_size`` most frequent target tokens of the training responses (ties
by id), sorted by id: ``d2t[i] = target_id - i`` and ``t2d`` a bool mask over the target vocabulary, the
tensors vLLM reads (it skips ``t2d``; the speculators library writes it).

Its own module because the checkpoints (:mod:`.checkpoints`) save a head mid-run without the objective.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from dflash_doctor.engine.eagle3_model import LAYER_TYPES, Eagle3DraftModel
from dflash_doctor.errors import UsageError
from dflash_doctor.models.eagle3_format import read_eagle3_config

if TYPE_CHECKING:
    from dflash_doctor.engine.target import CausalLM

DEFAULT_DRAFT_VOCAB_SIZE = (
    32000  # the speculators library's and EAGLE-3's usual size; capped at the target's vocabulary
)
DEFAULT_TTT_STEPS = 7  # chain slots trained (training-time test), also the K written into speculators_config

#: Every norm switch written explicitly, all False (how the head is built and trained): vLLM reads a missing
#: ``norm_before_residual`` of a speculators config as True.
NORM_SWITCH_VALUES = {"norm_before_residual": False, "norm_output": False, "norm_before_fc": False, "fc_norm": False}

# keys of the target's config that describe the whole target, not the head's one layer
_TARGET_ONLY_KEYS = (
    "architectures",
    "auto_map",
    "transformers_version",
    "layer_types",
    "_name_or_path",
    "max_window_layers",
)


def draft_vocabulary(responses: Sequence[Sequence[int]], target_vocab_size: int, size: int) -> tuple[list[int], float]:
    """The ``size`` most frequent target ids of ``responses`` (ties by id), sorted by id, and the share of the
    response tokens they cover (the rest can never be proposed)."""
    counts = torch.zeros(target_vocab_size, dtype=torch.long)
    for tokens in responses:
        if len(tokens):
            counts += torch.bincount(torch.tensor(list(tokens)), minlength=target_vocab_size)
    order = torch.sort(-counts, stable=True).indices  # stable: equal counts keep id order
    chosen = order[:size].sort().values
    total = int(counts.sum())
    return chosen.tolist(), float(counts[chosen].sum()) / total if total else 0.0


def vocabulary_maps(draft_ids: Sequence[int], target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t`` [draft vocab] (target id - draft id) and ``t2d`` [target vocab] bool (in the draft vocabulary)."""
    ids = torch.tensor(list(draft_ids), dtype=torch.long)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(len(ids)), t2d


def speculators_config(
    target_model: CausalLM, *, aux_layer_ids: Sequence[int], draft_vocab_size: int, ttt_steps: int, target_spec: str
) -> dict[str, Any]:
    """config.json of a new head for ``target_model`` in the
    speculators layout (without the ``dflash_doctor`` record)."""
    target_config = target_model.config
    model_type = getattr(target_config, "model_type", None)
    if model_type not in LAYER_TYPES:
        raise UsageError(
            "--draft-kind eagle3 builds the head from a "
            f"{' or '.join(LAYER_TYPES)} layer but target {target_spec} is a "
            f"{model_type!r} model; train a DFlash draft for it (--draft-kind dflash)."
        )
    layer = {key: value for key, value in target_config.to_dict().items() if key not in _TARGET_ONLY_KEYS}
    layer.update(num_hidden_layers=1, model_type=model_type)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": int(draft_vocab_size),
        "target_hidden_size": int(target_config.hidden_size),
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layer_ids],
        **NORM_SWITCH_VALUES,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(ttt_steps)}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": target_spec,
                "architectures": list(getattr(target_config, "architectures", None) or []),
            },
        },
    }


def new_eagle3_head(
    target_model: CausalLM, config: dict[str, Any], draft_ids: Sequence[int], *, seed: int
) -> Eagle3DraftModel:
    """A fresh head shaped by ``config`` (read by the loader itself, so the trained module is the one the saved
    folder loads as): random ``fc`` and layer from ``seed``, ``norm`` from the target's final norm, ``lm_head``
    from the target's head rows ``draft_ids``, ``d2t`` from them; no embedding of its own."""
    target_config = target_model.config
    width = len(config["eagle_aux_hidden_state_layer_ids"]) * int(target_config.hidden_size)
    shape_only = {
        "fc.weight": torch.empty(int(config["transformer_layer_config"]["hidden_size"]), width, device="meta")
    }
    cfg = read_eagle3_config(config, target_config, shape_only, "the new EAGLE-3 head's config")
    torch.manual_seed(seed)
    head = Eagle3DraftModel(cfg, own_embedding=False, own_lm_head=True)
    assert head.lm_head is not None
    final_norm = target_model.model.norm  # pyright: ignore[reportAttributeAccessIssue]  (Llama and Qwen3 decoders)
    target_head = target_model.get_output_embeddings()
    assert isinstance(target_head, torch.nn.Linear)
    d2t, _ = vocabulary_maps(draft_ids, cfg.target_vocab_size)
    with torch.no_grad():
        head.norm.weight.copy_(final_norm.weight.float())
        head.lm_head.weight.copy_(
            target_head.weight[torch.tensor(list(draft_ids), device=target_head.weight.device)].float()
        )
        head.d2t.copy_(d2t)
    return head


def save_eagle3_head(
    head: Eagle3DraftModel, folder: Path, config: dict[str, Any], *, max_shard_bytes: int | str = "5GB"
) -> Path:
    """``config`` as config.json and the head's tensors with ``t2d`` added, under the names vLLM's EAGLE-3 loader
    and :mod:`dflash_doctor.models.eagle3_format` read (``fc.weight``, ``layers.0.*``, ``norm.weight``,
    ``lm_head.weight``, ``d2t``, ``t2d``); sharded like transformers when over ``max_shard_bytes``."""
    from huggingface_hub import save_torch_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in head.state_dict().items()}
    state["t2d"] = vocabulary_maps(head.target_ids().tolist(), head.config.target_vocab_size)[1]
    save_torch_state_dict(state, folder, max_shard_size=max_shard_bytes, metadata={"format": "pt"})
    return folder
