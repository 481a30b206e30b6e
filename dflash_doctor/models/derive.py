"""Derive a changed model from a real one: the "target changed under the draft" cases, made reproducible.

* :func:`fake_quantize` rounds every decoder Linear weight to ``bits`` bits per group (symmetric, absmax
  scale), the way a 4-bit quantised deployment changes a model while keeping its architecture.
* :func:`keep_layers` keeps the first ``n`` decoder layers: a cheaper, weaker autoregressive draft.

Both are used by tests, benchmarks and ``check --scenario quantized-target``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.no_grad()
def fake_quantize(model: PreTrainedModel, *, bits: int = 4, group_size: int = 32) -> PreTrainedModel:
    """Round decoder Linear weights in place to ``bits``-bit groups along the input dimension."""
    levels = 2 ** (bits - 1) - 1
    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            weight = module.weight
            out_features, in_features = weight.shape
            groups = weight.view(out_features, in_features // group_size, group_size)
            scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / levels
            weight.copy_((torch.round(groups / scale).clamp(-levels, levels) * scale).view_as(weight))
    return model


def keep_layers(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """Keep the first ``num_layers`` decoder layers (Llama/Qwen-style ``model.model.layers``)."""
    decoder = cast(torch.nn.Module, model.model)
    decoder.layers = cast(torch.nn.ModuleList, decoder.layers)[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    return model
