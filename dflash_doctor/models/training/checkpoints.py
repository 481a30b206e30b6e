"""Resumable checkpoints of a training run: the draft, AdamW's moments and the loop's state, written in pieces
of at most :data:`CHECKPOINT_PIECE_BYTES` (transformers' sharded layout, nothing pickled) and replaced
atomically; a resume checks every piece's size and sha256 and the run's identity (hyper-parameters,
architecture, data, starting weights) before it continues bit for bit.

Its own module because the file format is a contract between runs (a copy of the pieces resumes elsewhere),
independent of how the loop computes a step.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch

from dflash_doctor.engine.dflash_model import DFlashDraftModel
from dflash_doctor.engine.eagle3_model import Eagle3DraftModel
from dflash_doctor.errors import UsageError
from dflash_doctor.models.loading import save_dflash_draft, weights_fingerprint
from dflash_doctor.models.training.eagle3_head import save_eagle3_head
from dflash_doctor.models.training.hyperparams import BOOKKEEPING_FIELDS, TrainConfig


CHECKPOINT_DIR_NAME = "checkpoint"  # resumable state inside the out dir
TRAINING_STATE_FILE = "training_state.json"  # step, loss log, scheduler, RNG, identity and the list of the other pieces
OPTIMIZER_DIR_NAME = (
    "optimizer"  # AdamW's tensors; beside the weights, a loader of the draft would read them as weights
)
CHECKPOINT_PIECE_BYTES = (
    15 * 2**20
)  # shard size: with its header every piece stays under 16 MiB (a common per-file limit of copy channels)


# What save_checkpoint writes into TRAINING_STATE_FILE: a file without one of them is not a whole checkpoint.
_STATE_KEYS = frozenset(
    {"identity", "step", "log", "scheduler", "optimizer_param_groups", "generator", "window", "pieces"}
)


def data_fingerprint(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> str:
    digest = hashlib.sha256()
    for tokens, prompt_length in zip(sequences, prompt_lengths):
        digest.update(json.dumps([prompt_length, list(tokens)]).encode())
    return digest.hexdigest()[:20]


def _architecture(draft: DFlashDraftModel | Eagle3DraftModel) -> dict[str, Any]:
    """The draft's config dataclass as JSON values (a scaled RoPE's frequencies as a list). An EAGLE-3 head adds
    its kind and its vocabulary map, which the data chose and no parameter records; a DFlash draft's stays what
    earlier checkpoints recorded, so they still resume."""
    fields = {
        k: v.tolist() if isinstance(v, torch.Tensor) else v
        for k, v in dataclasses.asdict(draft.config).items()
        if k != "extra"
    }
    if isinstance(draft, Eagle3DraftModel):
        fields |= {"kind": "eagle3", "d2t_sha256": hashlib.sha256(draft.d2t.cpu().numpy().tobytes()).hexdigest()[:20]}
    return fields


def resume_identity(config: TrainConfig, draft: DFlashDraftModel | Eagle3DraftModel, data: str) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed: hyper-parameters, architecture, data and starting weights
    (``draft`` before training: a fresh one from the seed, or an ``--init-from`` draft)."""
    train = {k: v for k, v in config.as_dict().items() if k not in BOOKKEEPING_FIELDS}
    return {
        "train_config": train,
        "architecture": _architecture(draft),
        "data": data,
        "init": weights_fingerprint(draft),
    }


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def save_draft(
    draft: DFlashDraftModel | Eagle3DraftModel,
    folder: Path,
    extra_config: dict[str, Any] | None,
    max_shard_bytes: int | str = "5GB",
) -> None:
    """The draft as a folder its kind's loader reads: a DFlash draft in the z-lab layout (``extra_config`` added to
    its config.json), an EAGLE-3 head in the speculators layout (``extra_config`` IS its config.json: the module
    does not know its layer config, its K or its target)."""
    if isinstance(draft, Eagle3DraftModel):
        if extra_config is None:
            raise ValueError(
                "an EAGLE-3 head is saved with its config.json (eagle3_head.speculators_config) as extra_config"
            )
        save_eagle3_head(draft, folder, extra_config, max_shard_bytes=max_shard_bytes)
    else:
        save_dflash_draft(draft, folder, extra_config=extra_config, max_shard_bytes=max_shard_bytes)


