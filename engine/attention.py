"""The attention kernels the engine lets torch choose from: every scaled-dot-product backend except cuDNN's.

On Hopper GPUs torch 2.11 runs ``scaled_dot_product_attention`` through cuDNN first, and cuDNN builds an
execution plan for every new pair of query and key lengths before it runs one. The engine meets a new pair
at almost every call: the live loop's context grows by the accepted tokens at each step, and every request
of a workload has its own length. On an H200 (Qwen3-8B shape, a 1,024-token prompt, 96 new tokens) the first
live-loop call in a process took 15.4 s against 3.8 s for the same call repeated: 113 ms per step against
37 ms, the plan builds spread over every step, and paid again by every request of another length.
FlashAttention and the memory-efficient kernel need no such plan; where neither takes a call (a mask or a
head size they do not support), torch's own math kernel runs it. The tokens are the same: every backend
computes the same attention, within its rounding.
"""

from __future__ import annotations

import functools
from typing import Callable, ParamSpec, TypeVar

from torch.nn.attention import SDPBackend, sdpa_kernel

#: The backends the engine's loops allow, in torch's order of preference; None lets torch choose from all
#: (benchmarks/gpu_engine.py sets it to compare).
ENGINE_SDPA_BACKENDS: list[SDPBackend] | None = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                  SDPBackend.MATH]

P = ParamSpec("P")
R = TypeVar("R")


def engine_attention(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` with attention restricted to :data:`ENGINE_SDPA_BACKENDS` (read at each call)."""

    @functools.wraps(fn)
    def restricted(*args: P.args, **kwargs: P.kwargs) -> R:
        if ENGINE_SDPA_BACKENDS is None:
            return fn(*args, **kwargs)
        with sdpa_kernel(ENGINE_SDPA_BACKENDS):
            return fn(*args, **kwargs)

    return restricted
