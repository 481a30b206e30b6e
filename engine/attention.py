"""The attention kernels the live loop lets torch choose from: every scaled-dot-product backend except cuDNN's.

On Hopper GPUs torch 2.11 runs ``scaled_dot_product_attention`` through cuDNN first, and cuDNN builds an
execution plan for every new pair of query and key lengths before it runs one. The live loop meets a new pair
at almost every step (the context grows by the accepted tokens, and every request of a workload has its own
length). Measured on an H200 (Qwen3-8B shape, a 1,024-token prompt, 96 new tokens): with cuDNN the first
live-loop call of a process took 15.4 s against 3.8 s for the same call repeated (113 ms per step against
37 ms); without it the first call took 5.5 s and a call at a length never seen before ran its steps as fast
as a repeated one, while the steady step stayed within the same ratio of its floor (1.04-1.07).
FlashAttention and the memory-efficient kernel need no such plan; where neither takes a call (a mask or a
head size they do not support), torch's math kernel runs it. The tokens are the same within rounding.

The teacher-forced pass (engine/teacher.py) keeps torch's choice: it runs one call per request over fixed
shapes, and its masked draft blocks run on cuDNN twice as fast as on the other kernels (286 ms against
576 ms for 2,112 tokens in the same run: 61% of the H200's nominal bf16 rate against 30%).
"""

from __future__ import annotations

import functools
from typing import Callable, ParamSpec, TypeVar

from torch.nn.attention import SDPBackend, sdpa_kernel

#: The backends the live loop allows, in torch's order of preference; None lets torch choose from all
#: (benchmarks/gpu_engine.py sets it to compare).
ENGINE_SDPA_BACKENDS: list[SDPBackend] | None = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]

P = ParamSpec("P")
R = TypeVar("R")


def engine_attention(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` with attention restricted to :data:`ENGINE_SDPA_BACKENDS` (read at each call).

    Args:
        fn: the function to wrap, typically a live-loop entry point (a decorator's argument).

    Returns:
        ``fn`` wrapped: the same signature and result, each call inside ``sdpa_kernel`` of the backends
        (or unrestricted while :data:`ENGINE_SDPA_BACKENDS` is None).
    """

    @functools.wraps(fn)
    def restricted(*args: P.args, **kwargs: P.kwargs) -> R:
        if ENGINE_SDPA_BACKENDS is None:
            return fn(*args, **kwargs)
        with sdpa_kernel(ENGINE_SDPA_BACKENDS):
            return fn(*args, **kwargs)

    return restricted
