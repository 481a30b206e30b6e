"""EAGLE-3 checkpoints: recognise both layouts, read them into
:class:`Eagle3DraftModel`, validate them against the target.

Two layouts exist (the eagle3 section of docs/speculators.md):

* **speculators** (``speculators_model_type: "eagle3"``, ``architectures: ["Eagle3Speculator"]``): the
  decoder layer's settings under ``transformer_layer_config`` (its ``model_type`` picks a Llama or a Qwen3
  layer), the head's own keys at the top (``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids``, the norm switches) and the default K and the target under
  ``speculators_config``.
* **original** (SafeAILab EAGLE-3): a Llama config with ``num_hidden_layers: 1`` and ``draft_vocab_size``,
  the layer's weights under ``midlayer.*``, which engines read as ``layers.0.*``.

Everything engines decide for a checkpoint that does not say is decided here as vLLM decides it, and
recorded with where it came from (:func:`head_facts`): which target layers the head reads
(:func:`aux_layer_ids`) and where it normalises (:func:`norm_switches`). A pair that cannot work is refused
with one sentence naming the input and the fix (:class:`UsageError`, exit 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_doctor.engine.eagle3_model import LAYER_TYPES, Eagle3Config, Eagle3DraftModel, NormSwitches
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.validation import read_config_json
from dflash_doctor.models.loading import torch_dtype

SPECULATORS = "speculators"
ORIGINAL = "original EAGLE-3"

#: Where the aux layer ids came from when the checkpoint names none (vLLM warns and picks them; SGLang and
#: the original EAGLE code pick the same three layers).
VLLM_DEFAULT = "vLLM default"

NORM_SWITCHES = ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm")

#: The value each trainer builds the head with when its config leaves a switch out: the speculators library
#: defaults all four to False, and the original EAGLE-3 code has none of them (its layer is the False case).
TRAINED_DEFAULTS = dict.fromkeys(NORM_SWITCHES, False)


def checkpoint_layout(config: dict[str, Any]) -> str | None:
    """:data:`SPECULATORS`, :data:`ORIGINAL`, or None for a config of another kind."""
    if config.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in (config.get("architectures") or []):
        return SPECULATORS
    if config.get("speculators_model_type") is not None or "dflash_config" in config:
        return None
    named = any("eagle3" in str(name).lower() for name in config.get("architectures") or [])
    shaped = "draft_vocab_size" in config and config.get("num_hidden_layers") == 1
    return ORIGINAL if named or shaped else None


def is_eagle3_config(config: dict[str, Any]) -> bool:
    return checkpoint_layout(config) is not None


def layer_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder layer's settings: ``transformer_layer_config`` (speculators) or the config itself (original)."""
    nested = config.get("transformer_layer_config")
    return nested if isinstance(nested, dict) else config


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """vLLM's choice for a head that names no layers (``(2, L // 2, L - 3)``), the same as SGLang's and the
    original EAGLE-3 code's: Llama-3.1-8B (32 layers) -> [2, 16, 29], Qwen3-8B (36) -> [2, 18, 33]."""
    return [2, num_target_layers // 2, num_target_layers - 3]


def aux_layer_ids(config: dict[str, Any], num_target_layers: int) -> tuple[list[int], str]:
    """The target layers the head reads, in vLLM's meaning (id k = the state entering target layer k, HF
    ``hidden_states[k]``), looked up where vLLM looks, and the config key they came from.

    ``eagle_aux_hidden_state_layer_ids``, else a DFlash-style ``dflash_config.target_layer_ids`` plus one
    (a DFlash id j reads the output of layer j, which is the state entering layer j + 1), else
    ``eagle_config.layer_ids``, else :func:`default_aux_layer_ids`. An empty list counts as absent, as in vLLM.
    The ids are taken as written (``read_config_json`` checked their types; :func:`read_eagle3_config` refuses an
    id that is not a layer of the target), never rounded: 8.5 read as 8 would draft from the wrong layer.
    """
    named = config.get("eagle_aux_hidden_state_layer_ids")
    if named:
        return list(named), "eagle_aux_hidden_state_layer_ids"
    dflash = (config.get("dflash_config") or {}).get("target_layer_ids")
    if dflash:
        return [i + 1 for i in dflash], "dflash_config.target_layer_ids + 1"
    eagle = (config.get("eagle_config") or {}).get("layer_ids")
    if eagle:
        return list(eagle), "eagle_config.layer_ids"
    return default_aux_layer_ids(num_target_layers), VLLM_DEFAULT


@dataclass(frozen=True)
class NormSwitch:
    """One norm switch: the checkpoint's value (None: not written), what vLLM runs, what the head was most
    likely trained with, and the value the replay uses (vLLM's)."""

    name: str
    checkpoint: bool | None
    vllm: bool
    trained: bool

    @property
    def replay(self) -> bool:
        return self.vllm

    @property
    def why(self) -> str:
        if self.checkpoint is not None:
            return "written in the checkpoint"
        if self.vllm == self.trained:
            return "not written; vLLM and the trainer agree on the default"
        return (
            f"not written; vLLM reads a missing {self.name} as {self.vllm} while the head was trained with "
            f"{self.trained}: the replay follows vLLM"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "vllm": self.vllm,
            "trained_default": self.trained,
            "replay": self.replay,
            "why": self.why,
        }


def norm_switches(config: dict[str, Any]) -> dict[str, NormSwitch]:
    """Each switch as the checkpoint writes it and as vLLM reads it: vLLM turns a speculators config's missing
    ``norm_before_residual`` into True (the library trains with False); an original-layout config is read
    as a Llama config, where every missing switch is False."""
    layout = checkpoint_layout(config)
    switches = {}
    for name in NORM_SWITCHES:
        written = config.get(name)
        checkpoint = None if written is None else bool(written)
        vllm_default = name == "norm_before_residual" and layout == SPECULATORS
        switches[name] = NormSwitch(
            name, checkpoint, vllm_default if checkpoint is None else checkpoint, TRAINED_DEFAULTS[name]
        )
    return switches


def default_k(config: dict[str, Any]) -> int | None:
    """``speculators_config.proposal_methods[0].speculative_tokens``: the K the head was trained and published for."""
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or []
    tokens = methods[0].get("speculative_tokens") if methods and isinstance(methods[0], dict) else None
    return None if tokens is None else int(tokens)


def verifier_name(config: dict[str, Any]) -> str | None:
    """``speculators_config.verifier.name_or_path``: the target the head was trained against."""
    return ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


# ----------------------------------------------------------------------------- loading


def _read_tensors(draft_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, named as the module names them (no ``model.`` prefix, ``midlayer.`` read
    as ``layers.0.``). safetensors first; a PyTorch ``.bin`` (the original releases) is read with
    ``weights_only=True``, which unpickles tensors and nothing else."""
    from safetensors.torch import load_file

    files = sorted(draft_dir.glob("*.safetensors"))
    raw: dict[str, torch.Tensor] = {}
    if files:
        for file in files:
            raw.update(load_file(file))
    else:
        bins = sorted(draft_dir.glob("*.bin"))
        if not bins:
            raise UsageError(
                f"{draft_dir} has no .safetensors or .bin weights; an "
                "EAGLE-3 head needs its weights next to config.json."
            )
        for file in bins:
            raw.update(torch.load(file, map_location="cpu", weights_only=True))
    state = {}
    for name, tensor in raw.items():
        name = name.removeprefix("model.")
        state["layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name] = tensor
    return state


def proposable_target_ids(draft_dir: Path) -> torch.Tensor | None:
    """The target ids a head's ``d2t`` maps its draft vocabulary to (the only tokens it can ever propose),
    read from the checkpoint without building the head; None for a head without ``d2t`` (it drafts over the
    whole target vocabulary) or without readable weights."""
    from safetensors import safe_open

    d2t = None
    for file in sorted(draft_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            name = next((n for n in handle.keys() if n.removeprefix("model.") == "d2t"), None)
            if name is not None:
                d2t = handle.get_tensor(name)
    if d2t is None and not any(draft_dir.glob("*.safetensors")):
        for file in sorted(draft_dir.glob("*.bin")):
            d2t = torch.load(file, map_location="cpu", weights_only=True).get("d2t", d2t)
    if d2t is None:
        return None
    offsets = _offsets(d2t, str(draft_dir))
    return torch.arange(len(offsets)) + offsets


def _layer_settings(config: dict[str, Any], where: str):
    """The layer config as transformers' own config class, which fills the defaults of its model type (Qwen3's
    head_dim 128, Llama's hidden // heads) and reads every RoPE spelling into ``rope_parameters``."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    settings = dict(layer_config(config))
    model_type = settings.pop("model_type", "llama")
    if model_type not in LAYER_TYPES:
        raise UsageError(
            f"{where}: the head's decoder layer is a {model_type!r} layer; the replay builds "
            f"{' and '.join(LAYER_TYPES)} layers, so convert the head or replay it with an engine."
        )
    layers = settings.get("num_hidden_layers", 1)
    if layers != 1:
        raise UsageError(
            f"{where}: the head has {layers} decoder layers; the replay models EAGLE-3 heads of one layer, "
            "so replay this head with an engine (check --engine)."
        )
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if key not in settings:
            raise UsageError(
                f"{where} lacks {key} for the head's decoder layer; restore the config the head was saved with."
            )
    for key in ("architectures", "auto_map", "transformers_version"):
        settings.pop(key, None)
    try:
        return AutoConfig.for_model(model_type, **settings), model_type
    except StrictDataclassError as exc:  # transformers' own validators (e.g. heads that do not divide the hidden size)
        reason = str(exc).strip().splitlines()[-1].strip().removeprefix("ValueError: ").rstrip(".")
        raise UsageError(
            f"{where}: transformers refuses the head's decoder layer settings ({reason}); "
            "restore the config the head was saved with."
        ) from None


def _rope(settings) -> tuple[float, torch.Tensor | None, float]:
    """(rope_theta, the inverse frequencies of a scaled RoPE or None for plain RoPE, its attention factor)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = dict(getattr(settings, "rope_parameters", None) or {})
    theta = float(parameters.get("rope_theta", getattr(settings, "rope_theta", 10000.0)))
    kind = parameters.get("rope_type", "default")
    if kind == "default":
        return theta, None, 1.0
    if kind in ("dynamic", "longrope") or kind not in ROPE_INIT_FUNCTIONS:
        raise UsageError(
            f"the head's RoPE type {kind!r} is not replayed (it changes with the sequence length or is unknown); "
            "replay this head with an engine (check --engine)."
        )
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](settings, None)
    return theta, inv_freq.float(), float(factor)


def read_eagle3_config(
    config: dict[str, Any], target_config: Any, state: dict[str, torch.Tensor], where: str
) -> Eagle3Config:
    """The head's shape from its config (and its weights where the config is silent), checked against the target."""
    settings, model_type = _layer_settings(config, where)
    num_target_layers = int(target_config.num_hidden_layers)
    target_hidden, target_vocab = int(target_config.hidden_size), int(target_config.vocab_size)
    ids, source = aux_layer_ids(config, num_target_layers)
    switches = norm_switches(config)
    norms = NormSwitches(**{name: switch.replay for name, switch in switches.items()})
    if norms.norm_before_fc and norms.fc_norm:
        raise UsageError(
            f"{where} sets both norm_before_fc and fc_norm, which "
            "exclude each other; keep the one the head was trained with."
        )
    hidden = int(settings.hidden_size)
    stated_target_hidden = config.get("target_hidden_size")
    if stated_target_hidden is not None and int(stated_target_hidden) != target_hidden:
        raise UsageError(
            f"{where}: target_hidden_size is {stated_target_hidden} but the target's hidden size is {target_hidden}; "
            "serve the head with the target it was trained for."
        )
    layer_vocab = getattr(settings, "vocab_size", None)
    if layer_vocab is not None and int(layer_vocab) != target_vocab:
        raise UsageError(
            f"{where}: the head was built for a {layer_vocab}-token "
            f"vocabulary but the target has {target_vocab} tokens; "
            "serve the head with the target (and tokenizer) it was trained for."
        )
    draft_vocab = config.get("draft_vocab_size") or target_vocab  # vLLM: absent means the target's vocabulary
    bad = [i for i in ids if not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_target_layers)]
    if bad:
        raise UsageError(
            f"{where}: aux layer id {json.dumps(bad[0])} (from {source}) "
            f"is outside the target's {num_target_layers} layers "
            f"(id k reads the state entering layer k, so 0..{num_target_layers - 1}); fix the ids in config.json."
        )
    fc = state.get("fc.weight")
    if fc is None:
        raise UsageError(
            f"{where}: the weights have no fc.weight; an EAGLE-3 head "
            "combines the target's states with it, so restore the weights."
        )
    width = int(fc.shape[1])
    if width % target_hidden:
        raise UsageError(
            f"{where}: fc.weight takes {width} inputs, not a whole number of the target's {target_hidden}-wide states; "
            "serve the head with the target it was trained for."
        )
    if width != len(ids) * target_hidden:
        fix = (
            "write eagle_aux_hidden_state_layer_ids with the "
            f"{width // target_hidden} layer ids it was trained on into config.json"
            if source == VLLM_DEFAULT
            else f"make {source} name {width // target_hidden} layers"
        )
        raise UsageError(
            f"{where}: fc.weight combines {width // target_hidden} "
            f"target states but {source} gives {len(ids)} layer ids "
            f"{ids}; {fix}."
        )
    if "embed_tokens.weight" not in state and hidden != target_hidden:
        raise UsageError(
            f"{where}: the head ships no embed_tokens and its hidden size {hidden} differs from the target's "
            f"{target_hidden}, so it cannot share the target's embedding; serve it with the target it was trained for."
        )
    theta, inv_freq, attention_factor = _rope(settings)
    return Eagle3Config(
        layer_type=model_type,
        hidden_size=hidden,
        num_attention_heads=int(settings.num_attention_heads),
        num_key_value_heads=int(getattr(settings, "num_key_value_heads", None) or settings.num_attention_heads),
        head_dim=int(getattr(settings, "head_dim", None) or hidden // int(settings.num_attention_heads)),
        intermediate_size=int(settings.intermediate_size),
        rms_norm_eps=float(settings.rms_norm_eps),
        target_hidden_size=target_hidden,
        target_vocab_size=target_vocab,
        draft_vocab_size=int(draft_vocab),
        aux_layer_ids=ids,
        norms=norms,
        attention_bias=bool(getattr(settings, "attention_bias", False)),
        rope_theta=theta,
        rope_inverse_frequencies=inv_freq,
        rope_attention_factor=attention_factor,
    )


def _offsets(d2t: torch.Tensor, where: str) -> torch.Tensor:
    """``d2t`` as it must be saved, one integer offset per draft id, as int64; a float or a 2-D table is refused,
    never truncated or flattened (either means the file is not the head's map)."""
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype.is_complex or d2t.dtype == torch.bool:
        raise UsageError(
            f"{where}: d2t is a {d2t.dim()}-D {str(d2t.dtype).removeprefix('torch.')} tensor of shape "
            f"{list(d2t.shape)}, not the 1-D integer offsets of a "
            "draft vocabulary; restore the d2t saved with this head."
        )
    return d2t.long()


def _vocabulary_map(state: dict[str, torch.Tensor], cfg: Eagle3Config, where: str) -> torch.Tensor:
    """``d2t`` checked: one offset per draft id, every mapped id inside the target vocabulary, no target id twice.
    A head without ``d2t`` predicts over the whole target vocabulary (zero offsets)."""
    d2t = state.get("d2t")
    if d2t is None:
        if cfg.draft_vocab_size != cfg.target_vocab_size:
            raise UsageError(
                f"{where}: draft_vocab_size is {cfg.draft_vocab_size} "
                "but the weights have no d2t to map draft ids to the "
                f"target's {cfg.target_vocab_size} tokens; restore d2t from the head's release."
            )
        return torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    d2t = _offsets(d2t, where)
    if len(d2t) != cfg.draft_vocab_size:
        raise UsageError(
            f"{where}: d2t has {len(d2t)} entries but draft_vocab_size is {cfg.draft_vocab_size}; "
            "restore the d2t saved with this head or fix draft_vocab_size."
        )
    mapped = torch.arange(len(d2t)) + d2t
    outside = ((mapped < 0) | (mapped >= cfg.target_vocab_size)).nonzero()
    if len(outside):
        i = int(outside[0])
        raise UsageError(
            f"{where}: d2t maps draft id {i} to target id {int(mapped[i])}, "
            f"outside the target's {cfg.target_vocab_size} "
            "tokens; the head belongs to another target, serve it with that one."
        )
    if len(mapped.unique()) != len(mapped):
        raise UsageError(
            f"{where}: d2t maps several draft ids to the same target id; restore the d2t saved with this head."
        )
    return d2t


def _check_shapes(model: Eagle3DraftModel, state: dict[str, torch.Tensor], where: str) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state) - {"d2t"})
    if missing:
        raise UsageError(
            f"{where}: the weights lack {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + " that this config's head needs; restore the weights or the config they were saved with."
        )
    for name, tensor in expected.items():  # d2t is checked by _vocabulary_map, which says what its length means
        if name in state and name != "d2t" and tuple(state[name].shape) != tuple(tensor.shape):
            raise UsageError(
                f"{where}: {name} has shape {list(state[name].shape)} where the config implies {list(tensor.shape)}; "
                "restore the config the weights were saved with."
            )
        if name in state and name != "d2t" and not state[name].is_floating_point():
            raise UsageError(
                f"{where}: {name} holds {str(state[name].dtype).removeprefix('torch.')} values, not the floating-point "
                "weights of a head; restore the weights from the head's release."
            )


