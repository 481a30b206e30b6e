"""What one training run is asked to do (:class:`TrainConfig`, recorded in training_log.json and the model card)
and what it returns (:class:`TrainingResult`).

Its own module because the loop, the checkpoints (whose identity is the config) and the CLI all read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dflash_doctor.engine.dflash_model import DFlashDraftModel
from dflash_doctor.engine.eagle3_model import Eagle3DraftModel
from dflash_doctor.errors import UsageError


# TrainConfig fields that do not change what is learned: a resume may differ in these.
BOOKKEEPING_FIELDS = frozenset({"device", "checkpoint_every", "log_every"})


@dataclass
class TrainConfig:
    """Hyper-parameters of one training run (recorded in training_log.json and the model card)."""

    steps: int = 2000
    batch_size: int = 16  # sequences per step
    anchors_per_sequence: int = 16  # blocks per sequence per step (fewer when a response is shorter)
    lr: float = 6e-4  # peak learning rate of AdamW
    weight_decay: float = 0.01
    warmup_fraction: float = 0.04  # share of the steps with a linear warm-up; cosine decay to 0 after it
    grad_clip_norm: float = 1.0
    loss_decay_gamma: float = 7.0  # slot weight exp(-(j-1)/gamma); DFlash's paper uses 7 for blocks of 16
    seed: int = 0
    device: str = "cpu"
    checkpoint_every: int = 500  # steps between resumable checkpoints (when a checkpoint dir is given)
    log_every: int = 10  # steps between rows of the loss curve

    def __post_init__(self) -> None:
        positive = {
            "--steps": self.steps,
            "--batch-size": self.batch_size,
            "--anchors-per-sequence": self.anchors_per_sequence,
            "--lr": self.lr,
            "--loss-decay-gamma": self.loss_decay_gamma,
            "--checkpoint-every": self.checkpoint_every,
            "log_every": self.log_every,
        }
        for flag, value in positive.items():
            if not value > 0:
                raise UsageError(f"{flag} {value} must be positive; pass a value above 0.")
        if not 0 <= self.warmup_fraction < 1:
            raise UsageError(f"warmup_fraction {self.warmup_fraction} must be in [0, 1); pick a share of the steps.")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainingResult:
    """The trained draft (eval mode) and its loss curve."""

    draft: DFlashDraftModel | Eagle3DraftModel
    log: list[
        dict[str, float]
    ]  # rows {"step", "loss", "accepted_per_block" (an EAGLE-3 head: per chain), "lr", "tokens_per_s"}
    resumed_from_step: int  # 0 for a fresh run
    num_sequences: int  # sequences that had room for an anchor (two or more response tokens)
    final_step: int  # config.steps, or fewer when the deadline stopped the run (the checkpoint continues it)
