"""What a warm GGUF load pays before any work starts: finding the converted model in the cache.

Side by side on the same file: the key every load computed before (a SHA-256 of the whole file) and the
key it computes now (:func:`dflash_doctor.models.loading.gguf_cache_key`: size, mtime, first and last MiB), and
the whole warm ``resolve_model_dir`` (key + cache look-up) on the converted demo target. The file is read
once first, so both keys read from the page cache (the old key pays more again on a cold disk). Prints
median seconds of ``--repeats`` calls and the ratio; not a test, nothing asserts.

    python benchmarks/gguf_cache_key.py [--gguf FILE] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from pathlib import Path

from dflash_doctor.models import loading


def whole_file_sha256(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """The previous cache key: every byte of the file, on every load."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()[:20]


def median_seconds(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="a GGUF file (default: the demo target)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    gguf = args.gguf or loading.demo_target_path()
    loading.resolve_model_dir(str(gguf))  # converted (once) and read into the page cache
    before = median_seconds(lambda: whole_file_sha256(gguf), args.repeats)
    after = median_seconds(lambda: loading.gguf_cache_key(gguf), args.repeats)
    warm_load = median_seconds(lambda: loading.resolve_model_dir(str(gguf)), args.repeats)
    print(f"{gguf.name}: {gguf.stat().st_size / 1e6:.0f} MB, median of {args.repeats}")
    print(f"  cache key, whole-file SHA-256 (before): {before * 1e3:8.2f} ms")
    print(f"  cache key, size+mtime+head/tail (now):  {after * 1e3:8.2f} ms   ({before / after:.0f}x less)")
    print(f"  warm resolve_model_dir (key + look-up): {warm_load * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
