"""The draft-kind registry: everything that differs between kinds of draft model, in one place.

The engine's loops never branch on a draft's kind (a proposer *declares* what it needs, vLLM #43986).
Outside the engine, what does differ per kind (how a checkpoint is recognised, loaded and validated
against the target, which proposer drives it, which facts run.json records, whether it reads target
layers) is declared here, once per kind, as a :class:`DraftKind`. Wiring code asks the registry;
``grep`` finds no kind string outside this module, the proposers and ``checks/``.

Adding a kind (a new draft format, a config dialect of an existing one) is one call::

    register_draft_kind(DraftKind(
        name="dflash2",
        description="DFlash 2 block drafter (...)",
        detect=lambda config: "dflash2_config" in config,   # recognise its config.json
        load=load_my_draft,          # (draft_dir, target_dir, target_config, LoadOptions) -> module; raise UsageError
        build=lambda model, target, sampling: MyProposer(model, target),
        serving=KindServing(name="dflash2", vllm_method="dflash", sglang="...", llamacpp="..."),  # how engines serve it
        facts=lambda model: {"block_size": ...},               # extra run.json models.draft facts
        layer_ids=lambda model: list(model.config.target_layer_ids),        # or None: reads no target layers
        with_layer_ids=lambda model, ids: my_copy_reading(ids),             # or None
    ), before="autoregressive")

``register_draft_kind`` registers the serving declaration in :mod:`dflash_doctor.models.kind_serving`, where
the views without torch (the head-to-head pages) read it; a built-in kind's ``KindServing`` is written in that
module (so those views know it without importing this one) and referenced here.

``--draft-kind auto`` asks each kind's ``detect`` in registration order; ``autoregressive`` is the
catch-all and stays last (pass ``before=`` to register ahead of it).

A speculator without weights (``ngram``) declares ``from_spec`` instead of a checkpoint loader: the
user names it as the draft, ``--draft ngram`` or ``--draft ngram:prompt_lookup_min=2,prompt_lookup_max=5``
(:func:`weightless_kind`), and ``from_spec`` builds its module from those settings and the target's
folder and config (``mtp``, a target's own MTP head, reads its weights from the target's checkpoint).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

import numpy as np
import torch

from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.proposers.base import Proposer
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.mtp_model import MtpHead, build_mtp_head
from dflash_doctor.engine.proposers.eagle3 import Eagle3Proposer
from dflash_doctor.engine.proposers.mtp import (
    DEFAULT_ENGINE,
    MTP_ENGINE_SIDES,
    SIDES,
    MtpProposer,
    MtpSettings,
    default_mtp_settings,
    engine_sides,
)
from dflash_doctor.engine.proposers.ngram import NgramProposer, NgramSettings
from dflash_doctor.engine.proposers.suffix import SuffixProposer, SuffixSettings
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.errors import UsageError
from dflash_doctor.models.kind_serving import (
    AUTOREGRESSIVE,
    DFLASH,
    EAGLE3,
    MTP,
    NGRAM,
    SUFFIX,
    KindServing,
    register_kind_serving,
)
from dflash_doctor.models.eagle3_format import is_eagle3_config, load_eagle3_head
from dflash_doctor.models.mtp_format import LAYOUT_NAMES, read_mtp_checkpoint
from dflash_doctor.models.serving_setups import SetupProposers, dflash_setup_proposers, eagle3_setup_proposers
from dflash_doctor.models.training.recipes import DFLASH_TRAINING, EAGLE3_TRAINING, TrainingRecipe
from dflash_doctor.inputs.validation import read_config_json
from dflash_doctor.models.loading import (
    is_dflash_config,
    load_causal_lm,
    load_dflash_draft,
    resolve_model_dir,
    torch_dtype,
    validate_autoregressive_pair,
    validate_dflash_pair,
)

if TYPE_CHECKING:
    from dflash_doctor.engine.dflash_model import DFlashDraftModel
    from dflash_doctor.engine.eagle3_model import Eagle3DraftModel
    from dflash_doctor.engine.target import CausalLM

DraftModel = TypeVar("DraftModel", bound=torch.nn.Module)


@dataclass(frozen=True)
class LoadOptions:
    """How the pair is loaded: the same for every kind (from DoctorConfig)."""

    dtype: str
    device: str
    trust_remote_code: bool = False


@dataclass(frozen=True)
class Sampling:
    """What a proposer may need to draft: the replay's temperature, its seeded generator, and how the
    modelled engine drafts under sampling (vLLM's ``draft_sample_method``: greedy | probabilistic)."""

    temperature: float = 0.0
    generator: torch.Generator | None = None
    draft_sample_method: str = "greedy"


@dataclass(frozen=True)
class DraftKind(Generic[DraftModel]):
    """One kind of draft model, declared once; ``DraftModel`` is the module class its ``load`` returns.

    ``detect(config)``: does this checkpoint's config.json belong to this kind (``--draft-kind auto``)?
    ``load(draft_dir, target_dir, target_config, options)``: the draft module, validated against the
    target; a pair that cannot work raises :class:`UsageError` with one sentence and the fix.
    ``build(model, target, sampling)``: the proposer that drives it in the engine's loops.
    ``serving``: how the serving engines serve this kind (vLLM's method and settings, SGLang's and llama.cpp's
    flags: :class:`~dflash_doctor.models.kind_serving.KindServing`, readable without torch); ``tune`` and the
    head-to-head write their settings from it.
    ``facts(model)``: kind-specific facts for run.json ``models.draft`` (block size, layer ids...).
    ``layer_ids(model)``: the target layers it reads, or None for a draft that reads none; with
    ``with_layer_ids(model, ids)`` (a copy reading other layers) it enables the layer-offset probe.
    ``ships_tokenizer``: the checkpoint carries its own tokenizer, which the checks compare with the target's.
    ``engine_agreement``: the serving engines' setups for this kind are modelled
    (:mod:`dflash_doctor.serving.agreement`), so ``check --engine`` with a local pair replays the server's
    answered turns in the embedded engine under each setup.
    ``serving_checklist``: where to look in the serving setup when the server accepts less than the draft
    on the same text and none of the modelled setups explains it (the ``engine-agreement`` check's fix).
    ``serving_setups(model, target_model)``: the setups a server can run this kind's draft under (as
    configured, and each mistake or engine defect the replay reproduces exactly), each with its proposer
    over the target (None where the setup cannot apply to this draft); None: one setup, the pair's own
    proposer (a speculator without weights, whose proposals follow from its settings and the text).
    ``from_spec(settings, target_dir, target_config, options)``: a kind without a draft checkpoint, named
    by ``--draft NAME`` (optionally ``NAME:key=value,...``, the settings as a dict of strings): its module,
    holding its settings and whatever it reads from the target's folder; ``detect`` and ``load`` are then
    never asked.
    ``check_settings(settings)``: such a kind's settings read and range-checked with no model (a
    UsageError for a bad one), so a bad option string is refused when it is read, before anything loads.
    ``training``: how ``train-draft`` trains this kind (its flags, draft, objective and model card:
    :mod:`dflash_doctor.models.training.recipes`); None for a kind it does not train.
    """

    name: str
    description: str
    detect: Callable[[dict[str, Any]], bool]
    load: Callable[[Path, Path, Any, LoadOptions], DraftModel]
    build: Callable[[DraftModel, TargetModel, Sampling], Proposer]
    serving: KindServing
    facts: Callable[[DraftModel], dict[str, Any]] = lambda model: {}
    layer_ids: Callable[[DraftModel], list[int]] | None = None
    with_layer_ids: Callable[[DraftModel, list[int]], DraftModel] | None = None
    ships_tokenizer: bool = False
    engine_agreement: bool = False
    serving_checklist: str = ""
    serving_setups: Callable[[DraftModel, CausalLM], SetupProposers] | None = None
    from_spec: Callable[[dict[str, str], Path, Any, LoadOptions], DraftModel] | None = None
    check_settings: Callable[[dict[str, str]], object] | None = None
    training: TrainingRecipe | None = None


_KINDS: dict[str, DraftKind[Any]] = {}
AUTO = "auto"


def register_draft_kind(kind: DraftKind[DraftModel], *, before: str | None = None) -> DraftKind[DraftModel]:
    """Add a kind, and its serving to :mod:`~dflash_doctor.models.kind_serving` (where the views without torch
    read it); a second kind with the same name is refused. ``before`` puts it ahead of an existing
    kind in ``--draft-kind auto`` detection order (a specific kind must come before a catch-all)."""
    if kind.name in _KINDS or kind.name == AUTO:
        raise ValueError(f"draft kind {kind.name!r} is already registered")
    if (kind.layer_ids is None) != (kind.with_layer_ids is None):
        raise ValueError(f"draft kind {kind.name!r}: declare both layer_ids and with_layer_ids, or neither")
    if kind.serving.name != kind.name:
        raise ValueError(f"draft kind {kind.name!r}: its serving declares the kind {kind.serving.name!r}")
    if (kind.from_spec is None) != kind.serving.has_checkpoint:
        raise ValueError(f"draft kind {kind.name!r}: declare from_spec exactly when its serving has no checkpoint")
    items = list(_KINDS.items())
    position = len(items) if before is None else [name for name, _ in items].index(get_draft_kind(before).name)
    register_kind_serving(kind.serving)
    items.insert(position, (kind.name, kind))
    _KINDS.clear()
    _KINDS.update(items)
    return kind


def kind_names() -> list[str]:
    """Every name ``--draft-kind`` takes: the registered kinds in detection order, then ``auto``."""
    return [*_KINDS, AUTO]


def get_draft_kind(name: str) -> DraftKind[Any]:
    """The kind called ``name``; an unknown name is a UsageError suggesting the closest one."""
    try:
        return _KINDS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(_KINDS), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(
            f"--draft-kind {name!r} is not a draft kind; {hint}pick one of {', '.join(kind_names())}."
        ) from None


def weightless_kind(spec: str) -> tuple[DraftKind[Any], dict[str, str]] | None:
    """The kind a ``--draft`` value names when it names a speculator without weights (``ngram``,
    ``ngram:prompt_lookup_max=4``), with its settings; None for a checkpoint (a path or hub id).

    The settings are checked here, where the string is read, so every caller (a head-to-head's up-front
    pass, the pair's load) refuses a bad one before any model loads: a key given twice is refused (which
    one was meant?), and the kind's ``check_settings`` reads every value with no model."""
    name, _, rest = spec.partition(":")
    kind = _KINDS.get(name)
    if kind is None or kind.from_spec is None:
        return None
    settings: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise UsageError(
                f"--draft {spec!r}: settings are key=value pairs separated by commas, e.g. "
                "ngram:prompt_lookup_max=4 or suffix:suffix_decoding_max_tree_depth=16."
            )
        if key.strip() in settings:
            raise UsageError(f"--draft {spec!r}: {key.strip()} is set twice; keep one value.")
        settings[key.strip()] = value.strip()
    if kind.check_settings is not None:
        kind.check_settings(settings)
    return kind, settings


#: ``1``, ``-3``, ``+12``: a whole number in ASCII digits (``int()`` also reads other scripts' digits and ``1_000``)
_WHOLE_NUMBER = re.compile(r"[+-]?[0-9]{1,30}")
#: a decimal number in ASCII (``float()`` also reads ``inf``, ``nan``, other scripts' digits and ``1_0``)
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,4})?")


