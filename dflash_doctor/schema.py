"""The run directory: the single source of truth that every view reads.

A run directory holds ``run.json`` (metadata, checks, summary, recommendation) and three Parquet tables
(``requests``, ``steps``, ``tokens``) whose columns are fixed here. It is versioned by
``schema_version`` and loads without pickle. The engine streams rows into it through
:class:`RunWriter`, so a run stopped in any way (Ctrl-C, ``kill -9``, out of memory) keeps every request
it finished, readable by every view, also while it is still going.

Column conventions (shapes and units live in the names):

* ``position`` in ``steps`` is the number of output tokens committed before the step; in ``tokens``
  it is the output index of the token the draft slot predicts (``step position + offset - 1``).
* ``offset`` is the 1-based slot inside the drafted block (vLLM's "position" of
  ``num_accepted_tokens_per_pos`` is ``offset - 1``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_doctor.errors import UsageError
from dflash_doctor.record import SCHEMA_VERSION, RunMeta, RunRecord

RUN_JSON = "run.json"

def _column(arrow_type: pa.DataType, name: str | None = None) -> Any:
    """A row field with its Arrow type (and its column name when the field name cannot be it, e.g. ``class``)."""
    return field(metadata={"arrow": arrow_type, "column": name})


def arrow_schema(row_type: type) -> pa.Schema:
    """The Arrow schema of a row dataclass: one column per field, in field order."""
    return pa.schema([(f.metadata["column"] or f.name, f.metadata["arrow"]) for f in dataclasses.fields(row_type)])


def as_row(row: Any) -> dict[str, Any]:
    """A row dataclass as the dict the writer takes (column names as keys)."""
    return {f.metadata["column"] or f.name: getattr(row, f.name) for f in dataclasses.fields(row)}


@dataclass
class RequestRow:
    """One replayed turn of one request (``requests.parquet``)."""

    request_id: str = _column(pa.string())
    request_class: str = _column(pa.string(), "class")
    subclass: str = _column(pa.string())
    turn: int = _column(pa.int16())
    prompt_num_tokens: int = _column(pa.int32())
    output_token_ids: list[int] = _column(pa.list_(pa.int32()))
    output_text: str = _column(pa.string())
    num_output_tokens: int = _column(pa.int32())
    num_steps: int = _column(pa.int32())
    num_drafts: int = _column(pa.int32())
    num_draft_tokens: int = _column(pa.int32())
    num_accepted_tokens: int = _column(pa.int32())
    tau: float | None = _column(pa.float64())
    stop_reason: str = _column(pa.string())
    wall_time_s: float = _column(pa.float64())


@dataclass
class StepRow:
    """One speculative step (``steps.parquet``): the engine's step record plus its request and class."""

    request_id: str = _column(pa.string())
    request_class: str = _column(pa.string(), "class")
    step: int = _column(pa.int32())
    position: int = _column(pa.int32())
    k: int = _column(pa.int16())
    num_drafted: int = _column(pa.int16())
    num_accepted: int = _column(pa.int16())
    bonus_token: int = _column(pa.int32())
    draft_time_s: float = _column(pa.float64())
    verify_time_s: float = _column(pa.float64())


@dataclass
class TokenRow:
    """One drafted token against the target's (``tokens.parquet``): the engine's divergence record."""

    request_id: str = _column(pa.string())
    request_class: str = _column(pa.string(), "class")
    step: int = _column(pa.int32())
    position: int = _column(pa.int32())
    offset: int = _column(pa.int16())
    draft_token: int = _column(pa.int32())
    target_token: int = _column(pa.int32())
    draft_text: str = _column(pa.string())
    target_text: str = _column(pa.string())
    accepted: bool = _column(pa.bool_())
    target_prob_of_draft: float = _column(pa.float32())
    draft_prob_of_target: float = _column(pa.float32())
    target_rank_in_draft: int = _column(pa.int32())
    kl_target_draft: float = _column(pa.float32())
    total_variation: float = _column(pa.float32())
    target_entropy: float = _column(pa.float32())
    target_top1_margin: float = _column(pa.float32())  # p1 - p2 of the target at T = 1: a miss near a tie is irreducible
    draft_topk_ids: list[int] = _column(pa.list_(pa.int32()))
    target_topk_ids: list[int] = _column(pa.list_(pa.int32()))
    target_category: str = _column(pa.string())  # dflash_doctor.deviations.CATEGORIES, from the target tokenizer's pieces
    draft_category: str = _column(pa.string())  # the same for the drafted token


