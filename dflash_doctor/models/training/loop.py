"""The training loop (:func:`train_loop`) and the DFlash objective (:func:`train_dflash_draft`): the frozen
target's tapped features, anchors sampled inside each response, the block loss weighted by slot, AdamW with
warm-up and cosine decay.

Its own module because it is the recipe itself (the package docstring says why it looks as it does); data,
checkpoints and evaluation are its inputs and outputs. The loop takes the objective as a function, so an
EAGLE-3 head (:mod:`.eagle3`) trains through the same schedule, checkpoints, resumes and deadline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch
import torch.nn.functional as F

from dflash_doctor.engine.blocks import context_kv_for, draft_block_hidden
from dflash_doctor.engine.cache import accepts_logits_to_keep
from dflash_doctor.engine.dflash_model import DFlashDraftModel
from dflash_doctor.engine.eagle3_model import Eagle3DraftModel
from dflash_doctor.engine.target import TapRecorder, tap_points
from dflash_doctor.errors import UsageError
from dflash_doctor.models.training.checkpoints import data_fingerprint, load_checkpoint, resume_identity
from dflash_doctor.models.training.hyperparams import TrainConfig, TrainingResult
from dflash_doctor.models.training import checkpoints

if TYPE_CHECKING:
    from dflash_doctor.engine.target import CausalLM

#: One step's objective on a padded batch: (token_ids [N, T], lengths [N], features [N, T, F], anchors [N, A],
#: anchor_valid [N, A]) -> (weighted loss, number of labels, mean accepted tokens per block or chain).
Objective = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, int, torch.Tensor]
]


def _forward_without_logits(model: torch.nn.Module) -> dict[str, Any]:
    """Ask for one row of logits where the model allows it: features need hidden states, not [N, T, V] logits."""
    return {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}


@torch.inference_mode()
def extract_features(
    target_model: CausalLM,
    sequences: Sequence[Sequence[int]],
    hidden_state_indices: Sequence[int],
    *,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Concatenated taps ``[L_i, n*H]`` for every sequence: one frozen-target pass per sequence, batched.

    Sequences are grouped by length and right-padded; causal attention keeps every real row what an unpadded
    pass gives (to rounding: the kernels sum in another order), so no attention mask is needed. Only the taps
    are kept (hooks, :class:`~dflash_doctor.engine.target.TapRecorder`), not every layer's states. Results
    stay on ``device`` in ``dtype`` (default: the target's).
    """
    extra = _forward_without_logits(target_model)
    model_device = next(target_model.parameters()).device
    points = tap_points(target_model)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    features: dict[int, torch.Tensor] = {}  # by sequence index: computed in length order, returned in input order
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(sequences[i]) for i in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, index in enumerate(chunk):
            ids[row, : len(sequences[index])] = torch.tensor(list(sequences[index]))
        with TapRecorder(points, tuple(hidden_state_indices)) as recorder:  # the taps only, not every layer's states
            target_model(input_ids=ids.to(model_device), **extra)
        taps = recorder.features(model_device)  # [n, width, F]
        for row, index in enumerate(chunk):
            features[index] = taps[row, : len(sequences[index])].to(device, dtype=dtype or taps.dtype).clone()
    return [features[i] for i in range(len(sequences))]


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weight of slots 1..B-1: ``exp(-(j - 1) / gamma)`` -> [B-1], 1.0 for the first drafted slot."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def sample_anchors(
    prompt_lengths: torch.Tensor, lengths: torch.Tensor, width: int, num_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct anchors ``[N, A]`` in each response (positions ``P_i .. L_i - 2``) and their validity.

    An anchor needs one label after it, hence ``L_i - 2``; rows with fewer usable positions than A are
    filled with invalid anchors.
    """
    positions = torch.arange(width)
    usable = (positions >= prompt_lengths[:, None]) & (positions <= lengths[:, None] - 2)
    scores = torch.rand(usable.shape, generator=generator).masked_fill(~usable, -1.0)
    top = scores.topk(min(num_anchors, width), dim=1)
    return top.indices, top.values >= 0


def block_loss(
    draft: DFlashDraftModel,
    target_model: CausalLM,
    token_ids: torch.Tensor,
    lengths: torch.Tensor,
    features: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    weights: torch.Tensor,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Decay-weighted cross-entropy of every block, the number of labels, and accepted tokens per block.

    token_ids [N, T], lengths [N], features [N, T, F], anchors / anchor_valid [N, A], weights [B-1].
    "Accepted per block" counts the leading slots whose argmax equals the label: what a live step at
    K = B-1 would accept on these sequences (a running estimate of tau - 1).
    """
    block_size = draft.config.block_size
    n, width = token_ids.shape
    embedding = cast(torch.nn.Embedding, target_model.get_input_embeddings())
    hidden = draft_block_hidden(
        draft, embedding.weight, token_ids, context_kv_for(draft, features), anchors, anchor_valid, block_size
    )  # [N, A, B, H]
    label_positions = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)  # [N, A, B-1]
    label_valid = anchor_valid[:, :, None] & (label_positions < lengths[:, None, None])
    labels = token_ids.gather(1, label_positions.clamp(max=width - 1).view(n, -1)).view_as(label_positions)
    rows = hidden[:, :, 1:][label_valid]  # [M, H]
    head = cast(torch.nn.Linear, target_model.get_output_embeddings())  # a causal LM's vocabulary head
    logits = head(rows.to(head.weight.dtype)).float()  # [M, V]
    targets = labels[label_valid]
    row_weights = weights.to(logits.device).expand_as(label_positions)[label_valid]
    loss = (row_weights * F.cross_entropy(logits, targets, reduction="none")).sum() / row_weights.sum()
    with torch.no_grad():
        correct = torch.zeros_like(label_valid)
        correct[label_valid] = logits.argmax(dim=-1) == targets
        accepted = correct.long().cumprod(dim=-1).sum(dim=-1)[anchor_valid]  # [valid blocks]
    return loss, targets.numel(), accepted.float().mean()