def setting_int(kind: str, key: str, text: str, example: str) -> int:
    """A speculator setting that is a whole number, written in ASCII digits; anything else is a UsageError
    (the range is the settings class's to check). At most 30 digits are read: no bound is that long."""
    if not _WHOLE_NUMBER.fullmatch(text):
        raise UsageError(f"--draft {kind}: {key}={text!r} is not a whole number in the digits 0-9; e.g. {example}.")
    return int(text)


def setting_float(kind: str, key: str, text: str, example: str) -> float:
    """A speculator setting that is a number: ASCII decimal, finite in float32 (the engines compute in
    float32: 1e39 is finite as a Python float and infinite there) and not rounded to 0 (``1e-400``, or
    ``1e-50`` in float32) when it is not 0, so the value the replay uses is the value the user wrote."""
    if not _DECIMAL.fullmatch(text):
        raise UsageError(f"--draft {kind}: {key}={text!r} is not a decimal number; e.g. {example}.")
    value = float(text)
    if abs(value) > float(np.finfo(np.float32).max):
        raise UsageError(f"--draft {kind}: {key}={text!r} does not fit a float32 (above 3.4e38); e.g. {example}.")
    written_nonzero = re.search(r"[1-9]", text.lower().partition("e")[0]) is not None
    if written_nonzero and np.float32(value) == 0:
        raise UsageError(
            f"--draft {kind}: {key}={text!r} rounds to 0 in float32; write 0 or a larger number, e.g. {example}."
        )
    return value


