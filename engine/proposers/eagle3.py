"""EAGLE-3 drafting as vLLM does it (``speculative_config = {"method": "eagle3", ...}``): a chain, by argmax.

Each step, with ``last`` the token the target just sampled (not yet in its cache):

1. **First pass** over the positions committed since the previous step: their ids shifted left by one
   (the row at position p takes the embedding of the token at p + 1; the last row takes ``last``), their
   target aux states combined by ``fc``, at the target's positions. The head's K/V of these rows are
   cached for every later step. The last row's logits give draft 1.
2. **Steps 2..K**: one row each, the previous draft token as input, the position after the previous row,
   and the state the head carried from that row. Their K/V are dropped after the step: vLLM overwrites
   them with the first-pass rows of the next step (which read the target's states instead).

Drafts are the argmax over the draft vocabulary, mapped to target ids through ``d2t``. vLLM passes no
draft probabilities for an EAGLE-3 chain, so under sampling verification treats each draft as a point
mass (accepted with the target's probability of it), as for any greedy draft.

Teacher forcing (the whole sequence known): slot 1 of anchor a (the step whose last committed token
sits at a) is the first pass's row at a - 1, computed once for the whole sequence. Slot j > 1 is only
read where slots < j matched, so the previous draft token is the true token: the chain runs on the true
tokens with the carried state, every anchor of a pass at once, each seeing the first-pass rows before it
and its own chain rows. A chain's slot j does not depend on K, so one pass at the largest K serves every K.
Both passes live beside the head (:func:`~dflash_doctor.engine.eagle3_model.teacher_chain_rows`): train-draft
trains the head through the same computation.
"""

from __future__ import annotations

from typing import Callable

import torch

from dflash_doctor.engine.eagle3_model import Eagle3DraftModel, KeyValue, teacher_chain_rows, teacher_first_pass
from dflash_doctor.engine.proposers.base import Proposal, Proposer, TargetNeeds, required_features
from dflash_doctor.engine.target import TargetModel


class Eagle3Proposer(Proposer):
    kind = "eagle3"
    guesses_depend_on_k = False

    def __init__(self, model: Eagle3DraftModel, target: TargetModel):
        self.model = model
        self.target = target
        self.needs = TargetNeeds(hidden_state_indices=model.hidden_state_indices)
        self._reset()

    def _reset(self) -> None:
        self.cached: KeyValue | None = None  # the head's K/V of every position whose first pass is committed
        self.length = 0  # positions in ``cached``
        self.pending_ids: list[int] = []  # committed tokens awaiting their first pass (their next token is unknown)
        self.pending_states: torch.Tensor | None = None
        self.drafted: KeyValue | None = None  # the pending rows' K/V as the last propose() computed them

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    def start(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None) -> None:
        self._reset()
        self.pending_ids, self.pending_states = prompt_ids.tolist(), required_features(prompt_features, "EAGLE-3")

    def accept(self, committed_ids: torch.Tensor, committed_features: torch.Tensor | None) -> None:
        """Keep the first-pass K/V of the previous pending rows (the step's propose() closed them with the token
        it was given, which is now committed) and make the newly committed rows pending."""
        if self.drafted is None:
            raise RuntimeError("Eagle3Proposer.accept() without a propose() since start() or the previous accept()")
        keys, values = self.drafted
        self.cached = (
            (keys, values)
            if self.cached is None
            else (torch.cat([self.cached[0], keys], dim=2), torch.cat([self.cached[1], values], dim=2))
        )
        self.length += keys.shape[2]
        self.pending_ids, self.pending_states, self.drafted = (
            committed_ids.tolist(),
            required_features(committed_features, "EAGLE-3"),
            None,
        )

    @torch.inference_mode()
    def _first_pass(self, last_token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the pending rows (ids shifted left, ``last_token`` closing them) after the cached ones; keep their K/V
        for accept() and return the last row's normed output and carried state [H] each. Proposing again
        before accept() recomputes them (what a timing loop that never commits measures, one step each time)."""
        model = self.model
        assert self.pending_states is not None, "start() first"
        ids = torch.tensor(self.pending_ids[1:] + [last_token], device=self.device)
        positions = torch.arange(self.length, self.length + len(ids), device=self.device)[None]
        states = model.combine(self.pending_states.to(self.device))[None]
        normed, carried, self.drafted = model(
            model.embed(ids, self.target.embedding)[None], states, positions, self.cached
        )
        return normed[0, -1], carried[0, -1]

    @torch.inference_mode()
    def propose(self, last_token: int, k: int, block_k: int) -> Proposal:
        model = self.model
        normed, carried = self._first_pass(last_token)
        assert self.drafted is not None
        chain = (
            self.drafted
            if self.cached is None
            else (
                torch.cat([self.cached[0], self.drafted[0]], dim=2),
                torch.cat([self.cached[1], self.drafted[1]], dim=2),
            )
        )
        tokens, logits = [], []
        for step in range(k):
            if step:
                position = torch.tensor([[chain[0].shape[2]]], device=self.device)  # after the previous row
                embeds = model.embed(tokens[-1].view(1, 1), self.target.embedding)
                out, state, (keys, values) = model(embeds, carried.view(1, 1, -1), position, chain)
                chain = (torch.cat([chain[0], keys], dim=2), torch.cat([chain[1], values], dim=2))
                normed, carried = out[0, -1], state[0, -1]
            row = model.target_logits(normed, self.target.head)
            logits.append(row)
            tokens.append(row.argmax())
        vocab = self.target.head.out_features
        return Proposal(
            tokens=torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long, device=self.device),
            logits=torch.stack(logits) if logits else torch.empty(0, vocab, device=self.device),
            probs=None,
        )

    # ----------------------------------------------------------------------------- teacher forcing

    @torch.inference_mode()
    def prepare_teacher(self, token_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        """The first pass over the whole sequence: every position's normed row, carried state and K/V."""
        self._teacher_ids = token_ids.to(self.device)[None]
        self._first = teacher_first_pass(
            self.model,
            self.target.embedding,
            self._teacher_ids,
            required_features(features, "EAGLE-3").to(self.device)[None],
        )

    @torch.inference_mode()
    def _chain_rows(self, anchors: torch.Tensor, k: int) -> torch.Tensor:
        """Normed rows [A, k, H] of slots 1..k of every anchor (:func:`teacher_chain_rows`, the computation
        train-draft trains), all anchors at once."""
        return teacher_chain_rows(
            self.model, self.target.embedding, self._teacher_ids, self._first, anchors.to(self.device)[None], k
        )[0]

    def slot_logits(self, anchors: torch.Tensor, k: int) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.target_logits(self._chain_rows(anchors, k), self.target.head)

    def slot_scorer(self, anchors: torch.Tensor, k: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The chain now, the vocabulary head only for the (anchor, slot) rows asked for."""
        rows = self._chain_rows(anchors, k)

        @torch.inference_mode()
        def scores(anchor_rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            return self.model.target_logits(rows[anchor_rows, slots], self.target.head)

        return scores
