"""The machine a run ran on: library versions, the GPU, the attention implementation (run.json ``environment``).

Collected once per run by the pipeline; the ``environment`` check matches these facts against its rules.
Fast: reads package metadata and ``nvidia-smi``, imports nothing heavy.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
import shutil
import subprocess
import sys
from typing import Any

# Optional serving / kernel packages: run.json key -> distribution names to try (first found wins).
OPTIONAL_PACKAGES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm",),
    "sglang": ("sglang",),
    "flash_attn": ("flash-attn",),
    "flashinfer": ("flashinfer-python", "flashinfer"),
}
NVIDIA_SMI_TIMEOUT_S = 5


def _version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _nvidia_smi() -> dict[str, str]:
    """GPU name and driver from nvidia-smi, without importing torch or touching CUDA."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    first = out.strip().splitlines()[0] if out.strip() else ""
    name, _, driver = first.partition(",")
    return {"gpu": name.strip(), "driver": driver.strip()} if name else {}


def _cuda_version(torch_version: str | None) -> str | None:
    """The CUDA torch was built for: torch.version.cuda when torch is already imported, else the wheel tag."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.version.cuda
    match = re.search(r"\+cu(\d+)(\d)$", torch_version or "")
    return f"{match.group(1)}.{match.group(2)}" if match else None


def collect_environment(attn_implementation: str | None = None) -> dict[str, Any]:
    """Versions and hardware for run.json ``environment``; fast: reads package metadata, imports nothing heavy.

    ``attn_implementation`` is what the engine loaded the models with (it is a loading choice, not a
    property of the machine). Optional packages appear only when installed.
    """
    torch_version = _version("torch")
    environment: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch_version,
        "transformers": _version("transformers"),
        "tokenizers": _version("tokenizers"),
        "cuda": _cuda_version(torch_version),
        "gpu": None,
        "driver": None,
        "attn_implementation": attn_implementation,
    }
    environment.update(_nvidia_smi())
    for key, distributions in OPTIONAL_PACKAGES.items():
        version = _version(*distributions)
        if version is not None:
            environment[key] = version
    return environment
