"""A target larger than one GPU (``--device cuda:0,cuda:1``): one process places the target's decoder
layers over those GPUs with transformers' ``device_map`` (accelerate's hooks move the activations), and
keeps the embeddings, final norm and LM head on the first GPU next to the draft, which reads them. We
chose placement over tensor parallelism (``tp_plan="auto"``) because the engine's replay loop, KV-cache
rollback, hidden-state taps and the draft run unchanged on it, it works for any architecture transformers
loads (a tensor-parallel plan exists only for some, and needs head counts divisible by the GPU count),
and it composes with data parallelism (:mod:`dflash_doctor.replay.sharding`): ``--devices
cuda:0+cuda:1,cuda:2+cuda:3`` runs two ranks, each with a target over two GPUs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from dflash_doctor.errors import UsageError


def target_devices(device: str) -> list[str]:
    """The GPUs a ``--device`` value places the target on (one entry: no placement)."""
    return [d.strip() for d in device.split(",") if d.strip()]


def layer_placement(model_dir: Path, devices: Sequence[str], *, trust_remote_code: bool = False) -> dict[str, str]:
    """A transformers ``device_map`` for the checkpoint in ``model_dir`` over ``devices``.

    The decoder layers (the module list as long as ``num_hidden_layers``) are cut into contiguous runs of
    about equal bytes; every other module (embeddings, final norm, LM head, rotary tables) goes to the
    first device, counted in its share, because the draft reads the embeddings and the head and runs there.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return placement_of(skeleton, devices)


def placement_of(model: torch.nn.Module, devices: Sequence[str]) -> dict[str, str]:
    """The device map of :func:`layer_placement` for a model already built (on any device, meta too)."""
    num_layers = int(getattr(model, "config").num_hidden_layers)
    found = next(
        (
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers
        ),
        None,
    )
    if found is None:
        raise UsageError(
            f"cannot find the {num_layers} decoder layers of "
            f"{type(model).__name__} to place over {', '.join(devices)}; "
            "load it on one device."
        )
    layers_name, layers = found
    layer_bytes = np.array([sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers])
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    share = total / len(devices)
    middles = (
        (total - layer_bytes.sum()) + np.cumsum(layer_bytes) - layer_bytes / 2
    )  # bytes up to each layer's middle, the rest first
    placement = {
        f"{layers_name}.{index}": devices[min(int(middle // share), len(devices) - 1)]
        for index, middle in enumerate(middles)
    }
    parts = layers_name.split(".")
    for prefix in [".".join(parts[:i]) for i in range(len(parts))]:  # the root, then each module above the layers
        for child, _ in model.get_submodule(prefix).named_children():
            name = f"{prefix}.{child}" if prefix else child
            if not (layers_name + ".").startswith(name + "."):
                placement[name] = devices[0]
    return placement


def dispatch(model: torch.nn.Module, placement: dict[str, str], main_device: str) -> torch.nn.Module:
    """Attach accelerate's hooks for ``placement`` to a model whose weights already sit there (what
    ``from_pretrained(device_map=...)`` does after loading), so activations follow the layers; the
    model's inputs and outputs live on ``main_device``."""
    from accelerate import dispatch_model

    device_map: dict[str, str | int | torch.device] = dict(placement)
    return dispatch_model(
        model,
        device_map=device_map,
        main_device=torch.device(main_device),
        skip_keys=getattr(model, "_skip_keys_device_placement", None),
    )
