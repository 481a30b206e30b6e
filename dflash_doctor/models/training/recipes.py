"""What ``train-draft`` does differently per draft kind, declared once per kind: a :class:`TrainingRecipe`.

The registry (:mod:`dflash_doctor.models.draft_kinds`) holds each trainable kind's recipe as
``DraftKind.training``, so the training pipeline (:mod:`.pipeline`) never asks which kind it trains: a new
trainable kind is one recipe and one registry entry. A recipe says which flags shape only its kind, builds
the draft to train (new, or ``--init-from``), trains it with the kind's objective, and writes the kind's
part of the model card.

* DFlash (:data:`DFLASH_TRAINING`): a block drafter, z-lab layout; its mask token is chosen here and its
  held-out walk uses K = block size - 1.
* EAGLE-3 (:data:`EAGLE3_TRAINING`): a head drafting a chain of ``--ttt-steps`` tokens, speculators layout
  (its config.json is built before training, so the card's architecture facts are known then).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_doctor.engine.dflash_model import DFlashDraftModel, default_target_layer_ids
from dflash_doctor.engine.eagle3_model import Eagle3DraftModel
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.validation import read_config_json
from dflash_doctor.models.eagle3_format import NORM_SWITCHES, default_aux_layer_ids, load_eagle3_head
from dflash_doctor.models.loading import load_dflash_draft, resolve_model_dir, validate_dflash_pair
from dflash_doctor.models.training.eagle3 import train_eagle3_head
from dflash_doctor.models.training.eagle3_head import (
    DEFAULT_DRAFT_VOCAB_SIZE,
    DEFAULT_TTT_STEPS,
    draft_vocabulary,
    new_eagle3_head,
    speculators_config,
)
from dflash_doctor.models.training.hyperparams import TrainConfig, TrainingResult
from dflash_doctor.models.training.loop import train_dflash_draft
from dflash_doctor.models.training.new_draft import (
    DEFAULT_NUM_TAPS,
    choose_mask_token_id,
    draft_config_for_target,
    init_draft_from_target,
    validate_mask_token_id,
)
from dflash_doctor.models.training.request import TrainDraftRequest
from dflash_doctor.models.training.sequences import SequenceRecord


@dataclass(frozen=True)
class BuildInputs:
    """What a recipe builds the draft from: the request, its layer-ids flag read (``layer_ids``), the loaded
    target and tokenizer, the training sequences, the chat template served, the target as named
    (``target_spec``) and ``provenance`` (the ``dflash_doctor`` block every config.json carries)."""

    request: TrainDraftRequest
    layer_ids: list[int] | None
    target_model: Any
    tokenizer: Any
    records: list[SequenceRecord]
    served_template: str | None
    target_spec: str
    provenance: dict[str, Any]


@dataclass(frozen=True)
class BuiltDraft:
    """The draft to train, its config.json extras, where it started (``init_note``, for the card), the K of its
    held-out walk (None: the draft's own), how its mask token was chosen (DFlash) and the card's architecture
    facts when they are known before training (None: read from the trained draft)."""

    draft: DFlashDraftModel | Eagle3DraftModel
    extra_config: dict[str, Any]
    init_note: str | None
    eval_k: int | None
    mask_choice: str | None = None
    architecture: dict[str, Any] | None = None


@dataclass(frozen=True)
class TrainingRecipe:
    """One draft kind's part of ``train-draft``.

    ``owner``: the kind in an error sentence; ``own_flags``: (flag, request field) of the flags that shape this
    kind only (given with another kind they are a mistake, not a no-op); ``layer_ids_flag``: the flag naming
    the target layers it reads; ``check(request)``: the range checks of its own flags, before anything loads;
    ``build(inputs)``: the draft to train; ``train(...)``: :func:`.loop.train_loop` with the kind's objective;
    ``architecture(built, trained)``: the card's and training log's architecture facts; ``card_head(facts)``:
    the card's title, usage and architecture lines; ``card_unit``: what one draft step proposes (the loss
    table's "accepted per ..."); ``card_k(architecture)``: the held-out walk's K in words; ``card_walk``: how
    the held-out walk is batched.
    """

    owner: str
    own_flags: tuple[tuple[str, str], ...]
    layer_ids_flag: tuple[str, str]
    check: Callable[[TrainDraftRequest], None]
    build: Callable[[BuildInputs], BuiltDraft]
    train: Callable[..., TrainingResult]
    architecture: Callable[[BuiltDraft, torch.nn.Module], dict[str, Any]]
    card_head: Callable[[dict[str, Any]], list[str]]
    card_unit: str
    card_k: Callable[[dict[str, Any]], str]
    card_walk: str


def parse_layer_ids(text: str, flag: str) -> list[int]:
    """A comma-separated list of layer ids (``1,9,17,25``); anything else is a UsageError naming ``flag``."""
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UsageError(
            f"{flag} {text!r} is not a comma-separated list of integers like 1,9,17,25; fix the value."
        ) from None


# ----------------------------------------------------------------------------- DFlash


def _check_init_flags(draft_config, given: dict[str, Any]) -> None:
    """With --init-from the architecture comes from the checkpoint; an explicit flag that disagrees is a mistake."""
    current = {
        "--block-size": draft_config.block_size,
        "--num-layers": draft_config.num_hidden_layers,
        "--target-layer-ids": list(draft_config.target_layer_ids),
        "--mask-token-id": draft_config.mask_token_id,
    }
    for flag, value in given.items():
        if value is not None and value != current[flag]:
            raise UsageError(
                f"{flag} {value} differs from the --init-from checkpoint's {current[flag]}; drop the flag "
                "(fine-tuning keeps the checkpoint's architecture) or train from scratch."
            )


def _dflash_draft(inputs: BuildInputs) -> BuiltDraft:
    """The DFlash draft to train (new, or --init-from), how its mask token was chosen, and where it started."""
    request, target_model, layer_ids = inputs.request, inputs.target_model, inputs.layer_ids
    assert request.device is not None  # filled by the pipeline before any recipe builds
    used_ids = {t for r in inputs.records for t in r.token_ids}
    init_note = request.init_from
    mask_token_id = request.mask_token_id
    if request.init_from:
        draft = load_dflash_draft(resolve_model_dir(request.init_from), device=request.device)
        validate_dflash_pair(draft.config, target_model.config)
        _check_init_flags(
            draft.config,
            {
                "--block-size": request.block_size,
                "--num-layers": request.num_layers,
                "--target-layer-ids": layer_ids,
                "--mask-token-id": mask_token_id,
            },
        )
        mask_choice = "kept from the --init-from checkpoint"
    else:
        num_target_layers = target_model.config.num_hidden_layers
        if mask_token_id is None:
            mask_token_id = choose_mask_token_id(
                inputs.tokenizer, target_model.config, used_ids, inputs.served_template
            )
            mask_choice = (
                "the highest-id special token that is not bos/eos/pad/unk, not in the chat template and "
                "never in the data"
            )
        else:
            validate_mask_token_id(mask_token_id, target_model.config, inputs.tokenizer)
            mask_choice = "given by --mask-token-id"
        torch.manual_seed(request.seed)
        draft = DFlashDraftModel(
            draft_config_for_target(
                target_model.config,
                block_size=16 if request.block_size is None else request.block_size,
                num_layers=2 if request.num_layers is None else request.num_layers,
                target_layer_ids=layer_ids
                or default_target_layer_ids(num_target_layers, min(DEFAULT_NUM_TAPS, num_target_layers)),
                mask_token_id=mask_token_id,
            )
        )
        if request.init_from_target:
            copied = init_draft_from_target(draft, target_model)
            init_note = f"the target's layers {copied} and final norm (--init-from-target)"
    if draft.config.mask_token_id in used_ids:
        raise UsageError(
            f"mask token id {draft.config.mask_token_id} occurs in the training sequences; pick with "
            "--mask-token-id a reserved id the target never generates."
        )
    return BuiltDraft(draft, {"dflash_doctor": inputs.provenance}, init_note, eval_k=None, mask_choice=mask_choice)


def _train_dflash(
    target_model,
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    config: TrainConfig,
    built: BuiltDraft,
    **loop_options,
) -> TrainingResult:
    assert isinstance(built.draft, DFlashDraftModel)
    return train_dflash_draft(
        target_model, sequences, prompt_lengths, config, built.draft, extra_config=built.extra_config, **loop_options
    )


def _dflash_architecture(built: BuiltDraft, trained: torch.nn.Module) -> dict[str, Any]:
    """The trained draft's config, its ``dflash_config`` block flattened beside the rest."""
    assert isinstance(trained, DFlashDraftModel)
    config = trained.config.to_dict()
    return {**config, **config["dflash_config"]}


def _dflash_card_head(facts: dict[str, Any]) -> list[str]:
    arch = facts["architecture"]
    return [
        f"# DFlash draft for `{facts['target']}`",
        "",
        f"Trained by `dflash-doctor train-draft` {facts['tool_version']} on {facts['created_at']}. "
        f"Load it with `dflash-doctor check --target {facts['target']} --draft <this folder>`.",
        "",
        "## Architecture",
        "",
        f"- block size {arch['block_size']}, {arch['num_hidden_layers']} layers, hidden {arch['hidden_size']}, "
        f"{arch['num_attention_heads']} heads ({arch['num_key_value_heads']} KV), head dim {arch['head_dim']}",
        f"- target layer ids {arch['target_layer_ids']} of {arch['num_target_layers']} (taps `hidden_states[l + 1]`)",
        f"- mask token id {arch['mask_token_id']} ({facts['mask_choice']})",
        f"- initialised from: {facts['init_from'] or 'scratch'}",
    ]


DFLASH_TRAINING = TrainingRecipe(
    owner="a DFlash draft",
    own_flags=(
        ("--block-size", "block_size"),
        ("--num-layers", "num_layers"),
        ("--target-layer-ids", "target_layer_ids"),
        ("--mask-token-id", "mask_token_id"),
        ("--init-from-target", "init_from_target"),
    ),
    layer_ids_flag=("--target-layer-ids", "target_layer_ids"),
    check=lambda request: None,  # its flags are checked against the target once it is loaded
    build=_dflash_draft,
    train=_train_dflash,
    architecture=_dflash_architecture,
    card_head=_dflash_card_head,
    card_unit="block",
    card_k=lambda arch: "K = block size - 1",
    card_walk="block passes",
)


# ----------------------------------------------------------------------------- EAGLE-3


def _check_eagle3_flags(request: TrainDraftRequest) -> None:
    for flag, value in {"--draft-vocab-size": request.draft_vocab_size, "--ttt-steps": request.ttt_steps}.items():
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value} must be at least 1.")


