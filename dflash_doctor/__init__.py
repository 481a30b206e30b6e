"""dflash-doctor: diagnostics for speculative decoding (DFlash block-diffusion and autoregressive drafts).

OpenMP threads that wait at a barrier sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE`` unless the
user set a policy). Set here, before anything imports torch, because libgomp reads it once when it loads.
Why: on a small machine shared with other work (2 CPU cores, several processes), a spinning thread holds
a core its sibling needs to finish, and torch's forwards slowed 10-20x (benchmarks/check_stages.py, docs/benchmarks.md).
The threads and how work is split among them are unchanged, so every figure is bit-identical.

``__version__`` is read from the installed distribution's metadata, so ``pyproject.toml`` is the one
place a release sets it.
"""

import os
from importlib.metadata import version

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = version("dflash-doctor")
