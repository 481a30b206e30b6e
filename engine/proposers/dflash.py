"""The DFlash block drafter (DFlash and DFlash 2): one pass over ``[last token, mask x K]`` per step.

Conditioned on the target's hidden states of ``target_layer_ids`` (HF ``hidden_states[l + 1]``). The
context K/V of every committed token is computed once, when the token is committed, and cached across
steps; the block's own K/V are dropped after the pass. How the drafted slots become tokens is the draft
module's business (:meth:`DFlashDraftModel.draft_tokens`: argmax / a sample per slot, or DFlash 2's
candidate walk), so this proposer serves every DFlash variant without asking which one it holds.

Under sampling, the serving engine decides how drafts are made (vLLM's ``draft_sample_method``):
``greedy`` (vLLM's default, SGLang) drafts the argmax and verification accepts it with p_target(x);
``probabilistic`` (the official ``dflash_generate``) samples drafts from the draft distribution and
verification is standard rejection sampling against it.
"""

from __future__ import annotations

import torch

from dflash_doctor.engine.blocks import context_kv_for, draft_block_hidden
from dflash_doctor.engine.dflash_model import DFlashDraftModel
from dflash_doctor.engine.proposers.base import Proposal, Proposer, TargetNeeds, required_features
from dflash_doctor.engine.target import TargetModel

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


class DFlashProposer(Proposer):
    kind = "dflash"
    guesses_depend_on_k = True

    def __init__(
        self,
        model: DFlashDraftModel,
        target: TargetModel,
        *,
        temperature: float = 0.0,
        draft_sample_method: str = "greedy",
        generator: torch.Generator | None = None,
    ):
        if draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method {draft_sample_method!r} is not one of {DRAFT_SAMPLE_METHODS}")
        self.model = model
        self.target = target
        self.needs = TargetNeeds(hidden_state_indices=model.hidden_state_indices)
        self.mask_token_id = model.config.mask_token_id
        self.draft_sample_method = draft_sample_method
        self.temperature = temperature
        self.generator = generator
        self.ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ctx_length = 0

    @property
    def max_k(self) -> int:
        return self.model.config.block_size - 1

    def samples_drafts(self, temperature: float) -> bool:
        return self.draft_sample_method == "probabilistic" and temperature > 0

    def _embedding_weight(self) -> torch.Tensor:
        return self.target.embedding.weight

    @torch.inference_mode()
    def _extend_context(self, features: torch.Tensor) -> None:
        """Append K/V rows for newly committed tokens (features [n, F]) at their absolute positions."""
        n = features.shape[0]
        positions = torch.arange(self.ctx_length, self.ctx_length + n, device=features.device)[None]
        new = self.model.context_kv(features[None].to(self.model.fc.weight.dtype), positions)
        if self.ctx_kv:
            self.ctx_kv = [
                (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2)) for (k, v), (nk, nv) in zip(self.ctx_kv, new)
            ]
        else:
            self.ctx_kv = new
        self.ctx_length += n

    def start(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None) -> None:
        self.ctx_kv, self.ctx_length = [], 0
        self._extend_context(required_features(prompt_features, "DFlash"))

    @torch.inference_mode()
    def propose(self, last_token: int, k: int, block_k: int) -> Proposal:
        device = self.model.fc.weight.device
        block = torch.full((block_k + 1,), self.mask_token_id, dtype=torch.long, device=device)
        block[0] = last_token
        positions = torch.arange(self.ctx_length, self.ctx_length + block_k + 1, device=device)[None]
        ctx_positions = torch.arange(self.ctx_length, device=device)[None]
        embeds = self.model.embed_block(self._embedding_weight(), block)[None]
        hidden = self.model(embeds, positions, self.ctx_kv, ctx_positions)  # [1, K+1, H]
        draft_temperature = self.temperature if self.samples_drafts(self.temperature) else 0.0
        tokens, scores, probs = self.model.draft_tokens(
            hidden[0, 1 : k + 1], last_token, self.target.head, draft_temperature, self.generator
        )
        return Proposal(tokens=tokens, logits=scores, probs=probs)

    def accept(self, committed_ids: torch.Tensor, committed_features: torch.Tensor | None) -> None:
        self._extend_context(required_features(committed_features, "DFlash"))

    @torch.inference_mode()
    def prepare_teacher(self, token_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        device = self.model.fc.weight.device
        self._teacher_ids = token_ids[None].to(device)
        self._teacher_ctx_kv = context_kv_for(self.model, required_features(features, "DFlash")[None].to(device))

    @torch.inference_mode()
    def slot_logits(self, anchors: torch.Tensor, k: int) -> torch.Tensor:
        """All blocks ``[token[a], mask x k]`` in one masked pass (engine/blocks.py), as the live loop drafts them.

        A plain DFlash draft's scores stay in the model's dtype (no float32 copy of [A, k, V]); callers
        that need probabilities upcast them.
        """
        hidden, previous = self._teacher_blocks(anchors, k)
        return self.model.teacher_scores(hidden, previous, self.target.head)  # [A, k, V]

    @torch.inference_mode()
    def slot_scorer(self, anchors: torch.Tensor, k: int):
        """The block pass now, the vocabulary head (most of the cost: [k, H] x [H, V] per anchor) per request."""
        hidden, previous = self._teacher_blocks(anchors, k)

        @torch.inference_mode()
        def scores(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            return self.model.teacher_scores(hidden[rows, slots], previous[rows, slots], self.target.head)

        return scores

    def _teacher_blocks(self, anchors: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [A, k, H] of the drafted slots of every block, and the true token before each slot [A, k].

        The context is cut after the last anchor: later keys are masked for every block anyway, and leaving
        them out removes up to half of the attention work. ``anchors`` may stay on the host (reading their
        maximum then costs no synchronisation). ``previous`` holds the true token before each slot (DFlash
        2's selector reads it).
        """
        bound = int(anchors.max()) + 1
        ids = self._teacher_ids
        anchors = anchors.to(ids.device, non_blocking=True)  # the pass's one host-to-device copy
        ctx_kv = [(key[:, :, :bound], value[:, :, :bound]) for key, value in self._teacher_ctx_kv]
        hidden = draft_block_hidden(
            self.model,
            self._embedding_weight(),
            ids[:, :bound],
            ctx_kv,
            anchors[None],
            torch.ones(anchors.shape, dtype=torch.bool, device=ids.device)[None],
            k + 1,
        )
        previous = (anchors[:, None] + torch.arange(k, device=ids.device)).clamp(max=ids.shape[1] - 1)
        return hidden[0, :, 1:], ids[0, previous]