@dataclass(frozen=True)
class DraftSpec:
    """A ``--draft`` value resolved without loading weights: its kind, and a weightless speculator's
    settings (None for a checkpoint) or a checkpoint's folder and config.json."""

    kind: DraftKind[Any]
    settings: dict[str, str] | None
    draft_dir: Path | None
    config: dict[str, Any]


def resolve_draft_spec(spec: str, draft_kind: str) -> DraftSpec:
    """Everything about ``--draft spec`` that needs no weights, refused in one sentence where wrong: a
    weightless kind's option string (and a ``--draft-kind`` naming another kind), else the checkpoint's
    existence (a folder with config.json, a hub id in the local cache, a .gguf file), its config and the
    kind that config names. The pair's load starts here, and a head-to-head runs it on every ``--draft``
    before the first model loads."""
    named = weightless_kind(spec)
    if named is not None:
        if draft_kind not in (AUTO, named[0].name):
            raise UsageError(
                f"--draft {spec} is the {named[0].name} speculator; drop --draft-kind {draft_kind} "
                f"or pass --draft-kind {named[0].name}."
            )
        return DraftSpec(named[0], named[1], None, {})
    draft_dir = resolve_model_dir(spec)
    config = read_config_json(draft_dir)
    return DraftSpec(resolve_draft_kind(draft_kind, config, spec), None, draft_dir, config)


