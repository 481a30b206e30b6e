"""Finding runs below the dashboard's folder and accepting uploads (a zip or loose files, reduced to the files
a run directory may hold, with a guard against zips that inflate past :data:`MAX_UPLOAD_INFLATED_BYTES`).

Its own module because it is the dashboard's file-system boundary; the other modules only read loaded runs.
"""

from __future__ import annotations

import io
import lzma
import shutil
import zipfile
import zlib
from pathlib import Path
from typing import Iterator, Sequence

from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.load import read_run_meta
from dflash_doctor.rundir.tables import HEAD_TO_HEAD_JSON, RUN_JSON, TABLES, TUNE_JSON
from dflash_doctor.rundir.writer import run_data_files
from dflash_doctor.telemetry.watch_record import UNITS_FILE, WINDOWS_FILE


# Folder depth searched below RUNS_DIR: runs/<name>/run.json and runs/<group>/<name>/run.json.
MAX_RUN_SEARCH_DEPTH = 2


# Files a run directory may hold; an upload is reduced to exactly these (anything else is ignored).
# A watch run adds its time series (windows) and raw counts (units): the Production page and a canary
# compare read them.
RUN_FILE_NAMES = (RUN_JSON, *(f"{name}.parquet" for name in TABLES), WINDOWS_FILE, UNITS_FILE)


# A zip that inflates past this is refused rather than filling the disk (zip bomb guard).
MAX_UPLOAD_INFLATED_BYTES = 2 * 1024**3


# What zipfile raises on a damaged or unsupported member: a corrupt deflate stream (zlib.error), a bad CRC or a
# central directory that lies about sizes or offsets (BadZipFile), an encrypted member (RuntimeError), a
# compression method it does not know (NotImplementedError), a truncated stream (EOFError), bad bzip2 or lzma
# data (OSError, LZMAError).
_DAMAGED_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zlib.error,
    RuntimeError,
    NotImplementedError,
    EOFError,
    OSError,
    lzma.LZMAError,
)


def find_runs(root: Path | str, skipped: list[tuple[Path, str]] | None = None) -> list[Path]:
    """Run directories under ``root`` (``root`` itself when it is a run), newest ``created_at`` first.

    A folder whose run.json does not parse or has another schema version is skipped here; opening it
    directly still shows the loader's one-sentence reason.
    """
    root = Path(root)
    if (root / RUN_JSON).is_file():
        return [root]
    if not root.is_dir():
        return []
    found: list[tuple[str, Path]] = []
    for run_json in _files_below(root, RUN_JSON):
        try:
            created_at = str(read_run_meta(run_json.parent).get("created_at", ""))
        except UsageError as exc:
            if skipped is not None:  # the sidebar names them, so a run that vanished from the list is explained
                skipped.append((run_json.parent, exc.message))
            continue
        found.append((created_at, run_json.parent))
    found.sort(key=lambda item: (item[0], str(item[1])), reverse=True)
    return [path for _, path in found]


def find_tune_runs(root: Path | str) -> list[Path]:
    """`tune` run directories (tune.json) under ``root``, as deep as :func:`find_runs` looks, last name first
    (the default names carry the time)."""
    return sorted((path.parent for path in _files_below(Path(root), TUNE_JSON)), key=str, reverse=True)


def find_head_to_heads(root: Path | str) -> list[Path]:
    """Head-to-head folders (head_to_head.json) under ``root``, as :func:`find_tune_runs` finds tune runs."""
    return sorted((path.parent for path in _files_below(Path(root), HEAD_TO_HEAD_JSON)), key=str, reverse=True)


def _files_below(root: Path, name: str) -> Iterator[Path]:
    """Files called ``name`` one to :data:`MAX_RUN_SEARCH_DEPTH` folders below ``root``: where runs are looked for."""
    for depth in range(1, MAX_RUN_SEARCH_DEPTH + 1):
        yield from root.glob("/".join(["*"] * depth) + "/" + name)


def run_mtime_ns(run_dir: Path | str) -> int:
    """Newest modification time of the run's files (journal included): the cache key that notices a
    rewritten run, and a run in progress growing."""
    return max((path.stat().st_mtime_ns for path in run_data_files(run_dir)), default=0)


def save_upload(files: Sequence[tuple[str, bytes]], dest: Path) -> Path:
    """Turn uploaded files into a run directory at ``dest`` and return it.

    ``files`` is ``(file name, bytes)`` pairs: one zip of a run directory, or the run's own files
    (run.json plus any of the Parquet tables). Only the known run file names are written, by base
    name, so a hostile zip cannot write outside ``dest`` (no path traversal) or fill the disk.
    """
    if not files:
        raise UsageError("No file was uploaded; upload a zip of a run directory or its run.json and .parquet files.")
    chosen: dict[str, bytes] = {}
    for file_name, payload in files:
        base = Path(file_name).name
        if base.lower().endswith(".zip"):
            chosen.update(_run_files_from_zip(base, payload))
        elif base in RUN_FILE_NAMES:
            chosen[base] = payload
        else:
            raise UsageError(
                f"Uploaded file {base!r} is not part of a run; upload a .zip of "
                f"a run directory or files named {', '.join(RUN_FILE_NAMES)}."
            )
    if RUN_JSON not in chosen:
        raise UsageError(
            f"The upload has no {RUN_JSON}; include the run directory's {RUN_JSON} (it holds the summary and checks)."
        )
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for base, payload in chosen.items():
        (dest / base).write_bytes(payload)
    read_run_meta(dest)  # fail now, with the loader's sentence, rather than on every page
    return dest


def _run_files_from_zip(zip_name: str, payload: bytes) -> dict[str, bytes]:
    """The run files inside a zip; when it holds several runs, the shallowest run.json wins."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(payload))
    except _DAMAGED_ZIP_ERRORS:
        raise UsageError(
            f"{zip_name} is not a valid zip file; zip the run directory again (e.g. `zip -r run.zip RUN_DIR`)."
        ) from None
    with archive:
        members = [m for m in archive.infolist() if not m.is_dir()]
        if sum(m.file_size for m in members) > MAX_UPLOAD_INFLATED_BYTES:
            raise UsageError(
                f"{zip_name} inflates to more than {MAX_UPLOAD_INFLATED_BYTES // 1024**3} "
                "GiB; upload only run.json and the .parquet files."
            )
        run_jsons = sorted(
            (m for m in members if Path(m.filename).name == RUN_JSON), key=lambda m: m.filename.count("/")
        )
        if not run_jsons:
            raise UsageError(
                f"{zip_name} holds no {RUN_JSON}; zip a run directory "
                "written by `dflash-doctor check`, `replay` or `sweep`."
            )
        run_folder = Path(run_jsons[0].filename).parent
        wanted = [
            m for m in members if Path(m.filename).parent == run_folder and Path(m.filename).name in RUN_FILE_NAMES
        ]
        try:
            return {Path(m.filename).name: archive.read(m) for m in wanted}
        except _DAMAGED_ZIP_ERRORS as exc:
            # a zip made on another machine or cut in transit: one sentence in the sidebar, not a traceback
            detail = " ".join(str(exc).split())[:120] or type(exc).__name__
            raise UsageError(
                f"{zip_name} cannot be unpacked ({detail}); "
                "zip the run directory again without a password "
                "(e.g. `zip -r run.zip RUN_DIR`)."
            ) from None