def save_checkpoint(
    path: Path, draft: DFlashDraftModel | Eagle3DraftModel, state: dict[str, Any], extra_config: dict[str, Any] | None
) -> None:
    """Write a resumable checkpoint in pieces of at most
    :data:`CHECKPOINT_PIECE_BYTES`, replacing the old one atomically.

    Why pieces: a checkpoint must survive being copied through channels that take files of 16 MiB at
    most; nothing in it is pickled. The layout follows
    transformers' sharded checkpoints: ``config.json`` + ``model-0000i-of-0000n.safetensors`` +
    ``model.safetensors.index.json`` (the draft itself, loadable as is: :func:`save_draft`),
    ``optimizer/optimizer-*.safetensors`` (+ index; AdamW's per-parameter tensors keyed ``<parameter index>.<name>``)
    and :data:`TRAINING_STATE_FILE` (identity, step, loss log, scheduler, optimizer hyper-parameters, the data
    generator's state, and the size and sha256 of every other piece, so a resume refuses a missing or
    cut-short copy instead of training from it).
    """
    from huggingface_hub import save_torch_state_dict

    staging = path.with_name(path.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)
    save_draft(draft, staging, extra_config, max_shard_bytes=CHECKPOINT_PIECE_BYTES)
    optimizer = state["optimizer"]
    moments = {
        f"{index}.{name}": tensor.detach().cpu()
        for index, entries in optimizer["state"].items()
        for name, tensor in entries.items()
    }
    (staging / OPTIMIZER_DIR_NAME).mkdir()
    save_torch_state_dict(
        moments,
        staging / OPTIMIZER_DIR_NAME,
        filename_pattern="optimizer{suffix}.safetensors",
        max_shard_size=CHECKPOINT_PIECE_BYTES,
        metadata={"format": "pt"},
    )
    pieces = {
        piece.relative_to(staging).as_posix(): {"bytes": piece.stat().st_size, "sha256": _sha256(piece)}
        for piece in sorted(staging.rglob("*"))
        if piece.is_file()
    }
    record = {
        "identity": state["identity"],
        "step": state["step"],
        "log": state["log"],
        "scheduler": state["scheduler"],
        "optimizer_param_groups": optimizer["param_groups"],
        "generator": base64.b64encode(state["generator"].numpy().tobytes()).decode("ascii"),
        "window": state["window"],
        "pieces": pieces,
    }
    (staging / TRAINING_STATE_FILE).write_text(json.dumps(record) + "\n", encoding="utf-8")
    previous = path.with_name(path.name + ".old")
    if path.exists():
        path.replace(previous)
    staging.replace(path)
    if previous.exists():
        shutil.rmtree(previous)