def detect_draft_kind(config: dict[str, Any]) -> DraftKind[Any]:
    """The first registered kind whose ``detect`` accepts this config.json."""
    for kind in _KINDS.values():
        if kind.detect(config):
            return kind
    raise UsageError("no draft kind recognises this checkpoint's config.json; pass --draft-kind.")


def resolve_draft_kind(name: str, config: dict[str, Any], spec: str) -> DraftKind[Any]:
    """``--draft-kind`` (or ``auto``) for a checkpoint: a named kind whose detection prefers another
    specific kind is refused, so a DFlash checkpoint is never loaded as a plain causal LM."""
    detected = detect_draft_kind(config)
    if name == AUTO:
        return detected
    kind = get_draft_kind(name)
    if kind is not detected and list(_KINDS).index(detected.name) < list(_KINDS).index(kind.name):
        raise UsageError(f"{spec} is a {detected.name} checkpoint; pass --draft-kind {detected.name} or {AUTO}.")
    return kind


# ----------------------------------------------------------------------------- built-in kinds


def _load_dflash(draft_dir: Path, target_dir: Path, target_config: Any, options: LoadOptions) -> DFlashDraftModel:
    model = load_dflash_draft(
        draft_dir, dtype=options.dtype, device=options.device, served_target_layers=target_config.num_hidden_layers
    )
    validate_dflash_pair(model.config, target_config)
    return model


def _dflash_with_layer_ids(model: DFlashDraftModel, layer_ids: list[int]) -> DFlashDraftModel:
    """The same weights reading other target layers (a shallow copy with an edited config)."""
    shifted = copy.copy(model)
    shifted.config = dataclasses.replace(model.config, target_layer_ids=list(layer_ids))
    return shifted


