"""Train an EAGLE-3 head against a frozen target, in the layout it drafts in (training-time test).

Why this objective: an EAGLE-3 head drafts a chain, each step reading the state the previous step carried
(engine/proposers/eagle3.py). Trained on the first pass alone it would only ever see the target's states and
drift once it chains on its own; so each step runs, per training sequence,

1. the first pass over the whole sequence (ids shifted left by one, the target's aux states combined by
   ``fc``, causal attention: :func:`~dflash_doctor.engine.eagle3_model.teacher_first_pass`);
2. for anchors sampled inside the response (an anchor plays the last committed token of a live step),
   slot 1 from the first pass's row at a - 1 and slots 2..T by the chain on the true tokens with the carried
   state (:func:`~dflash_doctor.engine.eagle3_model.teacher_chain_rows`): the proposer's teacher-forced
   computation itself, with gradients, so the training layout IS the drafting layout;
3. cross-entropy over the DRAFT vocabulary, labels ``token[a + j]`` mapped target -> draft (a label outside
   the draft vocabulary is ignored: the head can never propose it), slots weighted ``exp(-(j - 1) / gamma)``
   (a miss at slot j throws away every later slot).

The rest is the DFlash recipe's loop (:func:`.loop.train_loop`): batches of padded sequences, AdamW, warm-up
and cosine, gradient clipping, bf16 autocast on CUDA, resumable checkpoints, the deadline.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, cast

import torch
import torch.nn.functional as F

from dflash_doctor.engine.eagle3_model import Eagle3DraftModel, teacher_chain_rows, teacher_first_pass
from dflash_doctor.models.training.hyperparams import TrainConfig, TrainingResult
from dflash_doctor.models.training.loop import slot_weights, train_loop

if TYPE_CHECKING:
    from dflash_doctor.engine.target import CausalLM

IGNORED = -100  # cross-entropy's ignore index: a label outside the draft vocabulary


def draft_index(head: Eagle3DraftModel) -> torch.Tensor:
    """The draft id of every target id [target vocab], :data:`IGNORED` for target ids outside the draft vocabulary."""
    index = torch.full((head.config.target_vocab_size,), IGNORED, dtype=torch.long, device=head.d2t.device)
    index[head.target_ids()] = torch.arange(head.config.draft_vocab_size, device=head.d2t.device)
    return index


def chain_rows(
    head: Eagle3DraftModel,
    embedding: torch.nn.Embedding,
    token_ids: torch.Tensor,
    features: torch.Tensor,
    anchors: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """Normed rows [N, A, k, H] of slots 1..k of every anchor of a right-padded batch (token_ids [N, T], features
    [N, T, n*Ht], anchors [N, A], each >= 1): the first pass, then the chain."""
    first = teacher_first_pass(head, embedding, token_ids, features)
    return teacher_chain_rows(head, embedding, token_ids, first, anchors, k)


def chain_loss(
    head: Eagle3DraftModel,
    embedding: torch.nn.Embedding,
    token_ids: torch.Tensor,
    lengths: torch.Tensor,
    features: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    weights: torch.Tensor,
    draft_of: torch.Tensor,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Decay-weighted cross-entropy of every chain over the draft vocabulary, the number of labels, and accepted
    tokens per chain (leading slots whose argmax is the label: what a live step at K = T accepts here).

    weights [T] (slot 1 first), draft_of [target vocab] from :func:`draft_index`. An anchor at 0 has no first-pass
    row before it and counts as invalid.
    """
    assert head.lm_head is not None, "train_eagle3_head checks that the head has its own lm_head"
    k = len(weights)
    n, width = token_ids.shape
    valid = anchor_valid & (anchors >= 1)
    anchors = torch.where(valid, anchors, torch.ones_like(anchors))  # invalid ones still need a row at a - 1
    rows = chain_rows(head, embedding, token_ids, features, anchors, k)  # [N, A, k, H]
    label_positions = anchors[:, :, None] + torch.arange(1, k + 1, device=anchors.device)  # [N, A, k]
    in_sequence = valid[:, :, None] & (label_positions < lengths[:, None, None])
    targets = token_ids.gather(1, label_positions.clamp(max=width - 1).view(n, -1)).view_as(label_positions)
    labels = draft_of[targets]
    trained = in_sequence & (labels != IGNORED)
    logits = head.lm_head(rows[trained]).float()  # [M, draft vocab]
    chosen = labels[trained]
    row_weights = weights.to(logits.device).expand_as(label_positions)[trained]
    loss = (row_weights * F.cross_entropy(logits, chosen, reduction="none")).sum() / row_weights.sum().clamp(min=1e-12)
    with torch.no_grad():
        correct = torch.zeros_like(trained)
        correct[trained] = logits.argmax(dim=-1) == chosen
        accepted = correct.long().cumprod(dim=-1).sum(dim=-1)[valid]
    return loss, chosen.numel(), accepted.float().mean()


def train_eagle3_head(
    target_model: CausalLM,
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    config: TrainConfig,
    head: Eagle3DraftModel,
    *,
    ttt_steps: int,
    head_config: dict[str, Any],
    checkpoint_dir: Path | None = None,
    feature_batch_size: int = 8,
    features: Sequence[torch.Tensor] | None = None,
    deadline: float | None = None,
    progress: bool = False,
) -> TrainingResult:
    """Train ``head`` by :func:`chain_loss` over ``ttt_steps`` chain slots through :func:`.loop.train_loop` (whose
    docstring says what the other arguments do); ``head_config`` is the config.json its checkpoints carry."""
    if head.lm_head is None:
        raise ValueError("an EAGLE-3 head without its own lm_head drafts with the target's and is not trained here")
    weights = slot_weights(ttt_steps + 1, config.loss_decay_gamma).to(config.device)
    draft_of = draft_index(head).to(config.device)
    embedding = cast(torch.nn.Embedding, target_model.get_input_embeddings())

    def objective(
        token_ids: torch.Tensor,
        lengths: torch.Tensor,
        batch_features: torch.Tensor,
        anchors: torch.Tensor,
        anchor_valid: torch.Tensor,
    ) -> tuple[torch.Tensor, int, torch.Tensor]:
        return chain_loss(head, embedding, token_ids, lengths, batch_features, anchors, anchor_valid, weights, draft_of)

    return train_loop(
        target_model,
        sequences,
        prompt_lengths,
        config,
        head,
        objective,
        checkpoint_dir=checkpoint_dir,
        extra_config=head_config,
        feature_batch_size=feature_batch_size,
        features=features,
        deadline=deadline,
        progress=progress,
    )
