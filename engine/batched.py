"""Batched generation with the target: the decoding steps of many prompts in one forward each.

Teacher-forced replay only needs the target's continuations, and generating them in batches is what
makes a sweep cheap on a CPU; training generates its data the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    CacheLayerMixin,
    DummyLayer,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from dflash_doctor.engine.attention import engine_attention
from dflash_doctor.engine.cache import cache_keyword, has_recurrent_layers, new_cache

if TYPE_CHECKING:
    from dflash_doctor.engine.target import CausalLM


class _GrowingLayer(DynamicLayer):
    """A cache layer whose keys and values are views into buffers sized for the whole decoding.

    The stock layer concatenates its whole cache with every new token: on a CPU that copy took a quarter
    of the decoding steps' time over 400-700-token contexts (torch profile, 12 rows, 30 layers). Here each
    step writes its column into room reserved up front; attention reads the same numbers (the demo
    workload's answers are token-identical either way), about 8% less wall time for the demo's answers.
    """

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], width: int, room: int):
        """``keys`` / ``values``: each row's [heads, length, dim] states, left-padded here to ``width``
        (the padding zero and masked out) with ``room`` more columns for the decoding."""
        super().__init__()
        self._key_buffer, self._value_buffer = (_left_padded(states, width, room) for states in (keys, values))
        self._set_length(width)
        self.device, self.is_initialized = self._key_buffer.device, True

    def _set_length(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._length = length
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]
        return self.keys, self.values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._length + key_states.shape[2]
        self._key_buffer[:, :, self._length : end] = key_states
        self._value_buffer[:, :, self._length : end] = value_states
        return self._set_length(end)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._key_buffer, self._value_buffer = self._key_buffer[indices], self._value_buffer[indices]
        self._set_length(self._length)


def _left_padded(states: Sequence[torch.Tensor], width: int, room: int) -> torch.Tensor:
    """[rows, heads, width + room, dim], each row's states ending at column ``width``, zeros before."""
    buffer = states[0].new_zeros((len(states), states[0].shape[0], width + room, states[0].shape[-1]))
    for row, state in enumerate(states):
        buffer[row, :, width - state.shape[1] : width] = state
    return buffer


def _left_padding_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, width] attention mask of left-padded rows of ``lengths`` tokens: 0 on the padding, 1 on the tokens."""
    return (torch.arange(width, device=lengths.device)[None] >= (width - lengths)[:, None]).long()


def prefill_rows_per_forward(device: torch.device) -> int:
    """How many prompts one prefill forward takes: 1 on a CPU, 256 elsewhere.

    A CPU is compute-bound: a prompt prefilled alone does no work on padding and gives exactly the
    numbers batch-1 decoding gives. A GPU is bound by kernel launches at this model size: prefilling
    2,048 prompts (36-380 tokens, SmolLM2-135M shape, bf16) one by one took 57 s on an H200, and the
    same prompts sorted by length in padded forwards of 256 took 2.9 s; one by one, prefill was most of
    `train-draft`'s data generation there (about 12 minutes instead of 6 for its 25,884 answers; docs/benchmarks.md).

    Args:
        device: the device the target runs on; only its type (``cpu`` or not) matters.

    Returns:
        The number of prompts per prefill forward: 1 on a CPU, 256 on any other device.
    """
    return 1 if device.type == "cpu" else 256


#: A prompt's state in one cache layer: (keys, values) as [heads, length, dim] for an attention layer,
#: the per-index (conv, recurrent) states without the batch axis for a recurrent layer, None for a layer
#: that keeps nothing (a hybrid's MoE block).
RowState = (
    tuple[torch.Tensor, torch.Tensor] | tuple[dict[int, torch.Tensor | None], dict[int, torch.Tensor | None]] | None
)


def _prefill(
    model: CausalLM, prompts: list[tuple[int, ...]], rows_per_forward: int
) -> tuple[list[list[RowState]], list[torch.Tensor]]:
    """Each prompt's cache, per layer (:data:`RowState`), and its last position's logits.

    Prompts go ``rows_per_forward`` at a time, sorted by length so that a forward pads little: left-padded,
    the padding masked out and each row at its own positions, so a row's states are its own prompt's.
    A target with recurrent layers is prefilled one prompt per forward: not every architecture masks
    the padding out of its recurrent states.
    """
    device = next(model.parameters()).device
    keyword = cache_keyword(model)
    if has_recurrent_layers(model.config):
        rows_per_forward = 1
    states: list[list[RowState]] = [[] for _ in prompts]
    logits: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), rows_per_forward):
        chunk = order[start : start + rows_per_forward]
        lengths = torch.tensor([len(prompts[i]) for i in chunk], device=device)
        width = int(lengths.max())
        ids = torch.zeros((len(chunk), width), dtype=torch.long, device=device)
        for row, i in enumerate(chunk):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i], device=device)
        mask = _left_padding_mask(lengths, width)
        cache = new_cache(model.config)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
            **{keyword: cache},
        )
        for row, i in enumerate(chunk):
            states[i] = [_row_state(layer, row, width - len(prompts[i])) for layer in cache.layers]
            logits[i] = out.logits[row, -1]
    return states, logits


def _row_state(layer, row: int, begin: int) -> RowState:
    """Row ``row``'s state in a prefilled cache layer (attention rows from column ``begin`` on); a layer
    of another kind (a transformers change) stops here."""
    if isinstance(layer, DummyLayer):
        return None
    if isinstance(layer, LinearAttentionLayer):
        return tuple(
            {i: None if state is None else state[row] for i, state in states.items()}
            for states in (layer.conv_states, layer.recurrent_states)
        )  # type: ignore[return-value]
    if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
        raise RuntimeError(f"the prefill left a {type(layer).__name__} without key/value states in the cache")
    return layer.keys[row, :, begin:], layer.values[row, :, begin:]


def _batched_layer(
    rows: list[RowState], width: int, room: int
) -> CacheLayerMixin | LinearAttentionCacheLayerMixin | DummyLayer:
    """One decoding cache layer holding every row's prefilled state (:data:`RowState` of one layer)."""
    if rows[0] is None:
        return DummyLayer()
    first, _ = rows[0]
    if isinstance(first, dict):
        return _StackedStates(rows)
    return _GrowingLayer(
        [row[0] for row in rows],  # type: ignore[index]
        [row[1] for row in rows],  # type: ignore[index]
        width=width,
        room=room,
    )