def _load_autoregressive(draft_dir: Path, target_dir: Path, target_config: Any, options: LoadOptions) -> CausalLM:
    model = load_causal_lm(
        draft_dir, dtype=options.dtype, device=options.device, trust_remote_code=options.trust_remote_code
    )
    # kept on the model like a DFlash draft's ``draft_format``, for the kind's run.json facts (setattr: a
    # transformers model declares no such attribute, and nn.Module's typed __setattr__ expects tensors)
    setattr(model, "vocabulary_check", validate_autoregressive_pair(draft_dir, target_dir, model.config, target_config))
    return model


register_draft_kind(
    DraftKind(
        name=DFlashProposer.kind,
        serving=DFLASH,
        description=(
            "DFlash block-diffusion drafter, DFlash or DFlash 2, in any "
            "dialect (z-lab, speculators, NeMo: docs/draft-formats.md)"
        ),
        detect=is_dflash_config,
        load=_load_dflash,
        build=lambda model, target, sampling: DFlashProposer(
            model,
            target,
            temperature=sampling.temperature,
            draft_sample_method=sampling.draft_sample_method,
            generator=sampling.generator,
        ),
        facts=lambda model: {
            "block_size": model.config.block_size,
            "target_layer_ids": list(model.config.target_layer_ids),
            "mask_token_id": model.config.mask_token_id,
            "num_layers": model.config.num_hidden_layers,
            "architecture": model.config.architecture,
            "causal_layers": [model.config.layer_is_causal(i) for i in range(model.config.num_hidden_layers)],
            "format": model.draft_format,
        },
        layer_ids=lambda model: list(model.config.target_layer_ids),
        with_layer_ids=_dflash_with_layer_ids,
        engine_agreement=True,
        serving_checklist=(
            "the mask id, num_speculative_tokens vs the block size, the draft's attention backend (must be "
            "non-causal capable), a quantised KV cache for the draft, and the chat template the server renders"
        ),
        serving_setups=dflash_setup_proposers,
        training=DFLASH_TRAINING,
    )
)

register_draft_kind(
    DraftKind(
        name=AutoregressiveProposer.kind,
        serving=AUTOREGRESSIVE,
        description="a classic autoregressive draft: any causal LM sharing the target's tokenizer (the catch-all)",
        detect=lambda config: True,
        load=_load_autoregressive,
        build=lambda model, target, sampling: AutoregressiveProposer(
            model, temperature=sampling.temperature, generator=sampling.generator
        ),
        facts=lambda model: {"vocabulary_check": getattr(model, "vocabulary_check", None)},
        ships_tokenizer=True,
    )
)


class WeightlessDraft(torch.nn.Module):
    """A weightless speculator's "draft model" (n-gram lookup, suffix trees): its settings and the target's
    vocabulary width, no weights."""

    def __init__(self, settings: NgramSettings | SuffixSettings, vocab_size: int, device: str):
        super().__init__()
        self.settings = settings
        self.vocab_size = vocab_size
        self.device_name = device


_NGRAM_EXAMPLE = "ngram:prompt_lookup_min=2,prompt_lookup_max=5"


def _ngram_settings(settings: dict[str, str]) -> NgramSettings:
    """The ``--draft ngram:...`` settings, checked with no model (no context cap yet: the target sets it)."""
    known = ("prompt_lookup_min", "prompt_lookup_max")
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise UsageError(
            f"--draft ngram: unknown setting {unknown[0]!r}; the settings are {', '.join(known)} (vLLM's names)."
        )
    values = {key: setting_int("ngram", key, value, _NGRAM_EXAMPLE) for key, value in settings.items()}
    try:
        return NgramSettings.resolve(values.get("prompt_lookup_min"), values.get("prompt_lookup_max"))
    except ValueError as error:
        raise UsageError(f"--draft ngram: {error}; e.g. {_NGRAM_EXAMPLE}.") from None


def _ngram_from_spec(
    settings: dict[str, str], target_dir: Path, target_config: Any, options: LoadOptions
) -> WeightlessDraft:
    resolved = dataclasses.replace(
        _ngram_settings(settings), max_model_len=getattr(target_config, "max_position_embeddings", None)
    )
    return WeightlessDraft(resolved, int(target_config.vocab_size), options.device)


