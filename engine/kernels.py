"""Which kernels a loaded target computes with: what the lossless check needs to tell numerics from a defect.

The speculative loop verifies k + 1 tokens in one forward; plain decoding feeds one token per forward. On an
attention-only target both go through the same matmuls and attention kernel. A hybrid target's recurrent layers
do not: transformers calls a chunked kernel for a multi-token forward and a recurrent one for a single token
(gated-delta-net: flash-linear-attention's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` on
a GPU, else its own ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``), which sum in
different orders. Their precision, not the dtype's, bounds how closely the two loops can agree.

Read from the loaded model itself, never from its name: each recurrent layer's mixer
(:func:`dflash_doctor.engine.cache.recurrent_mixers`) holds its kernel entry points, either as its own
wrappers (the ``kernels`` package's ``use_kernelized_func`` keeps them in the layer's ``_kernel_funcs``) or as
the module functions its ``forward`` calls. Each entry point is transformers' dispatcher
(``use_kernel_func_from_hub_with_fallback``), which resolved once, at import, to the optional package's
kernel or to its own torch code, and which falls back to the torch code on a device the package does not
support (flash-linear-attention on a CPU); :func:`kernel_paths` resolves it the same way for the model's device.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch

from dflash_doctor.engine.cache import has_recurrent_layers, recurrent_mixers


def kernel_paths(model: torch.nn.Module) -> dict[str, str]:
    """The kernels a target computes with: what the lossless rule needs to judge a divergence's numerics.

    Read from the loaded modules, never from a model name: a verify pass and a decode step of a hybrid target
    can run different kernels (a chunked and a recurrent gated-delta-net), whose rounding differs.

    Args:
        model: the loaded target.

    Returns:
        By name: its dtype and device, its attention implementation, the float32 matmul precision (and on
        CUDA whether cuDNN convolutions use TF32), and for each recurrent mixer class each kernel entry point
        with what it runs on this device (``"fla chunk_gated_delta_rule"``,
        ``"transformers torch_chunk_gated_delta_rule"``), keyed ``Class.entry_point``.
    """
    parameter = next(model.parameters())
    device = parameter.device.type
    config: Any = getattr(model, "config")
    paths = {
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "device": device,
        "attention": str(getattr(config, "_attn_implementation", None) or "unknown"),
        "float32 matmul": torch.get_float32_matmul_precision(),
    }
    if device == "cuda":
        paths["cuDNN float32 convolutions"] = "TF32" if torch.backends.cudnn.allow_tf32 else "IEEE"
    if not has_recurrent_layers(config):
        return paths
    for mixer in recurrent_mixers(model, config):
        for entry, runs in _mixer_kernels(mixer, device).items():
            paths[f"{type(mixer).__name__}.{entry}"] = runs
    return paths


def _mixer_kernels(mixer: torch.nn.Module, device: str) -> dict[str, str]:
    """{entry point: what it runs on ``device``} for the dispatching kernel entry points ``mixer`` holds."""
    held: dict[str, Any] | None = mixer.__dict__.get("_kernel_funcs")
    if not held:  # without the kernels package: the dispatchers its forward calls by their module names
        module = sys.modules[type(mixer).__module__]
        forward = inspect.unwrap(type(mixer).forward)
        held = {name: getattr(module, name) for name in forward.__code__.co_names if hasattr(module, name)}
    found = {}
    for entry in held.values():
        resolved = resolve_kernel(entry, device)
        if resolved is not None:
            found[resolved[0]] = resolved[1]
    return found


def resolve_kernel(entry: Any, device: str) -> tuple[str, str] | None:
    """What a recurrent mixer's kernel entry point runs on a device (an fla kernel or transformers' torch fallback).

    Args:
        entry: the attribute a mixer holds for one kernel (a function or a hub-kernel dispatcher).
        device: ``"cuda"`` or ``"cpu"``: a dispatcher may pick a different function per device.

    Returns:
        ``(the entry point's torch function name, "package function")``, or None for anything that is not a
        kernel dispatcher.
    """
    if isinstance(entry, torch.nn.Module):  # a kernels-package wrapper of a function
        swapped = vars(entry).get("forward")  # ``kernelize`` put a hub kernel in its place
        entry = _nonlocals(type(entry).forward).get("func")
        if swapped is not None and entry is not None:
            return entry.__name__, f"hub kernel {_name(swapped)}"
    if not inspect.isfunction(entry):
        return None
    scope = _nonlocals(entry)
    implementation, torch_function = scope.get("implementation"), scope.get("torch_function")
    if not callable(implementation) or not inspect.isfunction(torch_function):
        return None
    supported = scope.get("supported_devices")
    if supported is not None and device not in supported:
        implementation = torch_function
    return torch_function.__name__, _name(implementation)


def _nonlocals(function: Callable) -> dict[str, Any]:
    """The variables a function's closure holds (none for a callable without one)."""
    return dict(inspect.getclosurevars(function).nonlocals) if inspect.isfunction(function) else {}


def _name(function: Callable) -> str:
    """``"package function"``: the top-level package that defines it and its name."""
    module = getattr(function, "__module__", None) or "unknown"
    return f"{module.split('.')[0]} {getattr(function, '__name__', type(function).__name__)}"
