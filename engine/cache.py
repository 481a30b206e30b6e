"""The target's cache and how a rejected draft is taken back out of it, for every layer kind a target has.

A key/value layer (full, sliding-window, latent or sink attention) is rolled back by cropping: its rows
for the rejected tokens are dropped and nothing else changed. A recurrent layer (gated delta net in
Qwen3.5/3.6 and Qwen3-Next, Mamba2 in Nemotron-H, LFM2's short convolutions) cannot be cropped: its state
after a rejected token has already absorbed it.

How serving engines do it: vLLM and SGLang keep one recurrent state per draft position while verifying
(vllm 0.32.0 v1/attention/backends/gdn_attn.py: ``spec_state_indices_tensor`` [batch, num_spec] and
``num_accepted_tokens``; SGLang python/sglang/srt/layers/attention/hybrid_linear_attn_backend.py: the
verify kernel writes each draft token's state into an ``intermediate_ssm`` scratch and
``update_mamba_state_after_mtp_verify`` commits the accepted one). transformers' kernels return only the
final state of a forward, so per-position states would mean verifying token by token: K + 1 forwards,
18-21x a full-attention step on an H200 (benchmarks/hybrid_rollback.py, Qwen3.5-9B shape, K = 15).

Here instead: the recurrent states are snapshotted before each forward (a copy of a few tensors per
layer without a sequence dimension), and each recurrent mixer's call is recorded (its input hidden
states are references, not copies). A rollback restores the snapshot, crops the key/value layers to the
kept length and calls each recurrent mixer once more on its recorded input cut to the kept positions:
the attention rows and every other layer's output at those positions are already right (a position
never sees later ones), so only the mixers' state updates are redone. Nothing is re-run when the whole
draft is accepted, and never the context. Re-running the whole model over the kept tokens instead
(``rerun="model"``, also the fallback) cost 36-53 ms per rejecting step on an H200 at the Qwen3.5-9B
shape, 40-50% of the step; on a CPU the mixers' rollback cost a third to a half of the whole model's
(6.1 vs 19.7 ms keeping 1 token, 16.3 vs 32.2 ms keeping 4; docs/benchmarks.md).

Layers of another kind (a cache layer this module does not know how to take back) are refused before
any work, with the architecture named (:func:`refuse_unreplayable`).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from dflash_doctor.errors import UsageError

if TYPE_CHECKING:
    # What AutoModelForCausalLM.from_pretrained returns, as transformers annotates it (as engine/target.py).
    from transformers.models.auto.modeling_auto import _BaseModelWithGenerate as CausalLM

#: Cache layer kinds the engine rolls back exactly: key/value rows (cropped; a sliding window's layer is
#: replaced by a full one, :func:`new_cache`), recurrent states (snapshot and re-run), or nothing (a layer
#: without attention, e.g. Nemotron-H's MoE blocks). Anything else (Falcon-H1's layers holding both at
#: once, DeepSeek-V3.2's indexer cache) is refused rather than guessed at.
ROLLBACK_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer, DummyLayer)


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward() keyword for the KV cache: transformers renamed ``past_key_values`` to ``cache`` (5.2x).

    Args:
        model: the model whose ``forward`` signature is read.

    Returns:
        ``"cache"`` when ``forward`` takes that keyword, else ``"past_key_values"``.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether forward() takes ``logits_to_keep``: with it a forward that needs only the last rows' logits
    skips the [T, V] projection of the rest.

    Args:
        model: the model whose ``forward`` signature is read (transformers' causal LMs take the keyword; an
            older or custom model may not).

    Returns:
        True when ``forward`` has a ``logits_to_keep`` parameter.
    """
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def new_cache(config: PretrainedConfig) -> DynamicCache:
    """An empty cache laid out for a target of ``config``.

    A target without recurrent layers gets the plain growing cache (every attention layer keeps all its
    rows; sliding windows are applied by the attention mask), as the engine always used. A hybrid
    target gets its own layer kinds from its config, except that sliding-window layers keep all their
    rows too: a window-sized buffer cannot be cropped back past tokens it has already dropped.

    Args:
        config: the target's transformers config.

    Returns:
        A fresh transformers ``DynamicCache``, layered per its config for a hybrid target.
    """
    if not has_recurrent_layers(config):
        return DynamicCache()
    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    return cache


