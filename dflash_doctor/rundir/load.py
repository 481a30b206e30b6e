"""Reading a run directory: ``run.json`` as the typed record and the tables as pandas frames.

A run still going, or killed before it finished, is read from its journal up to its last finished
request; its summary is then computed from those requests (run.json gets one only when the run ends),
which is why loading sits above :mod:`dflash_doctor.stats` in the layers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.run_record import SCHEMA_VERSION, RunRecord
from dflash_doctor.rundir.tables import RUN_JSON, TABLES, read_table_or_empty
from dflash_doctor.rundir.writer import JOURNAL_DIR, read_journal
from dflash_doctor.stats.metrics import summarize


@dataclass
class Run:
    """A loaded run directory: the typed :class:`RunRecord` (run.json) and the tables as pandas frames
    (possibly empty).

    ``complete`` is False for a run read from its journal: still going, or stopped before it finished
    (killed, out of memory), and for a run interrupted by Ctrl-C, SIGTERM or SIGHUP (run.json says
    ``interrupted``); its tables hold every request finished so far and, when run.json has no summary
    yet, the record's summary is computed from them.
    """

    path: Path
    record: RunRecord
    requests: pd.DataFrame = field(repr=False)
    steps: pd.DataFrame = field(repr=False)
    tokens: pd.DataFrame = field(repr=False)
    complete: bool = True

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def meta(self) -> dict[str, Any]:
        """The record in its run.json form, for the templates that render it."""
        return self.record.to_json()


def read_run_meta(run_dir: Path | str) -> dict[str, Any]:
    """Read and validate ``run.json`` alone (cheap: for listing runs)."""
    run_dir = Path(run_dir)
    path = run_dir / RUN_JSON
    if not path.is_file():
        raise UsageError(
            f"{run_dir} is not a run directory (no {RUN_JSON}); pass a "
            "folder written by `dflash-doctor check`, `replay` or `sweep`."
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise UsageError(f"{path} is not valid JSON ({exc}); re-run the command that wrote it.") from None
    if not isinstance(meta, dict):
        raise UsageError(
            f"{path} holds a JSON {type(meta).__name__}, not a run record object; re-run the command that wrote it."
        )
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        older = isinstance(version, int) and version < SCHEMA_VERSION
        raise UsageError(
            f"{path} has schema_version {version!r} but this dflash-doctor reads {SCHEMA_VERSION}"
            + (
                " (the typed run record); re-run the command that wrote "
                "it (check, sweep or replay) to rewrite the run directory."
                if older
                else "; read it with the dflash-doctor version that wrote it."
            )
        )
    # every reader types it with RunRecord.from_json: a field of the wrong shape or type is refused here, once,
    # in one sentence naming the file and the field, instead of an AttributeError deep inside a view
    try:
        _refuse_non_finite(meta, "")
        RunRecord.from_json(meta)
    except RecursionError:
        raise UsageError(
            f"{path} nests its values too deeply for a run record; re-run the command that wrote it."
        ) from None
    except ValueError as exc:
        detail = " ".join(str(exc).split())[:200]
        raise UsageError(
            f"{path} has a field of the wrong shape or type ({detail}); re-run the command that wrote it."
        ) from None
    return meta


def _refuse_non_finite(value: Any, where: str) -> None:
    """A NaN or infinite number anywhere in run.json (``NaN``, ``Infinity``, ``1e999``) is refused with its path:
    the writer stores an undefined number as null, so a non-finite one was put there by hand or by another tool."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(
            f"{where or 'run.json'} is {value!r}, not a finite number (run.json writes an undefined number as null)"
        )
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        _refuse_non_finite(item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key))


def load_run(run_dir: Path | str, tables: Iterable[str] = tuple(TABLES)) -> Run:
    """Load run.json and the requested tables; a missing table loads as an empty frame.

    A run whose journal is still there (in progress, or killed before it closed) loads from the journal
    up to its last finished request and comes back with ``complete=False``.
    """
    run_dir, tables = Path(run_dir), tuple(tables)
    meta = read_run_meta(run_dir)
    if (run_dir / JOURNAL_DIR).is_dir():
        return _load_incomplete(run_dir, meta)
    frames: dict[str, pd.DataFrame] = {}
    for name, schema in TABLES.items():
        frames[name] = (
            read_table_or_empty(run_dir / f"{name}.parquet", schema)
            if name in tables
            else schema.empty_table().to_pandas()
        )
    record = RunRecord.from_json(meta)
    if record.meta.interrupted and record.summary.overall is None:  # stopped before its summary was written
        record.summary = summarize(frames["steps"], frames["requests"], seed=record.seed)
    return Run(
        path=run_dir,
        record=record,
        requests=frames["requests"],
        steps=frames["steps"],
        tokens=frames["tokens"],
        complete=not record.meta.interrupted,
    )


def _load_incomplete(run_dir: Path, meta: dict[str, Any]) -> Run:
    """A run read from its journal, every table (the journal is read whole anyway); its summary is
    computed from the finished requests (run.json gets one only when the run ends), so every view shows
    what was measured so far."""
    frames = {name: table.to_pandas() for name, table in read_journal(run_dir).items()}
    record = RunRecord.from_json(meta)
    if record.summary.overall is None:
        record.summary = summarize(frames["steps"], frames["requests"], seed=record.seed)
    return Run(path=run_dir, record=record, complete=False, **frames)