def _eagle3_head(inputs: BuildInputs) -> BuiltDraft:
    """The EAGLE-3 head to train (new, or --init-from an EAGLE-3 head), its config.json, the card's architecture
    facts, and where it started."""
    request, target_model, aux_ids = inputs.request, inputs.target_model, inputs.layer_ids
    assert request.device is not None and request.seed is not None  # filled by the pipeline before any recipe builds
    init_from, draft_vocab_size, target_spec = request.init_from, request.draft_vocab_size, inputs.target_spec
    ttt_steps = DEFAULT_TTT_STEPS if request.ttt_steps is None else request.ttt_steps
    target_config = target_model.config
    num_layers, vocab = int(target_config.num_hidden_layers), int(target_config.vocab_size)
    responses = [r.token_ids[r.prompt_length :] for r in inputs.records]
    if aux_ids is not None:
        if not aux_ids:
            raise UsageError(
                "--aux-layer-ids names no layer; pass ids like 8,16,24 or drop the flag for vLLM's default."
            )
        bad = [i for i in aux_ids if not 0 <= i < num_layers]
        if bad:
            raise UsageError(
                f"--aux-layer-ids {bad[0]} is outside the target's {num_layers} layers (id k reads the "
                f"state entering layer k, so 0..{num_layers - 1}); pick ids in that range."
            )
    if draft_vocab_size is not None and draft_vocab_size > vocab:
        raise UsageError(
            f"--draft-vocab-size {draft_vocab_size} exceeds the target's {vocab}-token vocabulary; "
            f"pass at most {vocab}."
        )
    if init_from:
        folder = resolve_model_dir(init_from)
        head = load_eagle3_head(folder, target_config, device=request.device)
        if head.lm_head is None:
            raise UsageError(
                f"--init-from {init_from} drafts with the target's lm_head, which train-draft does not "
                "train; train a head from scratch instead (drop --init-from)."
            )
        for flag, given, kept in (
            ("--aux-layer-ids", aux_ids, head.config.aux_layer_ids),
            ("--draft-vocab-size", draft_vocab_size, head.config.draft_vocab_size),
        ):
            if given is not None and given != kept:
                raise UsageError(
                    f"{flag} {given} differs from the --init-from head's {kept}; drop the flag "
                    "(fine-tuning keeps the head's architecture) or train from scratch."
                )
        config = {key: value for key, value in read_config_json(folder).items() if key != "dflash_doctor"}
        # as the replay ran them: written explicitly
        config |= {name: getattr(head.config.norms, name) for name in NORM_SWITCHES}
        config["eagle_aux_hidden_state_layer_ids"] = list(head.config.aux_layer_ids)
        architectures = list(getattr(target_config, "architectures", None) or [])
        proposal = {"proposal_type": "greedy", "speculative_tokens": ttt_steps}
        config["speculators_config"] = {
            **config.get("speculators_config", {}),
            "algorithm": "eagle3",
            "proposal_methods": [proposal],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_spec, "architectures": architectures},
        }
        proposable = set(head.target_ids().tolist())
        total = sum(len(r) for r in responses)
        coverage = sum(1 for r in responses for t in r if t in proposable) / total if total else 0.0
        init_note = init_from
    else:
        size = min(DEFAULT_DRAFT_VOCAB_SIZE, vocab) if draft_vocab_size is None else draft_vocab_size
        draft_ids, coverage = draft_vocabulary(responses, vocab, size)
        config = speculators_config(
            target_model,
            aux_layer_ids=aux_ids or default_aux_layer_ids(num_layers),
            draft_vocab_size=size,
            ttt_steps=ttt_steps,
            target_spec=target_spec,
        )
        head = new_eagle3_head(target_model, config, draft_ids, seed=request.seed)
        init_note = None
    config["dflash_doctor"] = inputs.provenance
    cfg = head.config
    arch = {
        "layer_type": cfg.layer_type,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "aux_layer_ids": list(cfg.aux_layer_ids),
        "num_target_layers": num_layers,
        "vllm_default_aux_layer_ids": default_aux_layer_ids(num_layers),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_vocab_size": cfg.target_vocab_size,
        "draft_vocab_coverage": coverage,
        "ttt_steps": ttt_steps,
    }
    return BuiltDraft(head, config, init_note, eval_k=ttt_steps, architecture=arch)


