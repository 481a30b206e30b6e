"""Writing a run directory: the one source of truth that every view reads.

A run directory holds ``run.json`` (the typed :class:`~dflash_doctor.rundir.run_record.RunRecord`) and the
three tables of :mod:`dflash_doctor.rundir.tables`. It is versioned by ``schema_version`` and loads
without pickle. The engine streams rows into it through :class:`RunWriter`, so a run stopped in any way
(Ctrl-C, ``kill -9``, out of memory) keeps every request it finished, readable by every view
(:mod:`dflash_doctor.rundir.load`), also while it is still going.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_doctor.rundir.ownership import release_run_dir
from dflash_doctor.rundir.tables import COSTS_FILE, COSTS_SCHEMA, REQUESTS_SCHEMA, RUN_JSON, TABLES


def utc_now() -> str:
    """ISO-8601 UTC timestamp, second precision, as stored in ``created_at``."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def json_safe(value: Any) -> Any:
    """Make numpy scalars, NaN and paths JSON-clean (NaN becomes null: JSON has no NaN)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_text_atomic(path: Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through ``<name>.tmp`` beside it and a rename: the one writer of
    run.json and the reports, so a crash or a full disk never leaves half a file (the earlier file stays
    whole until the new one is) and the temporary file goes when writing fails."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_run_json(run_dir: Path, meta: dict[str, Any]) -> Path:
    """Write ``run.json`` atomically (:func:`write_text_atomic`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(run_dir / RUN_JSON, json.dumps(json_safe(meta), indent=2, sort_keys=False) + "\n")


def write_costs_table(run_dir: Path, table: pa.Table) -> Path:
    """Write ``costs.parquet`` (the raw step timings) atomically, in the declared schema."""
    path = run_dir / COSTS_FILE
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table.select(COSTS_SCHEMA.names).cast(COSTS_SCHEMA), tmp)
    tmp.replace(path)
    return path


JOURNAL_DIR = "journal"
PARTS_DIR = "parts"  # a sharded replay's per-rank run directories, merged into the run directory and removed
# The order a finished request's rows are appended in: its requests row last, so that row is the commit
# mark of its steps and tokens (a reader keeps steps/tokens only of requests it has a row for).
JOURNAL_ORDER = ("steps", "tokens", "requests")


def journal_path(run_dir: Path, table: str) -> Path:
    """The append-only journal of one table: an Arrow IPC stream, one record batch per finished request."""
    return run_dir / JOURNAL_DIR / f"{table}.arrows"


def part_dir(run_dir: Path | str, rank: int) -> Path:
    """Where one torchrun rank writes its share of a sharded replay: a run directory of its own below the run's,
    which :meth:`RunWriter.from_parts` merges."""
    return Path(run_dir) / PARTS_DIR / f"rank-{rank}"


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

    Leaving its ``with`` block on an interrupt (Ctrl-C, or SIGTERM / SIGHUP, which
    :mod:`dflash_doctor.processes` raise as one) records the run as ``interrupted`` in ``run.json``, at
    whatever stage the interrupt came: one rule for every signal and every stage, so a stopped run is never
    written as a finished one.
    """

    def __init__(self, run_dir: Path | str, meta: dict[str, Any]):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.meta = meta
        self._buffers: dict[str, list[dict[str, Any]]] = {name: [] for name in TABLES}
        # A folder reused by --out --overwrite (rundir.ownership) must not mix an earlier run's rows into this one.
        shutil.rmtree(self.run_dir / JOURNAL_DIR, ignore_errors=True)
        for name in TABLES:
            (self.run_dir / f"{name}.parquet").unlink(missing_ok=True)
        (self.run_dir / COSTS_FILE).unlink(missing_ok=True)
        (self.run_dir / JOURNAL_DIR).mkdir()
        self._sinks = {name: pa.OSFile(str(journal_path(self.run_dir, name)), "wb") for name in TABLES}
        self._streams = {name: pa.ipc.new_stream(self._sinks[name], TABLES[name]) for name in TABLES}
        write_run_json(self.run_dir, meta)

    @classmethod
    def from_parts(
        cls, run_dir: Path | str, meta: dict[str, Any], world_size: int, order: Mapping[str, int]
    ) -> "RunWriter":
        """The run directory's writer holding the rows of every rank's part (:func:`part_dir`), each table's rows
        in ``order`` of their ``request_id`` (the position of each turn in the merged replay), the parts removed:
        the run directory one process writes of the same requests. The layout of the parts and their merge live
        here, with the rest of the run directory's; the ranks and their replays are
        :mod:`dflash_doctor.replay.sharding`'s."""
        writer = cls(run_dir, meta)
        parts = [part_dir(run_dir, rank) for rank in range(world_size)]
        writer.append(
            {
                name: _in_order(pa.concat_tables([pq.read_table(part / f"{name}.parquet") for part in parts]), order)
                for name in TABLES
            }
        )
        shutil.rmtree(Path(run_dir) / PARTS_DIR)
        return writer

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

    def close(self, *, interrupted: bool = False) -> None:
        """Flush, consolidate the journal into the Parquet files (atomically, each via a temporary
        file), remove the journal and write run.json (``interrupted``: marked so, the command was stopped)."""
        if interrupted:
            self.meta = {**self.meta, "interrupted": True}
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
        release_run_dir(self.run_dir)  # the command that claimed the folder (rundir.ownership) is done writing it

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        self.close(interrupted=isinstance(exc, KeyboardInterrupt))


def _in_order(table: pa.Table, order: Mapping[str, int]) -> pa.Table:
    """Rows in the order of their turn (stable: the steps and tokens of a turn keep theirs)."""
    keys = np.array([order[key] for key in table.column("request_id").to_pylist()], dtype=np.int64)
    return table.take(pa.array(np.argsort(keys, kind="stable")))


def read_stream(path: Path, schema: pa.Schema) -> pa.Table:
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
    requests = read_stream(journal_path(run_dir, "requests"), REQUESTS_SCHEMA)
    committed = requests.column("request_id")
    tables = {"requests": requests}
    for name in ("steps", "tokens"):
        table = read_stream(journal_path(run_dir, name), TABLES[name])
        # pyarrow.compute defines its kernels when it is imported: no static checker sees `is_in`.
        tables[name] = table.filter(
            pc.is_in(table.column("request_id"), value_set=committed),  # pyright: ignore[reportAttributeAccessIssue]
        )
    return tables
