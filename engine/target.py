"""The target model as the engine sees it: incremental forwards with a cache that can be rolled back.

Wraps a transformers causal LM. Each forward returns the logits of the new tokens and, when a proposer
asked for them (:class:`~dflash_doctor.engine.proposers.base.TargetNeeds`), the concatenated hidden
states it taps. Cropping the cache after verification is how rejected draft tokens are rolled back; on a
hybrid target (recurrent layers beside attention) :mod:`dflash_doctor.engine.cache` restores the
recurrent states and re-runs the accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from dflash_doctor.engine.cache import RollbackCache, refuse_unreplayable

if TYPE_CHECKING:
    # What AutoModelForCausalLM.from_pretrained returns, as transformers annotates it: a PreTrainedModel
    # with GenerationMixin's generate().
    from transformers.models.auto.modeling_auto import _BaseModelWithGenerate as CausalLM


def attention_implementation(config) -> str:
    """The attention kernel the engine runs a target with: SDPA where transformers runs the architecture
    with it, else eager (gpt-oss: its attention sinks have no SDPA path, and transformers refuses SDPA).

    Chosen once at load and kept by the model, so the live loop and the teacher-forced pass (one model
    object) compute with the same kernel and sweep tau stays equal to replay tau."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "eager" if model_class is not None and not getattr(model_class, "_supports_sdpa", True) else "sdpa"


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [S, V] float32
    features: torch.Tensor | None  # [S, n*H] concatenated taps, or None when nothing was asked for


class TargetModel:
    """One sequence at a time (batch 1): the live loop's view of the target."""

    def __init__(self, model: CausalLM, hidden_state_indices: tuple[int, ...] = ()):
        """``hidden_state_indices``: taps for forwards that name none (direct use in tests and
        benchmarks); the engine's loops pass ``taps=proposer.needs.hidden_state_indices`` themselves."""
        refuse_unreplayable(model.config)
        self.model = model
        self.hidden_state_indices = hidden_state_indices
        self.cache = RollbackCache(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset(self) -> None:
        self.cache.reset()

    @property
    def cache_length(self) -> int:
        return self.cache.length

    def crop(self, length: int) -> None:
        """Drop cached positions from ``length`` on (rejected draft tokens), within the last forward."""
        self.cache.crop(length)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, taps: tuple[int, ...] | None = None) -> TargetOutput:
        """Run ``token_ids`` [S] after the cached prefix; the cache grows by S.

        ``taps``: HF ``hidden_states`` indices concatenated into ``features`` (a proposer's declared
        needs); None uses the constructor's default.
        """
        taps = self.hidden_state_indices if taps is None else taps
        want_hidden = bool(taps)
        self.cache.release()  # a rollback stays within this forward
        out = self.cache.forward(token_ids, output_hidden_states=want_hidden)
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
