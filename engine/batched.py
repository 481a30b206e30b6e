"""Batched generation with the target: many prompts in one ``generate`` call (left padding).

Teacher-forced replay only needs the target's continuations, and generating them in batches is what
makes a sweep cheap on a CPU; training generates its data the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from dflash_doctor.engine.target import CausalLM


def padding_id(tokenizer: Any, stop_ids: frozenset[int]) -> int:
    """The id that fills the padding of :func:`generate_greedy_batch`: the tokenizer's pad token, else a
    stop id (many chat models declare none; the left padding is masked out and a finished row's fill is
    cut at its stop token, so any real id serves)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids, default=0)


def generate_greedy_batch(model: CausalLM, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                          stop_ids: frozenset[int], pad_token_id: int, temperature: float = 0.0) -> list[list[int]]:
    """The target's continuations of several prompts in one batched ``generate`` (left padding).

    Greedy by default: then each continuation equals :func:`dflash_doctor.engine.live.plain_generate` at
    temperature 0 (a test checks it in fp32). ``temperature`` > 0 samples instead (extra training data).
    Each continuation ends at (and includes) its first stop token, or after ``max_new_tokens``.
    """
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(list(prompt), device=device)
        attention_mask[row, width - len(prompt):] = 1
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=sorted(stop_ids) or None,
                              pad_token_id=pad_token_id, **sampling)
    # transformers types generate()'s self as its GenerativePreTrainedModel protocol, whose attributes
    # (hf_device_map, encoder, ...) PreTrainedModel sets at runtime but never declares.
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)  # pyright: ignore[reportAttributeAccessIssue]
    responses = []
    for row in output[:, width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in stop_ids), len(row))
        responses.append(row[:end])
    return responses