REQUESTS_SCHEMA = arrow_schema(RequestRow)
STEPS_SCHEMA = arrow_schema(StepRow)
TOKENS_SCHEMA = arrow_schema(TokenRow)

TABLES: dict[str, pa.Schema] = {
    "requests": REQUESTS_SCHEMA,
    "steps": STEPS_SCHEMA,
    "tokens": TOKENS_SCHEMA,
}


def utc_now() -> str:
    """ISO-8601 UTC timestamp, second precision, as stored in ``created_at``."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def _json_safe(value: Any) -> Any:
    """Make numpy scalars, NaN and paths JSON-clean (NaN becomes null: JSON has no NaN)."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def new_run_meta(config: dict[str, Any] | None = None, command: str = "replay") -> dict[str, Any]:
    """The run.json of a run that has just started: every section present, nothing measured yet."""
    return RunRecord(meta=RunMeta(command=command, created_at=utc_now()), config=dict(config or {})).to_json()


def write_run_json(run_dir: Path, meta: dict[str, Any]) -> Path:
    """Write ``run.json`` atomically (write then rename), so a crash never leaves half a file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RUN_JSON
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(meta), indent=2, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


JOURNAL_DIR = "journal"
# The order a finished request's rows are appended in: its requests row last, so that row is the commit
# mark of its steps and tokens (a reader keeps steps/tokens only of requests it has a row for).
JOURNAL_ORDER = ("steps", "tokens", "requests")


def journal_path(run_dir: Path, table: str) -> Path:
    """The append-only journal of one table: an Arrow IPC stream, one record batch per finished request."""
    return run_dir / JOURNAL_DIR / f"{table}.arrows"


def run_data_files(run_dir: Path | str) -> list[Path]:
    """The files a run's content lives in right now (run.json, the tables or their journal)."""
    run_dir = Path(run_dir)
    names = [run_dir / RUN_JSON, *(run_dir / f"{name}.parquet" for name in TABLES)]
    names += [journal_path(run_dir, name) for name in TABLES]
    return [path for path in names if path.is_file()]


class RunWriter:
    """Streams request, step and token rows into the run directory as requests finish.

    Parquet only becomes readable when its footer is written at close, so rows first go to an
    append-only journal (``journal/<table>.arrows``, Arrow IPC streams, one record batch per finished
    request, written through to the OS at every :meth:`flush`). A run killed hard (``kill -9``, out of
    memory) or still going therefore stays readable up to its last finished request (:func:`load_run`
    reads the journal). :meth:`close` consolidates the journal into the three Parquet files, removes
    it and rewrites ``run.json``; ``run.json`` is written at the start, so a run is listed and opened
    from its first second.
    """

    def __init__(self, run_dir: Path | str, meta: dict[str, Any]):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.meta = meta
        self._buffers: dict[str, list[dict[str, Any]]] = {name: [] for name in TABLES}
        # A folder reused by --out must not mix an earlier run's rows into this one.
        shutil.rmtree(self.run_dir / JOURNAL_DIR, ignore_errors=True)
        for name in TABLES:
            (self.run_dir / f"{name}.parquet").unlink(missing_ok=True)
        (self.run_dir / JOURNAL_DIR).mkdir()
        self._sinks = {name: pa.OSFile(str(journal_path(self.run_dir, name)), "wb") for name in TABLES}
        self._streams = {name: pa.ipc.new_stream(self._sinks[name], TABLES[name]) for name in TABLES}
        write_run_json(self.run_dir, meta)

    def add(self, table: str, rows: Iterable[dict[str, Any]]) -> None:
        self._buffers[table].extend(rows)

    def append(self, tables: dict[str, pa.Table]) -> None:
        """Append whole Arrow tables to the journal, requests last (a merge of rows written elsewhere:
        no round trip through Python rows)."""
        self.flush()
        for name in JOURNAL_ORDER:
            self._streams[name].write_table(tables[name].cast(TABLES[name]))
            self._sinks[name].flush()

    def flush(self) -> None:
        """Append the buffered rows to the journal (call it once per finished request)."""
        for name in JOURNAL_ORDER:
            rows = self._buffers[name]
            if not rows:
                continue
            self._streams[name].write_batch(pa.RecordBatch.from_pylist(rows, schema=TABLES[name]))
            self._sinks[name].flush()
            rows.clear()

    def close(self) -> None:
        """Flush, consolidate the journal into the Parquet files (atomically, each via a temporary
        file), remove the journal and write run.json."""
        self.flush()
        for name in TABLES:
            self._streams[name].close()
            self._sinks[name].close()
        for name, table in read_journal(self.run_dir).items():
            path = self.run_dir / f"{name}.parquet"
            tmp = path.with_name(path.name + ".tmp")
            pq.write_table(table, tmp)
            tmp.replace(path)
        shutil.rmtree(self.run_dir / JOURNAL_DIR)
        write_run_json(self.run_dir, self.meta)

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_stream(path: Path, schema: pa.Schema) -> pa.Table:
    """Every complete record batch of a journal file; a batch cut short by a kill (or still being
    written) ends the read instead of failing it."""
    batches: list[pa.RecordBatch] = []
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(path.read_bytes()))
        while True:
            batches.append(reader.read_next_batch())
    except StopIteration:
        pass
    except (pa.ArrowInvalid, OSError):
        pass  # a torn last batch, or not even the schema yet: keep what was complete
    return pa.Table.from_batches(batches, schema=schema)


