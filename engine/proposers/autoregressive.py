"""A classic autoregressive draft: K cached draft steps, each conditioned on the previous draft token.

Under sampling the draft samples from its own temperature-scaled distribution and returns it as
``probs`` so the verifier can apply the min(1, p/q) rule; at temperature 0 it drafts the argmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dflash_doctor.engine.cache import RollbackCache
from dflash_doctor.engine.proposers.base import Proposal, Proposer, TargetNeeds

if TYPE_CHECKING:
    from dflash_doctor.engine.target import CausalLM


class AutoregressiveProposer(Proposer):
    kind = "autoregressive"
    needs = TargetNeeds()

    def __init__(self, model: CausalLM, temperature: float = 0.0, generator: torch.Generator | None = None):
        self.model = model
        self.temperature = temperature
        self.generator = generator
        self.cache = RollbackCache(model)  # a hybrid draft (Qwen3.5-0.8B for a Qwen3.5 target) rolls back too
        self.uncached: list[int] = []  # committed tokens the draft cache has not seen yet

    def samples_drafts(self, temperature: float) -> bool:
        return temperature > 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def _step(self, token_ids: list[int]) -> torch.Tensor:
        return self.cache.forward(torch.tensor(token_ids, device=self.device)).logits[0, -1].float()

    def start(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None) -> None:
        self.cache.reset()
        self.uncached = prompt_ids.tolist()

    def propose(self, last_token: int, k: int, block_k: int) -> Proposal:
        self.cache.release()  # accept() rolls back within this proposal's forwards
        self._prefix_length = self.cache.length + len(self.uncached)  # committed, excluding last_token
        tokens, logits, probs = [], [], []
        feed = self.uncached + [last_token]
        if k > 0:
            self.uncached = []
        for _ in range(k):
            step_logits = self._step(feed)
            if self.temperature > 0:
                step_probs = torch.softmax(step_logits / self.temperature, dim=-1)
                token = int(torch.multinomial(step_probs, 1, generator=self.generator).item())
                probs.append(step_probs)
            else:
                token = int(step_logits.argmax().item())
            tokens.append(token)
            logits.append(step_logits)
            feed = [token]
        vocab = self.model.config.vocab_size
        return Proposal(
            tokens=torch.tensor(tokens, dtype=torch.long, device=self.device),
            logits=torch.stack(logits) if logits else torch.empty(0, vocab, device=self.device),
            probs=torch.stack(probs) if probs else None,
        )

    def accept(self, committed_ids: torch.Tensor, committed_features: torch.Tensor | None) -> None:
        # The cache now holds the committed prefix, last_token and d1..d(k-1): keep the committed part and
        # remember committed tokens it has not seen (the bonus, and d_k when all k were accepted).
        keep = self._prefix_length + len(committed_ids)
        cached = self.cache.length
        if cached > keep:
            self.cache.crop(keep)
            cached = keep
        if cached >= self._prefix_length:
            self.uncached = committed_ids[cached - self._prefix_length :].tolist()
        else:  # k == 0: nothing was fed this step
            self.uncached = self.uncached + committed_ids.tolist()

    @torch.inference_mode()
    def prepare_teacher(self, token_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        # One causal pass gives the guess for every position: slot j after anchor a is predicted from row a + j - 1.
        self._teacher_logits = self.model(input_ids=token_ids[None].to(self.device)).logits[0].float()  # [T, V]

    def slot_logits(self, anchors: torch.Tensor, k: int) -> torch.Tensor:
        rows = anchors[:, None] + torch.arange(k, device=anchors.device)  # [A, k]
        rows = rows.clamp(max=self._teacher_logits.shape[0] - 1)
        return self._teacher_logits[rows.to(self._teacher_logits.device, non_blocking=True)]