def head_facts(
    config: dict[str, Any], model: Eagle3DraftModel, num_target_layers: int, ignored: list[str]
) -> dict[str, Any]:
    """What run.json records about the head: its layout, which layers it reads and why, its vocabulary, and each
    norm switch as the checkpoint writes it and as the replay runs it."""
    cfg = model.config
    _, source = aux_layer_ids(config, num_target_layers)
    return {
        "format": checkpoint_layout(config),
        "layer_type": cfg.layer_type,
        "aux_layer_ids": list(cfg.aux_layer_ids),
        "aux_layer_ids_source": source,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_vocab_coverage": cfg.draft_vocab_size / cfg.target_vocab_size,
        "norm_switches": {name: switch.to_json() for name, switch in norm_switches(config).items()},
        "own_embedding": model.embed_tokens is not None,
        "own_lm_head": model.lm_head is not None,
        "default_k": default_k(config),
        "verifier": verifier_name(config),
        "ignored_tensors": ignored,
    }


def load_eagle3_head(
    draft_dir: Path, target_config: Any, *, dtype: str = "float32", device: str = "cpu"
) -> Eagle3DraftModel:
    """The head of ``draft_dir`` in either layout, validated against ``target_config``, on ``device`` in ``dtype``;
    the kind's run.json facts land on ``model.facts``."""
    config = read_config_json(draft_dir)
    where = str(draft_dir / "config.json")
    if checkpoint_layout(config) is None:
        raise UsageError(
            f"{where} is not an EAGLE-3 head (no speculators_model_type eagle3, no draft_vocab_size with one layer); "
            "pass an EAGLE-3 checkpoint or another --draft-kind."
        )
    state = _read_tensors(draft_dir)
    cfg = read_eagle3_config(config, target_config, state, where)
    # Built on the meta device, the config's sizes allocate nothing: a config that lies (an intermediate_size of
    # 1e8 asked for 230 GB of random weights) is refused by the shape check before any weight exists, and the
    # module then takes the checkpoint's tensors as they are.
    with torch.device("meta"):
        model = Eagle3DraftModel(
            cfg, own_embedding="embed_tokens.weight" in state, own_lm_head="lm_head.weight" in state
        )
    if model.lm_head is None and cfg.draft_vocab_size != cfg.target_vocab_size:
        raise UsageError(
            f"{where}: the weights have no lm_head.weight for the {cfg.draft_vocab_size}-token draft vocabulary; "
            "restore lm_head.weight from the head's release."
        )
    _check_shapes(model, state, where)
    state["d2t"] = _vocabulary_map(state, cfg, where)
    known = model.state_dict()
    ignored = sorted(name for name in state if name not in known)
    model.load_state_dict({name: tensor for name, tensor in state.items() if name in known}, assign=True)
    model.inv_freq = model.rope_frequencies()  # computed on the meta device while the shapes were unchecked
    model.facts = head_facts(config, model, int(target_config.num_hidden_layers), ignored)
    return model.to(device=device, dtype=torch_dtype(dtype)).eval()