def read_journal(run_dir: Path) -> dict[str, pa.Table]:
    """The journal's tables, consistent across tables: steps and tokens only of committed requests.

    ``requests`` is read first: a request row is appended after its steps and tokens, so whatever the
    writer does meanwhile, every request read here has all of its rows in the other two files.
    """
    requests = _read_stream(journal_path(run_dir, "requests"), REQUESTS_SCHEMA)
    committed = requests.column("request_id")
    tables = {"requests": requests}
    for name in ("steps", "tokens"):
        table = _read_stream(journal_path(run_dir, name), TABLES[name])
        # pyarrow.compute defines its kernels when it is imported: no static checker sees `is_in`.
        tables[name] = table.filter(pc.is_in(table.column("request_id"), value_set=committed))  # pyright: ignore[reportAttributeAccessIssue]
    return tables


@dataclass
class Run:
    """A loaded run directory: the typed :class:`RunRecord` (run.json) and the tables as pandas frames
    (possibly empty).

    ``complete`` is False for a run read from its journal: still going, or stopped before it finished
    (killed, out of memory); its tables hold every request finished so far and, when run.json has no
    summary yet, the record's summary is computed from them.
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
        raise UsageError(f"{run_dir} is not a run directory (no {RUN_JSON}); pass a folder written by `dflash-doctor check`, `replay` or `sweep`.")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is not valid JSON ({exc}); re-run the command that wrote it.") from None
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        older = isinstance(version, int) and version < SCHEMA_VERSION
        raise UsageError(
            f"{path} has schema_version {version!r} but this dflash-doctor reads {SCHEMA_VERSION}"
            + (" (the typed run record); re-run the command that wrote it (check, sweep or replay) to rewrite the run directory."
               if older else "; read it with the dflash-doctor version that wrote it.")
        )
    return meta


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
        path = run_dir / f"{name}.parquet"
        if name in tables and path.is_file():
            frames[name] = pq.read_table(path).to_pandas()
        else:
            frames[name] = schema.empty_table().to_pandas()
    return Run(path=run_dir, record=RunRecord.from_json(meta), requests=frames["requests"], steps=frames["steps"], tokens=frames["tokens"])


def _load_incomplete(run_dir: Path, meta: dict[str, Any]) -> Run:
    """A run read from its journal, every table (the journal is read whole anyway); its summary is
    computed from the finished requests (run.json gets one only when the run ends), so every view shows
    what was measured so far."""
    from dflash_doctor.metrics import summarize

    frames = {name: table.to_pandas() for name, table in read_journal(run_dir).items()}
    if not (meta.get("summary") or {}).get("overall"):
        seed = (meta.get("config") or {}).get("seed", 0)
        meta = {**meta, "summary": summarize(frames["steps"], frames["requests"], seed=seed)}
    return Run(path=run_dir, record=RunRecord.from_json(meta), complete=False, **frames)