def _unused_load(draft_dir: Path, target_dir: Path, target_config: Any, options: LoadOptions) -> Any:
    raise UsageError("a weightless speculator has no checkpoint to load; pass --draft ngram or --draft suffix.")


register_draft_kind(
    DraftKind(
        name=NgramProposer.kind,
        serving=NGRAM,
        description="vLLM's n-gram prompt lookup (no weights): --draft ngram[:prompt_lookup_min=N,prompt_lookup_max=M]",
        detect=lambda config: False,
        load=_unused_load,
        build=lambda model, target, sampling: NgramProposer(
            model.settings, target.head.out_features, target.head.weight.device
        ),
        facts=lambda model: {
            "prompt_lookup_min": model.settings.prompt_lookup_min,
            "prompt_lookup_max": model.settings.prompt_lookup_max,
            "max_model_len": model.settings.max_model_len,
        },
        # vLLM's proposals follow from the text and the two settings alone, so its steps replay exactly
        engine_agreement=True,
        serving_checklist=(
            "the server's prompt_lookup_min, prompt_lookup_max and num_speculative_tokens against the --draft ngram "
            "settings, and the chat template the server renders (the lookup reads the prompt's tokens)"
        ),
        from_spec=_ngram_from_spec,
        check_settings=_ngram_settings,
    ),
    before="autoregressive",
)


#: vLLM's setting names (``suffix_decoding_*``) -> their type; the short names without the prefix are accepted too
_SUFFIX_SETTINGS: dict[str, type] = {
    "max_tree_depth": int,
    "max_cached_requests": int,
    "max_spec_factor": float,
    "min_token_prob": float,
}
_SUFFIX_EXAMPLE = "suffix:suffix_decoding_max_tree_depth=24,suffix_decoding_min_token_prob=0.1"


def _suffix_settings(settings: dict[str, str], max_model_len: int | None = None) -> SuffixSettings:
    """The ``--draft suffix:...`` settings, checked with no model (the target sets ``max_model_len`` later)."""
    values: dict[str, Any] = {}
    for key, text in settings.items():
        short = key.removeprefix("suffix_decoding_")
        kind = _SUFFIX_SETTINGS.get(short)
        if kind is None:
            names = ", ".join(f"suffix_decoding_{name}" for name in _SUFFIX_SETTINGS)
            raise UsageError(f"--draft suffix: unknown setting {key!r}; the settings are {names} (vLLM's names).")
        if short in values:
            raise UsageError(
                f"--draft suffix: suffix_decoding_{short} is set twice (with and without the prefix); keep one value."
            )
        read = setting_int if kind is int else setting_float
        values[short] = read("suffix", f"suffix_decoding_{short}", text, _SUFFIX_EXAMPLE)
    try:
        return SuffixSettings(**values, max_model_len=max_model_len)
    except ValueError as error:
        raise UsageError(f"--draft suffix: {error}, as vLLM requires; e.g. {_SUFFIX_EXAMPLE}.") from None


def _suffix_from_spec(
    settings: dict[str, str], target_dir: Path, target_config: Any, options: LoadOptions
) -> WeightlessDraft:
    resolved = _suffix_settings(settings, getattr(target_config, "max_position_embeddings", None))
    return WeightlessDraft(resolved, int(target_config.vocab_size), options.device)


register_draft_kind(
    DraftKind(
        name=SuffixProposer.kind,
        serving=SUFFIX,
        description=(
            "vLLM's suffix decoding (Arctic Inference; no weights): --draft suffix[:suffix_decoding_max_tree_depth=24,"
            "suffix_decoding_max_cached_requests=10000,suffix_decoding_max_spec_factor=1.0,"
            "suffix_decoding_min_token_prob=0.1]"
        ),
        detect=lambda config: False,
        load=_unused_load,
        build=lambda model, target, sampling: SuffixProposer(
            model.settings, target.head.out_features, target.head.weight.device
        ),
        facts=lambda model: {
            "suffix_decoding_max_tree_depth": model.settings.max_tree_depth,
            "suffix_decoding_max_cached_requests": model.settings.max_cached_requests,
            "suffix_decoding_max_spec_factor": model.settings.max_spec_factor,
            "suffix_decoding_min_token_prob": model.settings.min_token_prob,
            "max_model_len": model.settings.max_model_len,
        },
        # the trees follow from the text, the settings and the responses before: replayed in the order served, exactly
        engine_agreement=True,
        serving_checklist=(
            "the server's suffix_decoding_* settings and num_speculative_tokens against the --draft suffix "
            "settings, requests sent one at a time (--engine-concurrency 1: the global tree holds the responses "
            "in the order served, and a fresh server holds no others), and the chat template the server renders"
        ),
        from_spec=_suffix_from_spec,
        check_settings=_suffix_settings,
    ),
    before="autoregressive",
)