def _lr_factor(step: int, total_steps: int, warmup_steps: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train_dflash_draft(
    target_model: CausalLM,
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    config: TrainConfig,
    draft: DFlashDraftModel,
    *,
    checkpoint_dir: Path | None = None,
    extra_config: dict[str, Any] | None = None,
    feature_batch_size: int = 8,
    features: Sequence[torch.Tensor] | None = None,
    deadline: float | None = None,
    progress: bool = False,
) -> TrainingResult:
    """Train a DFlash ``draft`` by :func:`block_loss` through :func:`train_loop` (whose docstring says what the
    arguments do)."""
    weights = slot_weights(draft.config.block_size, config.loss_decay_gamma).to(config.device)

    def objective(
        token_ids: torch.Tensor,
        lengths: torch.Tensor,
        features: torch.Tensor,
        anchors: torch.Tensor,
        anchor_valid: torch.Tensor,
    ) -> tuple[torch.Tensor, int, torch.Tensor]:
        return block_loss(draft, target_model, token_ids, lengths, features, anchors, anchor_valid, weights)

    return train_loop(
        target_model,
        sequences,
        prompt_lengths,
        config,
        draft,
        objective,
        checkpoint_dir=checkpoint_dir,
        extra_config=extra_config,
        feature_batch_size=feature_batch_size,
        features=features,
        deadline=deadline,
        progress=progress,
    )


def train_loop(
    target_model: CausalLM,
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    config: TrainConfig,
    draft: DFlashDraftModel | Eagle3DraftModel,
    objective: Objective,
    *,
    checkpoint_dir: Path | None = None,
    extra_config: dict[str, Any] | None = None,
    feature_batch_size: int = 8,
    features: Sequence[torch.Tensor] | None = None,
    deadline: float | None = None,
    progress: bool = False,
) -> TrainingResult:
    """Train ``draft`` (a new one, or a checkpoint to fine-tune)
    on ``sequences`` against the frozen target by ``objective``.

    ``sequences[i]`` is prompt + response token ids and ``prompt_lengths[i]`` where the response starts.
    With ``checkpoint_dir``, a resumable checkpoint (:func:`~dflash_doctor.models.training.checkpoints.save_checkpoint`:
    pieces under 16 MiB) is written every ``config.checkpoint_every`` steps and at the end, and a run started on a
    directory that holds one continues from it bit for bit: the same weights and loss log as a run never stopped. It
    needs the same hyper-parameters, architecture, data and starting weights; ``config.steps`` too, because
    the cosine schedule is laid out over them (a longer run from a finished draft is a new run that starts
    from it: ``--init-from``, fresh AdamW moments, its own warm-up and cosine). The target's parameters are
    frozen in place (``requires_grad_(False)``).
    ``extra_config`` is what :func:`~dflash_doctor.models.training.checkpoints.save_checkpoint` writes beside the
    weights (its docstring says per kind). ``features`` (one ``[L_i, n*H]`` tensor per sequence, from
    :func:`extract_features` with the draft's taps) skips the frozen-target pass: runs that differ only in their
    hyper-parameters share it. ``deadline`` (a :func:`time.perf_counter`
    value) stops the run at the first loss-log row past it, with a
    checkpoint there: a command that must end by a time limit stops cleanly, and the same call later goes on
    bit for bit (a row boundary, so the resumed loss log is the uninterrupted one).
    """
    sequences, prompt_lengths, given_features = _usable_data(sequences, prompt_lengths, features)
    device = torch.device(config.device)
    target_model.requires_grad_(False).eval()
    draft.to(device=device, dtype=torch.float32)
    run = _start_or_resume(draft, config, data_fingerprint(sequences, prompt_lengths), checkpoint_dir, device)
    resumed_from_step = run.step
    # bf16 on CUDA: the draft reads them under bf16 autocast anyway, and it halves the memory of a large data set
    features = given_features or extract_features(
        target_model,
        sequences,
        draft.hidden_state_indices,
        batch_size=feature_batch_size,
        device=device,
        dtype=torch.bfloat16 if device.type == "cuda" else None,
    )
    batches = _Batches.of(sequences, prompt_lengths, features, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    draft.train()
    with _progress_bar(progress, config.steps, run.step) as show:
        while run.step < config.steps:
            batch = batches.draw(run.generator, config)
            with autocast:
                loss, num_labels, accepted = objective(*batch)
            _optimisation_step(draft, loss, run.optimizer, run.scheduler, config.grad_clip_norm)
            run.step += 1
            run.window.add(loss, accepted, num_labels)
            if run.step % config.log_every == 0 or run.step == config.steps:
                show(run.step, run.close_log_row())
                if deadline is not None and time.perf_counter() > deadline:
                    break
            if run.step % config.checkpoint_every == 0 and run.step < config.steps:
                run.save(checkpoint_dir, draft, extra_config)
    run.save(checkpoint_dir, draft, extra_config)
    draft.eval()
    return TrainingResult(
        draft=draft, log=run.log, resumed_from_step=resumed_from_step, num_sequences=len(sequences), final_step=run.step
    )


def _usable_data(
    sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], features: Sequence[torch.Tensor] | None
) -> tuple[list[list[int]], list[int], list[torch.Tensor] | None]:
    """The sequences (with their prompt lengths and given features) that can hold an anchor: two or more
    response tokens, one to draft from and one label after it. Lists that disagree in length are a caller's
    bug (ValueError); no usable sequence at all is the user's workload (UsageError)."""
    if len(sequences) != len(prompt_lengths) or (features is not None and len(features) != len(sequences)):
        raise ValueError(
            f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths"
            + (f" and {len(features)} feature tensors" if features is not None else "")
        )
    usable = [i for i, (tokens, p) in enumerate(zip(sequences, prompt_lengths)) if len(tokens) >= p + 2]
    if not usable:
        raise UsageError(
            "no training sequence has two or more response tokens; raise --max-new-tokens or use another workload."
        )
    given_features = [features[i] for i in usable] if features is not None else None
    return [list(sequences[i]) for i in usable], [int(prompt_lengths[i]) for i in usable], given_features


@dataclass
class _Window:
    """The loss-log row being summed (loss and accepted per block summed on the device, so a step does not wait
    for them). A checkpoint between two rows carries it, so the resumed loss log is the straight one."""

    loss_sum: torch.Tensor
    accepted_sum: torch.Tensor
    labels: int
    steps: int
    started: float

    @classmethod
    def of(cls, state: dict[str, Any] | None, device: torch.device) -> _Window:
        """The window a checkpoint saved (``state``), or an empty one for a fresh run."""
        saved = state or {"loss_sum": 0.0, "accepted_sum": 0.0, "labels": 0, "steps": 0}
        return cls(
            torch.full((), saved["loss_sum"], device=device),
            torch.full((), saved["accepted_sum"], device=device),
            saved["labels"],
            saved["steps"],
            time.perf_counter(),
        )

    def add(self, loss: torch.Tensor, accepted: torch.Tensor, num_labels: int) -> None:
        """Count one optimisation step's loss, accepted tokens and labels."""
        self.loss_sum += loss.detach()
        self.accepted_sum += accepted
        self.labels += num_labels
        self.steps += 1

    def state(self) -> dict[str, Any]:
        """The window as a checkpoint stores it (plain numbers: nothing in a checkpoint is pickled)."""
        return {
            "loss_sum": float(self.loss_sum),
            "accepted_sum": float(self.accepted_sum),
            "labels": self.labels,
            "steps": self.steps,
        }


@dataclass
class _Run:
    """What a training run carries from step to step and a checkpoint saves besides the weights: the
    optimiser and its schedule, the batch generator, the step, the loss log and the open row."""

    identity: dict[str, Any]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    generator: torch.Generator
    step: int
    log: list[dict[str, float]]
    window: _Window

    def close_log_row(self) -> dict[str, float]:
        """Append the loss-log row of the steps since the last one (means per step, the learning rate now,
        label tokens per second of wall time) and start the next row."""
        window = self.window
        elapsed = time.perf_counter() - window.started
        row = {
            "step": self.step,
            "loss": float(window.loss_sum) / window.steps,
            "accepted_per_block": float(window.accepted_sum) / window.steps,
            "lr": self.optimizer.param_groups[0]["lr"],
            "tokens_per_s": float(window.labels) / max(elapsed, 1e-9),
        }
        self.log.append(row)
        window.loss_sum.zero_()
        window.accepted_sum.zero_()
        window.labels, window.steps, window.started = 0, 0, time.perf_counter()
        return row

    def save(
        self,
        checkpoint_dir: Path | None,
        draft: DFlashDraftModel | Eagle3DraftModel,
        extra_config: dict[str, Any] | None,
    ) -> None:
        """Write the resumable checkpoint of this step (nothing without a checkpoint dir)."""
        if checkpoint_dir is not None:
            state = {
                "identity": self.identity,
                "step": self.step,
                "log": self.log,
                "optimizer": self.optimizer.state_dict(),
                "window": self.window.state(),
                "scheduler": self.scheduler.state_dict(),
                "generator": self.generator.get_state(),
            }
            checkpoints.save_checkpoint(checkpoint_dir, draft, state, extra_config)


def _start_or_resume(
    draft: DFlashDraftModel | Eagle3DraftModel,
    config: TrainConfig,
    data: str,
    checkpoint_dir: Path | None,
    device: torch.device,
) -> _Run:
    """AdamW with warm-up and cosine decay over ``config.steps`` and the seeded batch generator, at step 0, or
    where the checkpoint in ``checkpoint_dir`` left them (its weights loaded into ``draft``). The identity is
    taken from the starting weights before a checkpoint replaces them: a checkpoint resumes only the run that
    started from the same weights on the same ``data`` (its fingerprint)."""
    identity = resume_identity(config, draft, data)
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup_steps = max(1, round(config.warmup_fraction * config.steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, config.steps, warmup_steps))
    resumed = load_checkpoint(checkpoint_dir, identity) if checkpoint_dir is not None else None
    if resumed is None:
        return _Run(identity, optimizer, scheduler, generator, 0, [], _Window.of(None, device))
    weights, state = resumed
    own = draft.state_dict()  # a saved folder may carry tensors the module derives (an EAGLE-3 head's t2d)
    draft.load_state_dict({name: tensor for name, tensor in weights.items() if name in own})
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    generator.set_state(state["generator"])
    window = _Window.of(state["window"], device)
    return _Run(identity, optimizer, scheduler, generator, int(state["step"]), list(state["log"]), window)


@dataclass
class _Batches:
    """The training sequences as tensors, drawn from at random into padded batches."""

    token_tensors: list[torch.Tensor]  # on the device
    features: Sequence[torch.Tensor]
    prompt_lengths: torch.Tensor  # [N] on the CPU, where the anchors are drawn
    lengths: torch.Tensor  # [N]
    device: torch.device

    @classmethod
    def of(
        cls,
        sequences: list[list[int]],
        prompt_lengths: list[int],
        features: Sequence[torch.Tensor],
        device: torch.device,
    ) -> _Batches:
        """Each sequence's token ids on the device beside its features; the lengths stay on the CPU."""
        token_tensors = [torch.tensor(s, device=device) for s in sequences]
        return cls(
            token_tensors, features, torch.tensor(prompt_lengths), torch.tensor([len(s) for s in sequences]), device
        )

    def draw(
        self, generator: torch.Generator, config: TrainConfig
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next batch as the objective takes it: ``config.batch_size`` sequences drawn without replacement
        and ``config.anchors_per_sequence`` anchors in each, both from ``generator`` (so a resumed run draws
        what the straight one would), right-padded to the longest."""
        batch = torch.randperm(len(self.token_tensors), generator=generator)[: config.batch_size]
        lengths, batch_prompt_lengths = self.lengths[batch], self.prompt_lengths[batch]
        width = int(lengths.max())
        anchors, anchor_valid = sample_anchors(
            batch_prompt_lengths, lengths, width, config.anchors_per_sequence, generator
        )
        token_ids = torch.nn.utils.rnn.pad_sequence([self.token_tensors[i] for i in batch.tolist()], batch_first=True)
        batch_features = torch.nn.utils.rnn.pad_sequence([self.features[i] for i in batch.tolist()], batch_first=True)
        return token_ids, lengths.to(self.device), batch_features, anchors.to(self.device), anchor_valid.to(self.device)


def _optimisation_step(
    draft: torch.nn.Module,
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    grad_clip_norm: float,
) -> None:
    """One AdamW step down ``loss``'s gradient, clipped to ``grad_clip_norm``, and the schedule one step on."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), grad_clip_norm)
    optimizer.step()
    scheduler.step()


@contextmanager
def _progress_bar(enabled: bool, total: int, completed: int) -> Iterator[Callable[[int, dict[str, float]], None]]:
    """A progress bar over the steps (disabled: nothing printed, as in tests and sweeps); yields the function
    that shows a new loss-log row on it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TextColumn("accepted/block {task.fields[accepted]:.2f}"),
        TextColumn("{task.fields[tokens_per_s]:,.0f} label tok/s"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, disable=not enabled) as bar:
        task = bar.add_task(
            "train", total=total, completed=completed, loss=float("nan"), accepted=float("nan"), tokens_per_s=0.0
        )

        def show(step: int, row: dict[str, float]) -> None:
            bar.update(
                task,
                completed=step,
                loss=row["loss"],
                accepted=row["accepted_per_block"],
                tokens_per_s=row["tokens_per_s"],
            )

        yield show
