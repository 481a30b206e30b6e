"""The target model as the engine sees it: incremental forwards with a croppable KV cache.

Wraps a transformers causal LM. Each forward returns the logits of the new tokens and, when a proposer
asked for them (:class:`~dflash_doctor.engine.proposers.base.TargetNeeds`), the concatenated hidden
states it taps. Cropping the cache after verification is how rejected draft tokens are rolled back.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from transformers import DynamicCache

if TYPE_CHECKING:
    # What AutoModelForCausalLM.from_pretrained returns, as transformers annotates it: a PreTrainedModel
    # with GenerationMixin's generate().
    from transformers.models.auto.modeling_auto import _BaseModelWithGenerate as CausalLM


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward() keyword for the KV cache: transformers renamed ``past_key_values`` to ``cache`` (5.2x)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions. A negative argument (remove N) means the same in every
    transformers version, while a positive one changed meaning (absolute length -> refused)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [S, V] float32
    features: torch.Tensor | None  # [S, n*H] concatenated taps, or None when nothing was asked for


class TargetModel:
    """One sequence at a time (batch 1): the live loop's view of the target."""

    def __init__(self, model: CausalLM, hidden_state_indices: tuple[int, ...] = ()):
        """``hidden_state_indices``: taps for forwards that name none (direct use in tests and
        benchmarks); the engine's loops pass ``taps=proposer.needs.hidden_state_indices`` themselves."""
        self.model = model
        self.hidden_state_indices = hidden_state_indices
        self.cache = DynamicCache()
        self._cache_keyword = cache_keyword(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset(self) -> None:
        self.cache = DynamicCache()

    @property
    def cache_length(self) -> int:
        return self.cache.get_seq_length()

    def crop(self, length: int) -> None:
        """Drop cached positions from ``length`` on (rejected draft tokens)."""
        crop_cache(self.cache, length)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, taps: tuple[int, ...] | None = None) -> TargetOutput:
        """Run ``token_ids`` [S] after the cached prefix; the cache grows by S.

        ``taps``: HF ``hidden_states`` indices concatenated into ``features`` (a proposer's declared
        needs); None uses the constructor's default.
        """
        taps = self.hidden_state_indices if taps is None else taps
        want_hidden = bool(taps)
        out = self.model(
            input_ids=token_ids[None],
            **{self._cache_keyword: self.cache},
            use_cache=True,
            output_hidden_states=want_hidden,
        )
        features = None
        if want_hidden:
            features = torch.cat([out.hidden_states[i][0].to(self.device) for i in taps], dim=-1)  # a placed target taps several GPUs
        return TargetOutput(logits=out.logits[0].float(), features=features)

    @property
    def embedding(self) -> torch.nn.Embedding:
        """The token embedding, which DFlash drafts share."""
        return cast(torch.nn.Embedding, self.model.get_input_embeddings())

    @property
    def head(self) -> torch.nn.Linear:
        """The vocabulary head (a causal LM's is a Linear), which DFlash drafts share."""
        return cast(torch.nn.Linear, self.model.get_output_embeddings())

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(token_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden.to(self.head.weight.dtype))