def has_recurrent_layers(config: PretrainedConfig) -> bool:
    """Whether a target keeps recurrent or convolution states (a hybrid or state-space model), which a
    rollback must snapshot and re-run instead of cropping.

    Args:
        config: the target's transformers config.

    Returns:
        True when any layer of the cache its config lays out is a linear-attention (recurrent) layer.
    """
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in DynamicCache(config=config).layers)


def rollback_method(config: PretrainedConfig) -> str:
    """How a rejected draft leaves a target's cache, recorded in run.json's target facts.

    Args:
        config: the target's transformers config.

    Returns:
        ``"restore recurrent states, re-run kept tokens"`` for a target with recurrent layers, else
        ``"crop key/value rows"``.
    """
    return "restore recurrent states, re-run kept tokens" if has_recurrent_layers(config) else "crop key/value rows"


def refuse_unreplayable(config: PretrainedConfig) -> None:
    """Stop, before any work, at a target whose cache the engine cannot roll back exactly: counting
    acceptances on it would be silently wrong.

    Args:
        config: the target's transformers config.

    Raises:
        UsageError: when its cache holds a layer kind outside :data:`ROLLBACK_LAYERS` (one sentence naming
            the architecture and the layer kind).
    """
    unknown = sorted(
        {type(layer).__name__ for layer in DynamicCache(config=config).layers if type(layer) not in ROLLBACK_LAYERS}
    )
    if unknown:
        raise UsageError(
            f"{config.model_type} targets keep {', '.join(unknown)} cache layers, which the engine cannot "
            f"roll back after a rejected draft; replay this target with an engine that serves it."
        )