def _train_eagle3(
    target_model,
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    config: TrainConfig,
    built: BuiltDraft,
    **loop_options,
) -> TrainingResult:
    assert isinstance(built.draft, Eagle3DraftModel) and built.eval_k is not None
    return train_eagle3_head(
        target_model,
        sequences,
        prompt_lengths,
        config,
        built.draft,
        ttt_steps=built.eval_k,
        head_config=built.extra_config,
        **loop_options,
    )


def _eagle3_architecture(built: BuiltDraft, trained: torch.nn.Module) -> dict[str, Any]:
    """Known when the head was built (the draft vocabulary's coverage of the data among them)."""
    assert built.architecture is not None
    return built.architecture


def _eagle3_card_head(facts: dict[str, Any]) -> list[str]:
    arch = facts["architecture"]
    speculative_config = (
        f'{{"method": "eagle3", "model": "<this folder>", "num_speculative_tokens": {arch["ttt_steps"]}}}'
    )
    return [
        f"# EAGLE-3 head for `{facts['target']}`",
        "",
        f"Trained by `dflash-doctor train-draft --draft-kind eagle3` {facts['tool_version']} on {facts['created_at']}. "
        f"Load it with `dflash-doctor check --target {facts['target']} --draft <this folder>`; serve it with vLLM's "
        f"`--speculative-config '{speculative_config}'`.",
        "",
        "## Architecture",
        "",
        f"- EAGLE-3 head, speculators layout: one {arch['layer_type']} decoder layer, hidden {arch['hidden_size']}, "
        f"{arch['num_attention_heads']} heads ({arch['num_key_value_heads']} KV), head dim {arch['head_dim']}, "
        f"intermediate {arch['intermediate_size']}; the target's embedding shared (none saved)",
        f"- aux layer ids {arch['aux_layer_ids']} of {arch['num_target_layers']} (id k = the state entering target "
        f"layer k, HF `hidden_states[k]`; written in config.json: vLLM's default for this target would be "
        f"{arch['vllm_default_aux_layer_ids']})",
        f"- draft vocabulary {arch['draft_vocab_size']} of {arch['target_vocab_size']} target tokens, covering "
        f"{100 * arch['draft_vocab_coverage']:.2f}% of the training response tokens (the rest can never be proposed)",
        f"- TTT steps {arch['ttt_steps']} (chain slots trained; `speculative_tokens` in config.json)",
        "- norm switches all false, written explicitly (vLLM reads a missing `norm_before_residual` as true)",
        f"- initialised from: {facts['init_from'] or 'scratch (norm and lm_head rows from the target)'}",
    ]


EAGLE3_TRAINING = TrainingRecipe(
    owner="an EAGLE-3 head (--draft-kind eagle3)",
    own_flags=(
        ("--aux-layer-ids", "aux_layer_ids"),
        ("--draft-vocab-size", "draft_vocab_size"),
        ("--ttt-steps", "ttt_steps"),
    ),
    layer_ids_flag=("--aux-layer-ids", "aux_layer_ids"),
    check=_check_eagle3_flags,
    build=_eagle3_head,
    train=_train_eagle3,
    architecture=_eagle3_architecture,
    card_head=_eagle3_card_head,
    card_unit="chain",
    card_k=lambda arch: f"K = --ttt-steps = {arch['ttt_steps']}",
    card_walk="teacher-forced chains",
)