# --------------------------------------------------- eagle3: EAGLE-3 heads (the eagle3 section of docs/speculators.md)


def _load_eagle3(draft_dir: Path, target_dir: Path, target_config: Any, options: LoadOptions) -> Eagle3DraftModel:
    return load_eagle3_head(draft_dir, target_config.get_text_config(), dtype=options.dtype, device=options.device)


def _eagle3_with_layer_ids(model: Eagle3DraftModel, layer_ids: list[int]) -> Eagle3DraftModel:
    """The same weights reading other target layers (a shallow copy with an edited config). The ids keep
    vLLM's meaning (the state entering layer k), so an offset of +1 reads one layer deeper, as for DFlash."""
    shifted = copy.copy(model)
    shifted.config = dataclasses.replace(model.config, aux_layer_ids=list(layer_ids))
    shifted.facts = {**model.facts, "aux_layer_ids": list(layer_ids)}
    return shifted


register_draft_kind(
    DraftKind(
        name=Eagle3Proposer.kind,
        serving=EAGLE3,
        description=(
            "an EAGLE-3 head (speculators or original EAGLE-3 layout) drafting a chain as vLLM's eagle3 method does"
        ),
        detect=is_eagle3_config,
        load=_load_eagle3,
        build=lambda model, target, sampling: Eagle3Proposer(model, target),
        facts=lambda model: dict(model.facts),
        layer_ids=lambda model: list(model.config.aux_layer_ids),
        with_layer_ids=_eagle3_with_layer_ids,
        # a chain of K every step, so vLLM lists every step: compared anchor by anchor under its setups
        engine_agreement=True,
        serving_checklist=(
            "the served head's eagle_aux_hidden_state_layer_ids and norm switches against the local config (the "
            "eagle3-config check lists both), the draft-to-target "
            "vocabulary map the server loads, num_speculative_tokens, "
            "a quantised KV cache for the head, and the chat template the server renders"
        ),
        serving_setups=eagle3_setup_proposers,
        training=EAGLE3_TRAINING,
    ),
    before="autoregressive",
)


# --------------------------------------------------- mtp: a target's own MTP head (docs/speculators.md#mtp)

_MTP_SETTINGS = ("hidden_state", "carried_state")
_MTP_EXAMPLE = "mtp:carried_state=pre-norm or mtp:hidden_state=post-norm,carried_state=post-norm"


class MtpDraft(torch.nn.Module):
    """A target's MTP head read from the target's own checkpoint, with the replay's settings: each side the
    user did not set is what the default engine passes for the target's architecture (``model_type``)."""

    def __init__(
        self,
        head: MtpHead,
        settings: MtpSettings,
        has_own_head: bool,
        has_own_embedding: bool,
        architecture: str = "",
        set_by_user: tuple[str, ...] = (),
    ):
        super().__init__()
        self.head = head
        self.settings = settings
        self.has_own_head = has_own_head
        self.has_own_embedding = has_own_embedding
        self.architecture = architecture
        self.set_by_user = set_by_user


def _mtp_settings(settings: dict[str, str]) -> dict[str, str]:
    """The ``--draft mtp:...`` settings, checked with no model: each a known side, each value a side name."""
    for key, value in settings.items():
        if key == "num_speculative_tokens":
            raise UsageError("--draft mtp: num_speculative_tokens is --k; pass --k N instead of the setting.")
        if key not in _MTP_SETTINGS:
            raise UsageError(
                f"--draft mtp: unknown setting {key!r}; the settings "
                f"are {', '.join(_MTP_SETTINGS)}, e.g. {_MTP_EXAMPLE}."
            )
        if value not in SIDES:
            raise UsageError(f"--draft mtp: {key}={value!r} is not {' or '.join(SIDES)}; e.g. {_MTP_EXAMPLE}.")
    return settings