class _StackedStates(LinearAttentionLayer):
    """A recurrent layer of the batch: every row's prefilled conv and recurrent states stacked."""

    def __init__(self, rows):
        super().__init__(number_of_states=len(rows[0][0]))
        for which, (states, initialized) in enumerate(
            (
                (self.conv_states, self.is_conv_states_initialized),
                (self.recurrent_states, self.is_recurrent_states_initialized),
            )
        ):
            for i in states:
                parts = [row[which][i] for row in rows]
                if parts[0] is not None:
                    states[i], initialized[i], self.has_previous_state[i] = torch.stack(parts), True, True
        first = next(
            state for state in (*self.conv_states.values(), *self.recurrent_states.values()) if state is not None
        )
        self.device, self.dtype = first.device, first.dtype
        self.conv_kernel_size = {i: None if state is None else state.shape[-1] for i, state in self.conv_states.items()}

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)  # type: ignore[arg-type]


@engine_attention
@torch.inference_mode()
def generate_greedy_batch(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: frozenset[int],
    temperature: float = 0.0,
    prefill_rows: int | None = None,
    past_end: int = 0,
) -> list[list[int]]:
    """The target's continuations of several prompts, every decoding step one batched forward.

    Greedy by default: then each continuation equals :func:`dflash_doctor.engine.live.plain_generate` at
    temperature 0 (a test checks it in fp32). ``temperature`` > 0 samples instead (extra training data).
    With ``past_end``, a continuation goes on past its end (the target's tokens that an engine drafting
    past a request's end verifies its last step against), which the caller splits off.

    Distinct prompts are prefilled ``prefill_rows`` at a time (alone on a CPU, exactly as batch-1 decoding
    prefills, where a batch padded to its longest prompt did three times the prefill work on the demo
    workload; in length-sorted padded forwards on a GPU), and repeated prompts (several sampled answers)
    share one prefill. The decoding steps run batched over the prompts' caches, left-padded to one length
    (the padding masked out, each row at its own positions); a row leaves the batch at its stop token.

    Args:
        model: the target causal LM; its first parameter's device is where the batch runs.
        prompts: the prompts' token ids; a prompt may repeat (its answers then share one prefill).
        max_new_tokens: the most tokens a continuation has before ``past_end`` (its end when no stop
            token comes first).
        stop_ids: token ids that end a continuation (the stop token is kept in it).
        temperature: 0 for greedy decoding; > 0 samples from the softmax of logits / ``temperature``.
        prefill_rows: distinct prompts per prefill forward; None takes :func:`prefill_rows_per_forward`
            of the model's device.
        past_end: how many tokens each continuation goes on for past its end (stop token or
            ``max_new_tokens``), 0 for none.

    Returns:
        One list of generated token ids per prompt, in the prompts' order: the continuation up to and
        including its first stop token (or ``max_new_tokens`` tokens), followed by up to ``past_end`` more.
    """
    device = next(model.parameters()).device
    keyword = cache_keyword(model)
    slot: dict[tuple[int, ...], int] = {}
    for prompt in prompts:
        slot.setdefault(tuple(prompt), len(slot))
    prefilled, last_logits = _prefill(model, list(slot), prefill_rows or prefill_rows_per_forward(device))
    source = [slot[tuple(p)] for p in prompts]
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lengths.max())
    layers: list[CacheLayerMixin | LinearAttentionCacheLayerMixin | DummyLayer] = [
        _batched_layer([prefilled[i][layer] for i in source], width, max_new_tokens + past_end)
        for layer in range(len(prefilled[0]))
    ]
    cache = DynamicCache()
    cache.layers = layers
    del prefilled  # the batched copy replaces them
    attention_mask = _left_padding_mask(lengths, width)
    next_logits = torch.stack([last_logits[i] for i in source])
    responses: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # prompt index of each batch row
    ends: list[int | None] = [None] * len(prompts)  # each continuation's length once it has ended
    for step in range(max_new_tokens + past_end):
        if temperature > 0:
            tokens = torch.multinomial(torch.softmax(next_logits.float() / temperature, dim=-1), 1)[:, 0]
        else:
            tokens = next_logits.argmax(dim=-1)
        going = []
        for position, (row, token) in enumerate(zip(rows, tokens.tolist())):
            responses[row].append(token)
            if ends[row] is None and (token in stop_ids or step + 1 == max_new_tokens):
                ends[row] = step + 1
            end = ends[row]
            if end is None or step + 1 < end + past_end:
                going.append(position)
        if not going:
            break
        if len(going) < len(rows):
            keep = torch.tensor(going, device=device)
            cache.batch_select_indices(keep)
            attention_mask, tokens, lengths = attention_mask[keep], tokens[keep], lengths[keep]
            rows = [rows[i] for i in going]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=1)
        out = model(
            input_ids=tokens[:, None],
            attention_mask=attention_mask,
            position_ids=(lengths + step)[:, None],
            use_cache=True,
            **{keyword: cache},
        )
        next_logits = out.logits[:, -1]
    return responses
