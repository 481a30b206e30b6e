"""A local Hugging Face hub cache folder built by a test (nothing can be downloaded here).

:func:`hub_snapshot` writes the layout huggingface_hub itself writes and reads back
(``models--org--name/{refs/<ref>, snapshots/<commit>/...}``); :func:`offline_hub_cache` points the
installed huggingface_hub at a folder and keeps it offline.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def offline_hub_cache(monkeypatch, folder: Path) -> Path:
    """Make ``folder`` the hub cache for this test, offline (huggingface_hub reads its constants per call)."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return folder


def hub_snapshot(
    cache: Path, repo_id: str, commit: str, files: dict[str, str] | Path, refs: tuple[str, ...] = ("main",)
) -> Path:
    """The snapshot folder of ``repo_id`` at ``commit``, holding ``files`` (name -> text) or a copy of a folder;
    each ref in ``refs`` (a branch or tag) points at the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    if isinstance(files, Path):
        shutil.copytree(files, snapshot)
    else:
        snapshot.mkdir(parents=True)
        for name, text in files.items():
            (snapshot / name).write_text(text)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