def _mtp_from_spec(settings: dict[str, str], target_dir: Path, target_config: Any, options: LoadOptions) -> MtpDraft:
    architecture = str(getattr(target_config, "model_type", "") or "")
    default = default_mtp_settings(architecture)
    resolved = MtpSettings(
        hidden_state=settings.get("hidden_state", default.hidden_state),
        carried_state=settings.get("carried_state", default.carried_state),
    )
    checkpoint = read_mtp_checkpoint(target_dir, read_config_json(target_dir), target_dir.name)
    head = build_mtp_head(
        checkpoint, target_config, dtype=torch_dtype(options.dtype), device=options.device, target_name=target_dir.name
    )
    return MtpDraft(
        head,
        resolved,
        checkpoint.has_own("head"),
        checkpoint.has_own("embed_tokens"),
        architecture,
        tuple(side for side in _MTP_SETTINGS if side in settings),
    )


def _mtp_sides_from(model: MtpDraft) -> dict[str, str]:
    """Per side, where the replay's value came from: the user's setting, or the default engine for this architecture."""
    default = engine_sides(DEFAULT_ENGINE, model.architecture)
    source = f"what {DEFAULT_ENGINE} passes for {model.architecture or 'this target'} ({default.model})" + (
        "" if default.verified else ", unverified"
    )
    return {
        side: f"set: --draft mtp:{side}={getattr(model.settings, side)}"
        if side in model.set_by_user
        else f"default: {source}"
        for side in _MTP_SETTINGS
    }


def _mtp_facts(model: MtpDraft) -> dict[str, Any]:
    n = model.head.n_predict
    return {
        "layout": LAYOUT_NAMES[model.head.layout],
        "n_predict": n,
        "mtp_layer_indices": [model.head.first_layer_index + i for i in range(n)],
        "step_layer_rule": f"draft step s (0-based) runs MTP layer s % {n}; K must be a multiple of {n} (vLLM)",
        "architecture": model.architecture,
        "hidden_state": model.settings.hidden_state,
        "carried_state": model.settings.carried_state,
        "sides_from": _mtp_sides_from(model),
        "engine_sides": {
            engine: engine_sides(engine, model.architecture).as_facts(model.architecture) for engine in MTP_ENGINE_SIDES
        },
        "lm_head": "own (shared_head.head)" if model.has_own_head else "the target's",
        "embedding": "own (embed_tokens)" if model.has_own_embedding else "the target's",
        "draft_probabilities": "none: a point mass on each drafted token (vLLM passes none for MTP)",
    }


register_draft_kind(
    DraftKind(
        name=MtpProposer.kind,
        serving=MTP,
        description=(
            "the target's own multi-token-prediction head (DeepSeek-V3/GLM or Qwen3-Next/Qwen3.5 layout, read from the "
            "target's checkpoint): --draft "
            "mtp[:hidden_state=post-norm|pre-norm,carried_state=post-norm|pre-norm]; unset sides: what vLLM "
            "passes for the target's architecture"
        ),
        detect=lambda config: False,
        load=_unused_load,
        build=lambda model, target, sampling: MtpProposer(model.head, target, model.settings),
        facts=_mtp_facts,
        # one chain of K every step, a function of the target's states and the text: the replay as configured
        # (the sides vLLM passes for the architecture) reproduces the server's steps (docs/speculators.md#mtp)
        engine_agreement=True,
        serving_checklist=(
            "which hidden state the engine hands the MTP head, before or after the final norm (the mtp-config "
            "check names each engine's choice), num_speculative_tokens against the number of MTP layers, and the "
            "chat template the server renders"
        ),
        from_spec=_mtp_from_spec,
        check_settings=_mtp_settings,
    ),
    before="autoregressive",
)
