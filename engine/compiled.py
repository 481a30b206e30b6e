"""A compiled function that can never take a command down: where compiling or running it fails, the eager
function it was compiled from gives the same result.

torch.compile is a speed-up, never a requirement. Users run torch from 2.4 up, each release with its own
Inductor and Triton, and a code generator's bug (an int32 kernel index that overflowed a constant, say) must
cost speed, not the run: the first failure logs one warning line (``-v`` logs the error itself) and every
later call of that function in the process runs eagerly.

Nor is compiling always worth it: a compile costs seconds (on an H200 with torch 2.11, the divergence columns
took about 16 s in a process with empty on-disk caches and about 7 s with them filled), which a command made
of small calls never wins back. :meth:`CompiledOrEager.wanted` rents before it buys: the caller computes
eagerly until the work done that way reaches ``compile_after``, the work whose eager overhead is about one
compile, and only then compiles (at most twice the cost of the best choice made knowing the future).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

_log = logging.getLogger(__name__)


class CompiledOrEager:
    """``fn`` compiled on its first call (``torch.compile(fn, **options)``), eager from its first failure on.

    Out-of-memory errors are raised, not absorbed: the eager function needs more memory than the fused one,
    so falling back would only fail later and slower. ``fn`` must be pure (a failed compiled call may have
    run part of the way before it raised, and the eager call starts again from the same arguments).
    """

    def __init__(self, fn: Callable[..., Any], what: str, compile_after: float = 0, **options: Any) -> None:
        self.fn = fn
        self.what = what
        self.compile_after = compile_after
        self._options = options
        self._compiled: Callable[..., Any] | None = None
        self._eager_work = 0.0
        self.failure: BaseException | None = None

    def wanted(self, work: float) -> bool:
        """Whether a call of ``work`` units (the caller's measure, e.g. scores) should be the compiled one.

        No after a failure; no while the eager work done so far (this call's counted in) stays below
        ``compile_after``; yes from then on, for every later call too.
        """
        if self.failure is not None:
            return False
        if self._compiled is None and self._eager_work + work < self.compile_after:
            self._eager_work += work
            return False
        return True

    def __call__(self, *args: Any) -> Any:
        if self.failure is None:
            try:
                if self._compiled is None:
                    self._compiled = torch.compile(self.fn, **self._options)
                return self._compiled(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:  # noqa: BLE001 - any compiler failure; the eager call below re-raises real bugs
                self.failure = error
                _log.warning(
                    "torch %s could not compile the %s (%s); computing them eagerly: same values, slower (-v says why)",
                    torch.__version__,
                    self.what,
                    type(error).__name__,
                )
                _log.info("the compiler's error: %s", _first_lines(error))
        return self.fn(*args)


def _first_lines(error: BaseException, lines: int = 12) -> str:
    """The head of an error's message: Inductor's messages carry the whole generated kernel."""
    text = str(error).strip().splitlines()
    return "\n".join(text[:lines] + ([f"... ({len(text) - lines} more lines)"] if len(text) > lines else []))
