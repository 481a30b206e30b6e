"""The target model as the engine sees it: incremental forwards with a cache that can be rolled back.

Wraps a transformers causal LM. Each forward returns the logits of the new tokens and, when a proposer
asked for them (:class:`~dflash_doctor.engine.proposers.base.TargetNeeds`), the concatenated hidden
states it taps.

Memory stays linear in what is used, so a 128k-token context fits one GPU (benchmarks/context_scaling.py):
the taps are recorded by hooks on the tapped layers only (``output_hidden_states`` would keep every
layer's states of every position), logits are computed only for the positions a caller reads
(``logits_from``: the vocabulary head never sees the prompt of a teacher-forced pass), and a long
sequence runs through the model in chunks of :data:`PREFILL_CHUNK` tokens (each chunk's activations
are freed before the next). Cropping the cache after verification is how rejected draft tokens are rolled back; on a
hybrid target (recurrent layers beside attention) :mod:`dflash_doctor.engine.cache` restores the
recurrent states and re-runs the accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from dflash_doctor.engine.cache import RollbackCache, accepts_logits_to_keep, refuse_unreplayable

if TYPE_CHECKING:
    # What AutoModelForCausalLM.from_pretrained returns, as transformers annotates it: a PreTrainedModel
    # with GenerationMixin's generate().
    from transformers.models.auto.modeling_auto import _BaseModelWithGenerate as CausalLM


def attention_implementation(config) -> str:
    """The attention kernel the engine runs a target with: SDPA where transformers runs the architecture with it.

    Else eager (gpt-oss: its attention sinks have no SDPA path, and transformers refuses SDPA). Chosen once at
    load and kept by the model, so the live loop and the teacher-forced pass (one model object) compute with the
    same kernel and sweep tau stays equal to replay tau.

    Args:
        config: the target's transformers config.

    Returns:
        ``"sdpa"`` or ``"eager"``, as transformers' ``attn_implementation`` takes it.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "eager" if model_class is not None and not getattr(model_class, "_supports_sdpa", True) else "sdpa"


#: Tokens per forward of a long sequence: the activations of one chunk (its MLP's intermediate, its
#: attention's queries) are what a prefill holds besides the cache, whatever the context length.
PREFILL_CHUNK = 8192


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [S - logits_from, V] float32
    features: torch.Tensor | None  # [S, n*H] concatenated taps, or None when nothing was asked for


def tap_points(model: CausalLM) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """Where the engine reads a target's hidden states: the decoder and its blocks.

    Args:
        model: the loaded target.

    Returns:
        ``(decoder, blocks)``: the decoder (its output is HF's last ``hidden_states``) and the ModuleList of its
        ``num_hidden_layers`` blocks (their outputs are the others).
    """
    count = model.config.get_text_config().num_hidden_layers
    decoder = model.get_decoder()
    for module in decoder.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return decoder, module
    raise ValueError(f"{type(model).__name__} has no list of {count} decoder layers to tap")


#: Tap index of the last decoder layer's output *before* the decoder's final norm. HF's ``hidden_states``
#: has no entry for it (its last entry is that output after the norm), so it gets an index of its own, past
#: any layer count. A head trained on the other side of the norm than the one it is handed still drafts
#: fluent tokens, only fewer of them accepted, so a replay must be able to hand it either side.
PRE_FINAL_NORM = 1 << 30


class TapRecorder:
    """The hidden states of the tapped layers only, recorded by hooks during one forward.

    Index ``i`` means what it means in HF's ``output_hidden_states``: 0 the input of the first decoder
    layer (the scaled embeddings), ``i`` the output of layer ``i - 1``, the last the decoder's final
    (normed) output; :data:`PRE_FINAL_NORM` the last layer's output before that norm. Nothing else is
    kept, where ``output_hidden_states`` keeps all of them.
    """

    def __init__(self, points: tuple[torch.nn.Module, torch.nn.ModuleList], taps: tuple[int, ...]):
        self.decoder, self.layers = points
        count = len(self.layers) + 1
        self.taps = tuple(tap if tap == PRE_FINAL_NORM else tap % count for tap in taps)
        self.recorded: dict[int, torch.Tensor] = {}

    def __enter__(self) -> "TapRecorder":
        handles = []
        last = len(self.layers)
        for tap in set(self.taps):
            if tap == 0:
                handles.append(self.layers[0].register_forward_pre_hook(self._layer_input(tap), with_kwargs=True))
            elif tap == PRE_FINAL_NORM:
                handles.append(self.layers[last - 1].register_forward_hook(self._layer_output(tap)))
            elif tap == last:
                handles.append(self.decoder.register_forward_hook(self._decoder_output(tap)))
            else:
                handles.append(self.layers[tap - 1].register_forward_hook(self._layer_output(tap)))
        self._handles = handles
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _layer_input(self, tap: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            self.recorded[tap] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _layer_output(self, tap: int):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            self.recorded[tap] = output[0] if isinstance(output, tuple) else output

        return hook

    def _decoder_output(self, tap: int):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            self.recorded[tap] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        return hook

    def features(self, device: torch.device | str) -> torch.Tensor:
        """[N, S, n*H]: the taps of the forward, concatenated in the order asked (a placed target taps several GPUs)."""
        return torch.cat([self.recorded[tap].to(device) for tap in self.taps], dim=-1)


class TargetModel:
    """One sequence at a time (batch 1): the live loop's view of the target."""

    def __init__(self, model: CausalLM, hidden_state_indices: tuple[int, ...] = ()):
        """``hidden_state_indices``: taps for forwards that name none (direct use in tests and
        benchmarks); the engine's loops pass ``taps=proposer.needs.hidden_state_indices`` themselves."""
        refuse_unreplayable(model.config)
        self.model = model
        self.hidden_state_indices = hidden_state_indices
        self.cache = RollbackCache(model)
        self._logits_to_keep = accepts_logits_to_keep(model)
        self._tap_points = tap_points(model)

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
    def forward(
        self, token_ids: torch.Tensor, taps: tuple[int, ...] | None = None, logits_from: int = 0
    ) -> TargetOutput:
        """Run ``token_ids`` [S] after the cached prefix; the cache grows by S.

        ``taps``: HF ``hidden_states`` indices concatenated into ``features`` (a proposer's declared
        needs); None uses the constructor's default. ``logits_from``: the first of the new positions
        whose logits are returned (a prefill reads only its last; a teacher-forced pass its outputs').

        A sequence longer than :data:`PREFILL_CHUNK` runs in chunks; on a hybrid target a rollback then
        stays within the last chunk (a chunked forward is a prefill, which is never rolled back).
        """
        taps = self.hidden_state_indices if taps is None else taps
        logits_from = max(0, min(logits_from, len(token_ids) - 1))
        logits, features = [], []
        for start in range(0, len(token_ids), PREFILL_CHUNK):
            chunk = token_ids[start : start + PREFILL_CHUNK]
            self.cache.release()  # a rollback stays within this forward (its last chunk)
            keep = len(chunk) - max(logits_from - start, 0)  # positions of this chunk whose logits are read
            with TapRecorder(self._tap_points, taps) as recorder:
                out = self.cache.forward(chunk, **({"logits_to_keep": max(keep, 1)} if self._logits_to_keep else {}))
            if keep > 0:
                logits.append(out.logits[0, -keep:].float())
            if taps:
                features.append(recorder.features(self.device)[0])
        return TargetOutput(
            logits=torch.cat(logits) if len(logits) > 1 else logits[0],
            features=(torch.cat(features) if len(features) > 1 else features[0]) if taps else None,
        )

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