def crop_key_values(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every key/value layer (recurrent states untouched).

    Layer by layer, so that a hybrid cache's recurrent layers (whose own crop refuses) are left alone.

    The crop is by a negative count (remove N): that means the same in every transformers version,
    while a positive argument changed meaning (absolute length -> refused).

    Args:
        cache: the cache to crop in place.
        length: positions to keep; a layer already that short or shorter is left as it is.
    """
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            excess = layer.get_seq_length() - length
            if excess > 0:
                DynamicLayer.crop(layer, -excess)


@dataclass
class _LayerStates:
    conv: dict[int, torch.Tensor | None]
    recurrent: dict[int, torch.Tensor | None]
    conv_initialized: dict[int, bool]
    recurrent_initialized: dict[int, bool]
    has_previous: dict[int, bool]
    # the layer's own token count (transformers 5.25 on: ``cumulative_length_linear``, a tensor updated in place),
    # which the model's position ids are read from: a restore that missed it would place the kept tokens after
    # the rejected ones (None in releases without it)
    length: torch.Tensor | None


def _clone(states: dict[int, torch.Tensor | None]) -> dict[int, torch.Tensor | None]:
    return {i: None if state is None else state.clone() for i, state in states.items()}


#: A recurrent mixer's call as the forward made it: (module, positional arguments, keyword arguments).
MixerCall = tuple[torch.nn.Module, tuple, dict[str, Any]]


@dataclass
class _Checkpoint:
    """The recurrent layers' states before a forward, that forward's tokens, the length it started at,
    and the calls it made to the recurrent mixers."""

    length: int
    token_ids: torch.Tensor
    states: dict[int, _LayerStates]
    mixer_calls: list[MixerCall] = field(default_factory=list)


def recurrent_mixers(model: torch.nn.Module, config: PretrainedConfig) -> list[torch.nn.Module]:
    """The modules that update a recurrent layer's state (Qwen3.5's ``linear_attn``, Nemotron-H's Mamba2
    ``mixer``, LFM2's short ``conv``), whose calls a rollback can re-run on the kept positions.

    Args:
        model: the target model whose modules are searched.
        config: its transformers config, which says which cache layers are recurrent.

    Returns:
        For each recurrent cache layer, the innermost module carrying its ``layer_idx`` (a decoder block
        may carry it too), in the model's module order.
    """
    recurrent = {
        i for i, layer in enumerate(DynamicCache(config=config).layers) if isinstance(layer, LinearAttentionLayer)
    }
    named = {name: module for name, module in model.named_modules() if getattr(module, "layer_idx", None) in recurrent}
    return [
        module
        for name, module in named.items()
        if not any(other.startswith(name + ".") and named[other].layer_idx == module.layer_idx for other in named)
    ]


#: The calls each rollback cache records in the forward under way, keyed by its transformers cache.
_RECORDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _record_mixer_call(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of a recurrent mixer: keep the call for the cache it was made with, if recording."""
    cache = next((value for value in (*args, *kwargs.values()) if isinstance(value, DynamicCache)), None)
    calls = _RECORDING.get(cache) if cache is not None else None
    if calls is not None:
        calls.append((module, args, kwargs))


def _on_prefix(call: MixerCall, kept: int) -> MixerCall | None:
    """The same call on the first ``kept`` positions: the hidden states sliced, everything else as made;
    None when the call passed another tensor (a padding mask) that a slice of the positions would change."""
    module, args, kwargs = call
    if args:
        hidden, args, kwargs = args[0], args[1:], kwargs
    else:
        hidden, kwargs = kwargs.get("hidden_states"), {k: v for k, v in kwargs.items() if k != "hidden_states"}
    if not isinstance(hidden, torch.Tensor) or any(
        isinstance(value, torch.Tensor) for value in (*args, *kwargs.values())
    ):
        return None
    return module, (hidden[:, :kept], *args), kwargs


class RollbackCache:
    """A model's cache with its length and a rollback for every layer kind: crop the key/value rows,
    and for recurrent layers restore the snapshot taken before the forward that holds the new length
    and run the kept positions again (module docstring).

    ``rerun`` says what runs again: ``"mixers"`` (the default) calls each recurrent mixer once more on the
    hidden states it received in that forward, cut to the kept positions (the attention rows and every
    other layer's output for those positions are already right, since a position never sees later ones);
    ``"model"`` runs the whole model over the kept tokens. A mixer called with another tensor (a padding
    mask) falls back to ``"model"``. ``benchmarks/hybrid_rollback.py`` compares the two.

    Snapshots are kept from the last :meth:`release` on: a caller releases where it will never roll
    back past (the target before each verification, a draft before each proposal).
    """

    def __init__(self, model: CausalLM, rerun: str = "mixers"):
        self.model = model
        self.recurrent = has_recurrent_layers(model.config)
        self.rerun = rerun
        self._keyword = cache_keyword(model)
        self._logits_to_keep = accepts_logits_to_keep(model)
        mixers = recurrent_mixers(model, model.config) if self.recurrent else []
        self._mixer_count = len(mixers)
        if rerun == "mixers":
            for mixer in mixers:  # one hook per module (a deep copy keeps it), whichever cache calls it
                if _record_mixer_call not in mixer._forward_pre_hooks.values():
                    mixer.register_forward_pre_hook(_record_mixer_call, with_kwargs=True)
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model.config)
        self.length = 0  # counted here: a recurrent layer has no sequence dimension to read it from
        self._checkpoints: list[_Checkpoint] = []

    def release(self) -> None:
        """Forget the snapshots: nothing before the current length will be rolled back."""
        self._checkpoints = []

    def forward(self, token_ids: torch.Tensor, **kwargs):
        """The model's output for ``token_ids`` [S] after the cached positions; the cache grows by S."""
        checkpoint = None
        if self.recurrent:
            checkpoint = _Checkpoint(self.length, token_ids, snapshot_states(self.cache))
            self._checkpoints.append(checkpoint)
            if self.rerun == "mixers":
                _RECORDING[self.cache] = checkpoint.mixer_calls
        try:
            out = self.model(input_ids=token_ids[None], use_cache=True, **{self._keyword: self.cache}, **kwargs)
        finally:
            _RECORDING.pop(self.cache, None)
        self.length += len(token_ids)
        return out

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (rejected draft tokens dropped)."""
        if length >= self.length:
            return
        if not self.recurrent:
            crop_key_values(self.cache, length)
            self.length = length
            return
        at = next(
            (i for i, c in enumerate(self._checkpoints) if c.length <= length <= c.length + len(c.token_ids)), None
        )
        if at is None:
            raise RuntimeError(f"a recurrent cache rolls back only past its last release, not to length {length}")
        checkpoint = self._checkpoints[at]
        del self._checkpoints[at:]
        kept = length - checkpoint.length
        replays = [_on_prefix(call, kept) for call in checkpoint.mixer_calls if kept]
        restore_states(self.cache, checkpoint.states)
        # every recurrent layer's mixer was called once in that forward, and each call can be cut to the prefix
        if self.rerun == "mixers" and len(checkpoint.mixer_calls) == self._mixer_count > 0 and None not in replays:
            crop_key_values(self.cache, length)
            for module, args, kwargs in replays:  # type: ignore[misc]
                module(*args, **kwargs)
            self.length = length
            return
        crop_key_values(self.cache, checkpoint.length)
        self.length = checkpoint.length
        self.forward(checkpoint.token_ids[:kept], **({"logits_to_keep": 1} if self._logits_to_keep else {}))


def snapshot_states(cache: DynamicCache) -> dict[int, _LayerStates]:
    """Copies of every recurrent layer's states, taken because the next forward updates their tensors in place.

    Args:
        cache: the cache whose recurrent layers are copied (its attention layers are not).

    Returns:
        The copied states keyed by layer index, for :func:`restore_states`.
    """
    return {
        index: _LayerStates(
            conv=_clone(layer.conv_states),
            recurrent=_clone(layer.recurrent_states),
            conv_initialized=dict(layer.is_conv_states_initialized),
            recurrent_initialized=dict(layer.is_recurrent_states_initialized),
            has_previous=dict(layer.has_previous_state),
            length=_token_count(layer),
        )
        for index, layer in enumerate(cache.layers)
        if isinstance(layer, LinearAttentionCacheLayerMixin)
    }


def restore_states(cache: DynamicCache, states: dict[int, _LayerStates]) -> None:
    """Put a :func:`snapshot_states` snapshot back into the recurrent layers, undoing the forwards since.

    The snapshot's tensors become the layers' own (no copy), so a snapshot is restored once; the token
    count is copied in place, because transformers marks its address static.

    Args:
        cache: the cache the snapshot was taken from.
        states: the snapshot, keyed by layer index.
    """
    for index, saved in states.items():
        layer = cache.layers[index]
        assert isinstance(layer, LinearAttentionCacheLayerMixin)
        layer.conv_states, layer.recurrent_states = saved.conv, saved.recurrent
        layer.is_conv_states_initialized, layer.is_recurrent_states_initialized = (
            saved.conv_initialized,
            saved.recurrent_initialized,
        )
        layer.has_previous_state = saved.has_previous
        if saved.length is not None:
            layer.cumulative_length_linear.copy_(saved.length)  # in place: transformers marks its address static


def _token_count(layer: LinearAttentionCacheLayerMixin) -> torch.Tensor | None:
    count = getattr(layer, "cumulative_length_linear", None)
    return count.clone() if isinstance(count, torch.Tensor) else None
