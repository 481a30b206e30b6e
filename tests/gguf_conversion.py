"""A stand-in for the GGUF-to-transformers conversion, shared by the loading tests and the processes they start."""

from __future__ import annotations

import os
import time
from pathlib import Path


def record_dequantise(gguf_path, out_dir, log: Path, seconds: float = 0.0) -> None:
    """Stands in for the transformers conversion (tens of seconds on a real file): writes a model folder
    and logs when it started and ended, to see whether two conversions overlapped."""
    start = time.time()
    time.sleep(seconds)
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text("{}")
    with log.open("a") as handle:
        handle.write(f"{os.getpid()} {start} {time.time()}\n")