def remove_checkpoint(path: Path) -> None:
    """Remove the checkpoint in ``path`` and what an interrupted :func:`save_checkpoint` left beside it (its
    ``.tmp`` staging, the moved-aside ``.old`` that :func:`load_checkpoint` would restore), so a run told
    to start afresh cannot resume it."""
    for folder in (path, path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")):
        shutil.rmtree(folder, ignore_errors=True)


def _identity_difference(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """What differs between a checkpoint's identity and this run's, in words ("" when nothing does)."""
    saved_train = saved.get("train_config", {})
    parts = [
        f"{name} {saved_train.get(name)} there, {value} now"
        for name, value in current["train_config"].items()
        if saved_train.get(name) != value
    ]
    parts += [
        f"other {words}"
        for key, words in (
            ("architecture", "draft architecture"),
            ("data", "training sequences"),
            ("init", "starting weights"),
        )
        if saved.get(key) != current[key]
    ]
    return "; ".join(parts)


def _progress_problem(record: dict[str, Any], steps: int, moment_steps: set[float]) -> str:
    """What is wrong with a checkpoint's claimed progress, in words ("" when nothing is).

    A resume is refused, not clamped or repaired, when the step is not a whole number in ``0..steps``
    (``steps`` is the run's ``--steps``, which the identity already matched) or disagrees with what the
    checkpoint's other parts record of it: the scheduler's position, the loss log's rows and the half-summed
    row after them, and AdamW's per-parameter step count in the (sha256-checked) optimizer pieces. Such a
    state was edited or mixed from two checkpoints; clamping it to ``steps`` would end the run at once with
    a draft and a loss log that belong to no step, and going on from it would not be the run the identity
    names, so the only sound answers are another copy of the checkpoint or a fresh start.
    """
    step = record["step"]
    if not isinstance(step, int) or isinstance(step, bool):
        return f"its step {step!r} is not a whole number"
    if not 0 <= step <= steps:
        return f"it claims step {step} of a {steps}-step run"
    try:
        scheduler_step = record["scheduler"]["last_epoch"]
        log_steps = [row["step"] for row in record["log"]]
        window_steps = record["window"]["steps"]
    except (KeyError, TypeError):
        return "its scheduler, loss log or running loss-log row is not what a checkpoint writes"
    if scheduler_step != step:
        return f"it claims step {step} but its learning-rate schedule stands at step {scheduler_step}"
    if (
        any(not isinstance(s, int) or isinstance(s, bool) for s in log_steps)
        or log_steps != sorted(set(log_steps))
        or any(not 0 < s <= step for s in log_steps)
    ):
        return (
            f"it claims step {step} but its loss log holds rows of "
            f"steps {log_steps[:3]}{'...' if len(log_steps) > 3 else ''}"
        )
    if window_steps != step - (log_steps[-1] if log_steps else 0):
        return f"it claims step {step} but its loss log and running row add up to another step"
    if moment_steps - {float(step)} or (step > 0 and not moment_steps):
        found = ", ".join(f"{s:g}" for s in sorted(moment_steps)) or "none"
        return f"it claims step {step} but its optimizer pieces were written at step {found}"
    return ""


def load_checkpoint(path: Path, identity: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """Weights and training state (on the CPU) of the checkpoint in ``path``; None when there is none.

    Every piece is checked against the size and sha256 :data:`TRAINING_STATE_FILE` lists before anything
    is read, and the run's identity (hyper-parameters, architecture, data, starting weights) must match:
    each failure is one sentence naming the piece or the difference (UsageError). So must the claimed
    progress (:func:`_progress_problem`): a step beyond ``--steps``, negative, or at odds with the checkpoint's
    other parts is refused.
    """
    from safetensors.torch import load_file

    previous = path.with_name(path.name + ".old")
    if (
        not path.exists() and previous.is_dir()
    ):  # killed between the two renames of save_checkpoint: the last one is whole
        previous.replace(path)
    state_file = path / TRAINING_STATE_FILE
    if not state_file.is_file():
        if path.is_dir() and any(path.iterdir()):
            raise UsageError(
                f"{path} holds checkpoint files but no {TRAINING_STATE_FILE} (the piece that lists the others); "
                "copy it too, or remove the folder to start afresh."
            )
        return None
    try:
        record = json.loads(state_file.read_text(encoding="utf-8"))
        pieces = dict(record["pieces"])
        if not _STATE_KEYS <= record.keys():
            raise KeyError(sorted(_STATE_KEYS - record.keys()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UsageError(
            f"{state_file} is cut short or damaged (not the JSON a checkpoint writes); copy it again."
        ) from None
    for name, expected in pieces.items():
        piece = path / name
        if not piece.is_file():
            raise UsageError(
                f"checkpoint piece {piece} is missing; copy all {len(pieces) + 1} pieces of the checkpoint "
                f"({TRAINING_STATE_FILE} lists them)."
            )
        if piece.stat().st_size != expected["bytes"]:
            raise UsageError(
                f"checkpoint piece {piece} has {piece.stat().st_size} bytes instead of {expected['bytes']} "
                "(cut short in a copy?); copy it again."
            )
        if _sha256(piece) != expected["sha256"]:
            raise UsageError(
                f"checkpoint piece {piece} is not the file the checkpoint wrote (sha256 differs); copy it again."
            )
    difference = _identity_difference(record["identity"], json.loads(json.dumps(identity)))
    if difference:
        raise UsageError(
            f"{path} holds the checkpoint of another training run ({difference}); resume it with its own flags "
            "(--steps too: its cosine schedule ends at its own steps), continue its finished draft with "
            "--init-from and a fresh --out (new optimizer and schedule), or start afresh with a fresh --out."
        )
    weights: dict[str, torch.Tensor] = {}
    optimizer_state: dict[int, dict[str, torch.Tensor]] = {}
    for name in pieces:
        if name.startswith(f"{OPTIMIZER_DIR_NAME}/") and name.endswith(".safetensors"):
            for key, tensor in load_file(path / name).items():
                index, _, entry = key.partition(".")
                optimizer_state.setdefault(int(index), {})[entry] = tensor
        elif name.endswith(".safetensors"):
            weights.update(load_file(path / name))
    moment_steps = {float(entries["step"]) for entries in optimizer_state.values() if "step" in entries}
    problem = _progress_problem(record, int(identity["train_config"]["steps"]), moment_steps)
    if problem:
        raise UsageError(
            f"{path} does not hold a state this run can continue ({problem}); copy the checkpoint again from the run "
            f"that wrote it, or remove {path} to start afresh."
        )
    generator = torch.frombuffer(bytearray(base64.b64decode(record["generator"])), dtype=torch.uint8)
    state = {
        "step": record["step"],
        "log": record["log"],
        "scheduler": record["scheduler"],
        "generator": generator,
        "window": record["window"],
        "optimizer": {"state": optimizer_state, "param_groups": record["optimizer_param_groups"]},
    }
    return weights, state
