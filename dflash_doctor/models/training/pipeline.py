"""``train-draft`` as one straight sequence below the CLI, as ``check`` is :mod:`dflash_doctor.pipeline`.

check the request -> load the workload -> claim --out -> load the target -> the target's own answers
(cached in --out) -> the kind's draft (new or --init-from) -> held-out tau before -> train (resumable
checkpoints) -> held-out tau after -> the draft, training_log.json and README.md written. The CLI turns
its flags into a :class:`~dflash_doctor.models.training.request.TrainDraftRequest`, calls
:func:`train_draft` and prints the returned :class:`TrainingOutcome`.

What differs between draft kinds is the kind's :class:`~dflash_doctor.models.training.recipes.TrainingRecipe`
(``DraftKind.training`` in the registry); nothing here asks which kind it trains.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_doctor import __version__
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.workloads import BUILTIN_NAMES, extra_word_problems, load_workload, read_chat_template
from dflash_doctor.models.draft_kinds import AUTO, get_draft_kind, kind_names
from dflash_doctor.models.loading import demo_target_path, load_causal_lm, resolve_model_dir, weights_fingerprint
from dflash_doctor.models.pair import stop_ids_of
from dflash_doctor.models.training.card import model_card
from dflash_doctor.models.training.checkpoints import CHECKPOINT_DIR_NAME, remove_checkpoint, save_draft
from dflash_doctor.models.training.evaluation import held_out_steps, tau_by_class
from dflash_doctor.models.training.hyperparams import TrainConfig, TrainingResult
from dflash_doctor.models.training.new_draft import chat_template_record
from dflash_doctor.models.training.recipes import BuildInputs, BuiltDraft, TrainingRecipe, parse_layer_ids
from dflash_doctor.models.training.request import TrainDraftRequest
from dflash_doctor.models.training.sequences import (
    SELF_WRITTEN_PROMPTS_FILE,
    SEQUENCES_FILE,
    SequenceRecord,
    data_cache_key,
    prepare_training_data,
    self_written_prompts,
)
from dflash_doctor.rundir.ownership import claim_run_dir, release_run_dir

if TYPE_CHECKING:
    from dflash_doctor.engine.target import CausalLM

TRAINING_LOG_FILE = "training_log.json"


@dataclass(frozen=True)
class TrainingOutcome:
    """What the CLI prints: where the draft went, how far training got, and the held-out tau per class
    (``evaluation``: training_log.json's block, None when nothing was held out)."""

    out_dir: Path
    steps: int
    final_step: int
    final_loss: float
    evaluation: dict[str, Any] | None


def holds_training(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds what an earlier train-draft wrote (its checkpoint, cached data or log): the
    command goes on there (resumes, or rewrites the outputs of a finished training)."""
    return any(
        (out_dir / name).exists()
        for name in (CHECKPOINT_DIR_NAME, SEQUENCES_FILE, SELF_WRITTEN_PROMPTS_FILE, TRAINING_LOG_FILE)
    )


def trainable_kinds() -> dict[str, TrainingRecipe]:
    """The registered kinds train-draft trains (those with a recipe), in registry order."""
    kinds = (get_draft_kind(name) for name in kind_names() if name != AUTO)
    return {kind.name: kind.training for kind in kinds if kind.training is not None}


def recipe_for(request: TrainDraftRequest) -> TrainingRecipe:
    """The recipe of ``--draft-kind``; a kind train-draft does not train, or a flag that shapes another kind
    only (a mistake, not a no-op), is a UsageError."""
    trainable = trainable_kinds()
    recipe = trainable.get(request.draft_kind)
    if recipe is None:
        raise UsageError(
            f"--draft-kind {request.draft_kind!r} is not one train-draft trains; pass {' or '.join(trainable)}."
        )
    for other in trainable.values():
        for flag, name in other.own_flags if other is not recipe else ():
            if getattr(request, name) not in (None, False):
                raise UsageError(
                    f"{flag} shapes {other.owner} only and means nothing with --draft-kind "
                    f"{request.draft_kind}; drop it or change --draft-kind."
                )
    return recipe


def _checked(request: TrainDraftRequest) -> tuple[TrainDraftRequest, TrainingRecipe]:
    """The request with its defaults filled (device, dtype, seed, workload) and its recipe; every flag that
    can be judged without loading anything is judged here, before --out is claimed."""
    device = request.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device} was asked for but no CUDA device is available; use --device cpu.")
    for flag, value in {
        "--max-new-tokens": request.max_new_tokens,
        "--generation-batch-size": request.generation_batch_size,
    }.items():
        if value < 1:
            raise UsageError(f"{flag} {value} must be at least 1.")
    for flag, value in {
        "--extra-word-problems": request.extra_word_problems,
        "--self-written-prompts": request.self_written_prompts,
    }.items():
        if value < 0:
            raise UsageError(f"{flag} {value} must be 0 or more.")
    recipe = recipe_for(request)
    recipe.check(request)
    if request.init_from and request.init_from_target:
        raise UsageError("--init-from and --init-from-target both say where the draft starts; pass one of them.")
    if request.time_limit is not None and request.time_limit <= 0:
        raise UsageError(f"--time-limit {request.time_limit} must be positive (seconds).")
    if request.eval_requests < 0:
        raise UsageError(f"--eval-requests {request.eval_requests} must be 0 or more.")
    filled = dataclasses.replace(
        request,
        device=device,
        dtype=request.dtype or ("bfloat16" if device.startswith("cuda") else "float32"),
        seed=0 if request.seed is None else request.seed,
        workload=request.workload or "mix",
    )
    return filled, recipe


def train_draft(request: TrainDraftRequest, say: Callable[[str], None]) -> TrainingOutcome:
    """Train or fine-tune the draft ``request`` asks for; writes the draft, a model card and training_log.json
    into --out (resumes an earlier training there). ``say`` prints the progress lines.

    --out is this process's while it runs: a second train-draft (or any dflash-doctor command) on it
    exits 2; a folder left by a killed one is taken over.
    """
    command_started = time.perf_counter()
    request, recipe = _checked(request)
    assert request.seed is not None and request.workload is not None and request.device is not None
    seed, workload = request.seed, request.workload
    config = TrainConfig(
        steps=request.steps,
        batch_size=request.batch_size,
        anchors_per_sequence=request.anchors_per_sequence,
        lr=request.lr,
        loss_decay_gamma=request.loss_decay_gamma,
        seed=seed if request.batch_seed is None else request.batch_seed,
        device=request.device,
        checkpoint_every=request.checkpoint_every,
    )
    flag, name = recipe.layer_ids_flag
    layer_ids = None if getattr(request, name) is None else parse_layer_ids(getattr(request, name), flag)
    class_list = tuple(c.strip() for c in (request.classes or "").split(",") if c.strip())
    requests = load_workload(workload, classes=class_list, max_requests=request.max_requests, seed=seed, split="train")
    requests += extra_word_problems(request.extra_word_problems) if request.extra_word_problems else []
    if request.use_recorded_responses and not any(r.response is not None and r.num_turns == 1 for r in requests):
        raise UsageError(
            f"--use-recorded-responses: workload {workload} has no single-turn request with a recorded "
            "`response`; drop the flag or use a file whose lines carry a response."
        )

    out_dir = Path(request.out)
    claim_run_dir(out_dir, overwrite=request.overwrite, continuable=holds_training)
    if request.overwrite:
        remove_checkpoint(out_dir / CHECKPOINT_DIR_NAME)  # train afresh: the earlier run's resumable state goes
    try:
        return _train_in(out_dir, request, recipe, config, layer_ids, requests, class_list, command_started, say)
    finally:
        release_run_dir(out_dir)


def _train_in(
    out_dir: Path,
    request: TrainDraftRequest,
    recipe: TrainingRecipe,
    config: TrainConfig,
    layer_ids: list[int] | None,
    requests: list,
    class_list: tuple[str, ...],
    command_started: float,
    say: Callable[[str], None],
) -> TrainingOutcome:
    """:func:`train_draft` once --out is claimed: data, draft, training, held-out tau and the outputs."""
    target = _load_target(request)
    data = _training_data(out_dir, request, target, requests, class_list, say)
    provenance = {
        **target.template_record,
        "trained_with": f"dflash-doctor {__version__} train-draft",
        "target": target.spec,
        "target_weights_fingerprint": weights_fingerprint(target.model),
    }
    deadline = None if request.time_limit is None else command_started + request.time_limit
    built = recipe.build(
        BuildInputs(
            request,
            layer_ids,
            target.model,
            target.tokenizer,
            data.records,
            target.served_template,
            target.spec,
            provenance,
        )
    )
    trained = _train_between_evaluations(out_dir, request, recipe, config, target, data, built, deadline)
    save_draft(trained.result.draft, out_dir, built.extra_config)
    facts = _training_facts(request, recipe, config, target, data, built, trained)
    (out_dir / TRAINING_LOG_FILE).write_text(json.dumps(facts, indent=2) + "\n", encoding="utf-8")
    (out_dir / "README.md").write_text(model_card(facts, recipe), encoding="utf-8")
    final_loss = trained.result.log[-1]["loss"] if trained.result.log else float("nan")
    return TrainingOutcome(out_dir, config.steps, trained.result.final_step, final_loss, trained.evaluation)


@dataclass(frozen=True)
class _Target:
    """The loaded target and what goes with it: the name it was given (``spec``), its folder, tokenizer, the
    chat template of --chat-template (``template_text``, None: the tokenizer's) and the one it serves, and
    the ids that end an answer."""

    spec: str
    folder: Path
    tokenizer: Any
    template_text: str | None
    served_template: str | None
    template_record: dict[str, Any]
    model: CausalLM
    stop_ids: frozenset[int]


def _load_target(request: TrainDraftRequest) -> _Target:
    """Load --target (default: the demo target) with its tokenizer in the request's dtype on its device: the
    data, the draft and the held-out walks all read it."""
    from transformers import AutoTokenizer  # heavy: loaded when a training starts

    assert request.dtype is not None and request.device is not None  # from _checked
    spec = request.target or str(demo_target_path())
    target_dir = resolve_model_dir(spec)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    template_text = read_chat_template(request.chat_template) if request.chat_template else None
    served_template = template_text or getattr(tokenizer, "chat_template", None)
    model = load_causal_lm(target_dir, dtype=request.dtype, device=request.device)
    stop_ids = stop_ids_of(model, tokenizer)
    template_record = chat_template_record(served_template)
    return _Target(spec, target_dir, tokenizer, template_text, served_template, template_record, model, stop_ids)


@dataclass(frozen=True)
class _Data:
    """The train requests (the workload's, the extra word problems and the target's own prompts), their
    sequences (``records``), the held-out sequences and the wall time spent getting them."""

    requests: list
    records: list[SequenceRecord]
    eval_records: list[SequenceRecord]
    seconds: float


def _training_data(
    out_dir: Path,
    request: TrainDraftRequest,
    target: _Target,
    requests: list,
    class_list: tuple[str, ...],
    say: Callable[[str], None],
) -> _Data:
    """The target's own answers to the train requests and to the held-out split of a built-in workload,
    read from --out's caches where they hold them for this target, answer length, dtype and template (a
    resumed or repeated training does not generate them again), generated otherwise."""
    seed, workload = request.seed, request.workload
    assert seed is not None and workload is not None and request.dtype is not None  # from _checked
    cache_key = data_cache_key(
        target.folder,
        max_new_tokens=request.max_new_tokens,
        dtype=request.dtype,
        chat_template=target.served_template,
        use_recorded_responses=request.use_recorded_responses,
    )
    data_started = time.perf_counter()
    if request.self_written_prompts:
        requests = requests + self_written_prompts(
            target.model,
            target.tokenizer,
            request.self_written_prompts,
            cache_path=out_dir / SELF_WRITTEN_PROMPTS_FILE,
            cache_key=cache_key,
            stop_ids=target.stop_ids,
            chat_template=target.template_text,
            batch_size=request.generation_batch_size,
            seed=seed,
            generate=not request.cached_data_only,
        )
    say(f"[bold]train-draft[/]: {len(requests)} train requests from {workload} -> {out_dir}")
    held_out = (
        load_workload(workload, classes=class_list, max_requests=request.eval_requests, seed=seed, split="eval")
        if request.eval_requests and workload in BUILTIN_NAMES
        else []
    )
    records, eval_records = prepare_training_data(
        target.model,
        target.tokenizer,
        requests,
        held_out,
        out_dir=out_dir,
        cache_key=cache_key,
        max_new_tokens=request.max_new_tokens,
        stop_ids=target.stop_ids,
        chat_template=target.template_text,
        use_recorded_responses=request.use_recorded_responses,
        samples_per_prompt=request.samples_per_prompt,
        sample_temperature=request.sample_temperature,
        batch_size=request.generation_batch_size,
        seed=seed,
        generate=not request.cached_data_only,
    )
    return _Data(requests, records, eval_records, time.perf_counter() - data_started)


@dataclass(frozen=True)
class _Trained:
    """The training's result, the held-out tau before and after it (None when nothing was held out), and
    the wall times of the two parts."""

    result: TrainingResult
    evaluation: dict[str, Any] | None
    train_seconds: float
    eval_seconds: float


def _train_between_evaluations(
    out_dir: Path,
    request: TrainDraftRequest,
    recipe: TrainingRecipe,
    config: TrainConfig,
    target: _Target,
    data: _Data,
    built: BuiltDraft,
    deadline: float | None,
) -> _Trained:
    """Train the built draft by its kind's recipe (resumable checkpoints under --out, stopped at
    ``deadline``), with the held-out tau walked before and after: the card shows what training gained."""
    eval_records, stop_ids = data.eval_records, target.stop_ids
    train_started = time.perf_counter()
    initial_steps = (
        held_out_steps(target.model, built.draft.to(request.device), eval_records, stop_ids=stop_ids, k=built.eval_k)
        if eval_records
        else []
    )
    result = recipe.train(
        target.model,
        [r.token_ids for r in data.records],
        [r.prompt_length for r in data.records],
        config,
        built,
        checkpoint_dir=out_dir / CHECKPOINT_DIR_NAME,
        feature_batch_size=min(64, request.generation_batch_size),
        progress=True,
        deadline=deadline,
    )
    train_seconds = time.perf_counter() - train_started
    evaluation = None
    if eval_records:
        trained_steps = held_out_steps(target.model, result.draft, eval_records, stop_ids=stop_ids, k=built.eval_k)
        evaluation = {
            "num_requests": len({r.request_id for r in eval_records}),
            "trained": tau_by_class(trained_steps),
            "initial": tau_by_class(initial_steps),
        }
    return _Trained(result, evaluation, train_seconds, time.perf_counter() - train_started - train_seconds)


def _training_facts(
    request: TrainDraftRequest,
    recipe: TrainingRecipe,
    config: TrainConfig,
    target: _Target,
    data: _Data,
    built: BuiltDraft,
    trained: _Trained,
) -> dict[str, Any]:
    """What training_log.json holds and the model card is written from: the tool, the target, the draft's
    start and architecture, the hyper-parameters, the data, the loss log, the held-out tau and the wall
    times (a segment's budget is planned from them)."""
    result = trained.result
    responses = (
        "recorded `response` of single-turn requests, the rest regenerated by the target (batched greedy)"
        if request.use_recorded_responses
        else "regenerated by the target (batched greedy)"
    )
    return {
        "tool_version": __version__,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "target": target.spec,
        "draft_kind": request.draft_kind,
        "init_from": built.init_note,
        "architecture": recipe.architecture(built, result.draft),
        "mask_choice": built.mask_choice,
        "chat_template_sha256": target.template_record["chat_template_sha256"],
        "train_config": config.as_dict(),
        "data": {
            "workload": request.workload,
            "num_requests": len(data.requests),
            "extra_word_problems": request.extra_word_problems,
            "self_written_prompts": request.self_written_prompts,
            "samples_per_prompt": request.samples_per_prompt,
            "sample_temperature": request.sample_temperature,
            "num_sequences": result.num_sequences,
            "num_response_tokens": sum(len(r.response_ids) for r in data.records),
            "max_new_tokens": request.max_new_tokens,
            "responses": responses,
        },
        "resumed_from_step": result.resumed_from_step,
        "final_step": result.final_step,
        # wall time of this invocation: a segment's budget is planned from them (data read from the cache takes seconds)
        "seconds": {
            "data": data.seconds,
            "initial_eval_and_train": trained.train_seconds,
            "final_eval": trained.eval_seconds,
        },
        "log": result.log,
        "evaluation": trained.evaluation,
    }
