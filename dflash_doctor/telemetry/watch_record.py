"""A watch's run directory: the typed run record with ``source.kind = "telemetry"``, plus the time series.

Production has no per-step rows, so ``requests`` / ``steps`` / ``tokens`` are written empty (every view
still loads the directory) and the substance is ``windows.parquet``: one row per series and window with
vLLM's metric names, the baseline, the net speedup and the alerts (:meth:`WindowVerdict.as_row`), and
``units.parquet``, the raw counts between scrapes. The record's ``summary`` pools every unit of the watch,
per class, in the same :class:`~dflash_doctor.rundir.run_record.Metrics` a ``check`` run has, so ``report`` and the
dashboard's overview read it unchanged (requests are not observed: ``num_requests`` is 0);
``source.details`` holds what only a watch has (sources, window length, events, alerts).

Bounded over a days-long watch: each evaluation *appends* its rows to an Arrow IPC journal per table
(``journal/windows.arrows``, ``journal/units.arrows``, as the run journal of :mod:`dflash_doctor.rundir.writer`)
and rewrites only ``run.json``; the summary comes from running totals per series and a bounded uniform
sample of units for its bootstrap. The journal is consolidated into the Parquet files at the end, on
demand and every hour (:data:`CONSOLIDATE_EVERY_S`), dropping rows older than the retention
(``--retain``) when there is one, so memory, disk and the cost of a poll stay flat. A watch killed at any moment leaves
a readable directory: readers take the Parquet rows plus every complete journal batch.

The folder is the watch's for the life of its process (:mod:`dflash_doctor.rundir.ownership`): a second
watch on it is refused. A watch started on the folder of an earlier watch (a service restarted on the
same ``--out``, a cron ``--once`` every few minutes) continues it: the earlier windows, units and alerts
are kept and the new ones appended, rows a killed watch left in its journal included, and the summary
goes on pooling every unit of the watch: the units the retention dropped from the folder are kept in
run.json as totals per series (``source.details["expired"]``), so a service restarted on a ``--retain``
folder reports the same whole-watch figures as one that never stopped (only the bootstrap sample behind
the intervals is drawn from the units still in the folder). ``--overwrite`` starts a new watch there instead.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, TypedDict, cast

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_doctor.errors import UsageError
from dflash_doctor.stats.metrics import conditional_rates
from dflash_doctor.rundir.load import read_run_meta
from dflash_doctor.rundir.ownership import claim_run_dir, release_run_dir
from dflash_doctor.rundir.run_record import Metrics, ModelInfo, RunMeta, RunRecord, Source, Summary, TauDistribution
from dflash_doctor.rundir.tables import TABLES, read_parquet_table
from dflash_doctor.serving.responses import histogram_from_per_pos
from dflash_doctor.rundir.writer import JOURNAL_DIR, journal_path, read_stream, utc_now, write_run_json
from dflash_doctor.telemetry.counts import ALL_CLASSES, SeriesKey, SpecCounts, rate_intervals, window_tau_interval
from dflash_doctor.telemetry.verdict import WindowVerdict
from dflash_doctor.telemetry.watcher import Event, Unit

SOURCE_TELEMETRY = "telemetry"
WINDOWS_FILE = "windows.parquet"
UNITS_FILE = "units.parquet"  # the raw, non-overlapping counts between scrapes (canary compares resample them)
# Units per series (and overall) kept for the summary's bootstrap: a uniform sample of the whole watch.
SUMMARY_SAMPLE_UNITS = 256
# The journal is folded into the Parquet files at least this often: a journal batch of a few rows carries
# about a kilobyte of framing, while Parquet keeps a day of windows in a few hundred.
CONSOLIDATE_EVERY_S = 3600.0

UNITS_SCHEMA = pa.schema(
    [
        ("end_s", pa.float64()),
        ("model", pa.string()),
        ("class", pa.string()),
        ("source", pa.string()),
        ("num_drafts", pa.float64()),
        ("num_draft_tokens", pa.float64()),
        ("num_accepted_tokens", pa.float64()),
        ("num_accepted_tokens_per_pos", pa.list_(pa.float64())),
        ("num_generated_tokens", pa.float64()),
    ]
)

WINDOWS_SCHEMA = pa.schema(
    [
        ("end_s", pa.float64()),
        ("start_s", pa.float64()),
        ("model", pa.string()),
        ("class", pa.string()),
        ("status", pa.string()),
        ("num_drafts", pa.float64()),
        ("num_draft_tokens", pa.float64()),
        ("num_accepted_tokens", pa.float64()),
        ("num_accepted_tokens_per_pos", pa.list_(pa.float64())),
        ("num_generated_tokens", pa.float64()),
        ("mean_acceptance_length", pa.float64()),
        ("mean_acceptance_length_lo", pa.float64()),
        ("mean_acceptance_length_hi", pa.float64()),
        ("draft_acceptance_rate", pa.float64()),
        ("acceptance_rate_per_pos", pa.list_(pa.float64())),
        ("k", pa.int32()),
        ("baseline_tau", pa.float64()),
        ("baseline_tau_lo", pa.float64()),
        ("baseline_tau_hi", pa.float64()),
        ("engine_mean_acceptance_length", pa.float64()),
        ("speedup", pa.float64()),
        ("best_k", pa.int32()),
        ("best_speedup", pa.float64()),
        ("alerts", pa.list_(pa.string())),
        ("alert_messages", pa.list_(pa.string())),
        ("advice", pa.list_(pa.string())),
        ("notes", pa.list_(pa.string())),
    ]
)


def _count(value: float | None) -> int:
    return int(round(value or 0.0))


def _summary_block(counts: SpecCounts, units: list[SpecCounts], num_units: int) -> Metrics:
    """One summary scope from pooled counts and a uniform sample ``units`` of its ``num_units`` (the fields
    ``check`` writes; no requests in telemetry)."""
    rates = counts.acceptance_rate_per_pos
    per_pos = [_count(v) for v in counts.num_accepted_tokens_per_pos or ()]
    drafts = _count(counts.num_drafts)
    ci = window_tau_interval(counts, units, num_units)
    generated = counts.num_generated_tokens
    rate_cis: list[list[float | None]] = [[lo, hi] for lo, hi in rate_intervals(counts) or []]
    wasted = None
    if generated and counts.num_draft_tokens is not None and counts.accepted is not None:
        wasted = (counts.num_draft_tokens - counts.accepted) / generated
    return Metrics(
        num_requests=0,
        num_output_tokens=_count(generated),
        num_drafts=drafts,
        num_draft_tokens=_count(counts.num_draft_tokens),
        num_accepted_tokens=_count(counts.accepted),
        num_accepted_tokens_per_pos=per_pos,
        mean_acceptance_length=counts.mean_acceptance_length,
        mean_acceptance_length_ci=list(ci) if ci else [None, None],
        acceptance_rate_per_pos=list(rates or []),
        acceptance_rate_per_pos_ci=rate_cis,
        conditional_acceptance_rate_per_pos=[float(x) for x in conditional_rates(rates)] if rates else [],
        draft_acceptance_rate=counts.draft_acceptance_rate,
        acceptance_histogram=list(histogram_from_per_pos(drafts, per_pos)) if per_pos else [],
        request_tau=TauDistribution(None, None, None, None),
        wasted_verify_tokens_per_output_token=wasted,
    )


class _JournaledTable:
    """One time-series table of a watch: ``<name>.parquet`` (consolidated rows) plus its append-only journal.
    ``keep_earlier``: the rows an earlier watch left in the folder stay (a continued watch; what its journal
    holds is folded into the Parquet file first), else they are removed."""

    def __init__(self, run_dir: Path, file_name: str, schema: pa.Schema, *, keep_earlier: bool):
        self.schema = schema
        self.parquet = run_dir / file_name
        self.journal = journal_path(run_dir, file_name.removesuffix(".parquet"))
        if not keep_earlier:
            self.parquet.unlink(missing_ok=True)
            self.journal.unlink(missing_ok=True)
        elif self.journal.is_file():  # the watch continued here was killed before it consolidated
            self._write_parquet(None)
        self._open_journal()

    def _open_journal(self) -> None:
        self.journal.parent.mkdir(exist_ok=True)
        self._sink = pa.OSFile(str(self.journal), "wb")
        self._stream = pa.ipc.new_stream(self._sink, self.schema)

    def append(self, rows: list[dict[str, Any]]) -> None:
        """One record batch, written through to the OS (a reader sees it at once)."""
        if rows:
            self._stream.write_batch(pa.RecordBatch.from_pylist(rows, schema=self.schema))
            self._sink.flush()

    def _write_parquet(
        self, keep_after_s: float | None, before_dropping: Callable[[pa.Table, float], None] | None = None
    ) -> None:
        """Parquet := its rows plus the journal's (those ending after ``keep_after_s``), atomically; the
        journal file is removed. ``before_dropping`` is shown the rows left out, and the cut, first."""
        table = read_time_series(self.parquet, self.journal, self.schema)
        if keep_after_s is not None:
            # pyarrow.compute defines its kernels when it is imported: no static checker sees `greater`.
            kept = pc.greater(table.column("end_s"), keep_after_s)  # pyright: ignore[reportAttributeAccessIssue]
            if before_dropping is not None:
                before_dropping(table.filter(pc.invert(kept)), keep_after_s)  # pyright: ignore[reportAttributeAccessIssue]
            table = table.filter(kept)
        tmp = self.parquet.with_name(self.parquet.name + ".tmp")
        pq.write_table(table, tmp)
        tmp.replace(self.parquet)
        self.journal.unlink(missing_ok=True)

    def consolidate(
        self,
        keep_after_s: float | None,
        *,
        reopen: bool,
        before_dropping: Callable[[pa.Table, float], None] | None = None,
    ) -> None:
        """Fold the journal into the Parquet file (:meth:`_write_parquet`); the journal starts empty again
        (``reopen``) or is gone."""
        self._stream.close()
        self._sink.close()
        self._write_parquet(keep_after_s, before_dropping)
        if reopen:
            self._open_journal()

    def consolidated_rows(self) -> list[dict[str, Any]]:
        """The rows of the Parquet file (for a continued watch: the earlier watch's)."""
        return read_parquet_table(self.parquet).cast(self.schema).to_pylist() if self.parquet.is_file() else []


def read_time_series(parquet: Path, journal: Path, schema: pa.Schema) -> pa.Table:
    """A watch table: its Parquet rows, then every complete batch of its journal (a watch still going, or killed)."""
    parts = [read_parquet_table(parquet).cast(schema)] if parquet.is_file() else []
    if journal.is_file():
        parts.append(read_stream(journal, schema))
    return pa.concat_tables(parts) if parts else schema.empty_table()


class WatchRecord:
    """Writes a watch's run directory: :meth:`update` after every evaluation appends to it, :meth:`close`
    consolidates it; ``retain_s`` (None: keep everything) bounds how far back its time series reach."""

    def __init__(
        self,
        run_dir: Path | str,
        config: dict[str, Any],
        telemetry: WatchSetup,
        *,
        retain_s: float | None = None,
        overwrite: bool = False,
    ):
        self.run_dir = Path(run_dir)
        continues = claim_run_dir(self.run_dir, overwrite=overwrite, continuable=holds_watch_run)
        earlier = RunRecord.from_json(read_run_meta(self.run_dir)) if continues else None
        self.retain_s = retain_s
        # A continued watch's summary pools the earlier units too: those the retention dropped as totals,
        # those still in the folder one by one. A unit at or before ``through_s`` is in the totals already
        # (a watch killed between writing run.json and the Parquet file leaves it in the folder as well).
        expired = (
            dict(earlier.source.details.get("expired") or {}) if earlier else {}
        )  # watches before 2026-12 kept none
        urls = [s for s in telemetry.get("sources", []) if str(s).startswith(("http://", "https://", "prometheus "))]
        self.record = RunRecord(
            meta=RunMeta(command="watch", created_at=earlier.meta.created_at if earlier else utc_now()),
            source=Source(
                kind=SOURCE_TELEMETRY,
                description="production telemetry read by `dflash-doctor watch`",
                url=urls[0].removeprefix("prometheus ") if urls else None,
                details={
                    **telemetry,
                    "retain_s": retain_s,
                    "events": [],
                    "notes": [],
                    "alerts": telemetry_details(earlier)["alerts"] if earlier else [],
                    "expired": {"through_s": expired.get("through_s"), "series": []},
                },
            ),
            config=dict(config),
        )
        self._windows = _JournaledTable(self.run_dir, WINDOWS_FILE, WINDOWS_SCHEMA, keep_earlier=continues)
        self._units = _JournaledTable(self.run_dir, UNITS_FILE, UNITS_SCHEMA, keep_earlier=continues)
        self._totals: dict[SeriesKey | None, SpecCounts] = {}  # None: every series pooled
        self._num_units: dict[SeriesKey | None, int] = {}
        self._samples: dict[SeriesKey | None, list[SpecCounts]] = {}
        self._sampled_from: dict[
            SeriesKey | None, int
        ] = {}  # units the samples were drawn from (not the expired totals)
        self._rng = random.Random(0)  # the samples' draws: the same watch gives the same summary
        self._consolidated_at: float | None = None
        for entry in expired.get("series", []):
            key, counts = SeriesKey(entry["model"], entry["class"]), _unit_counts(entry)
            self._record_expired(key, counts, entry["num_units"])
            for scope in (key, None):
                self._count(scope, counts, entry["num_units"])
        for row in self._units.consolidated_rows():
            if self._is_unexpired(row):
                self._take_unit(SeriesKey(row["model"], row["class"]), _unit_counts(row))
        for name, schema in TABLES.items():  # production has no per-step rows; the tables exist, empty
            path = self.run_dir / f"{name}.parquet"
            if not path.exists():
                pq.write_table(schema.empty_table(), path)
        self.update([], [], [], [])

    @property
    def details(self) -> dict[str, Any]:
        return self.record.source.details

    def _count(self, scope: SeriesKey | None, counts: SpecCounts, num_units: int) -> None:
        self._totals[scope] = self._totals[scope].plus(counts) if scope in self._totals else counts
        self._num_units[scope] = self._num_units.get(scope, 0) + num_units

    def _take(self, scope: SeriesKey | None, counts: SpecCounts, draw: float) -> None:
        """Add a unit to the running total of ``scope`` and to its sample (reservoir sampling: every unit
        this process has taken, from the folder or since, is in the sample with the same probability).
        ``draw`` (uniform in [0, 1)) is the unit's, shared by its scopes: scopes that saw the same units keep
        the same ones, so the samples of a watch hold at most SUMMARY_SAMPLE_UNITS units per distinct stream,
        not per scope."""
        self._count(scope, counts, 1)
        seen = self._sampled_from[scope] = self._sampled_from.get(scope, 0) + 1
        sample = self._samples.setdefault(scope, [])
        if len(sample) < SUMMARY_SAMPLE_UNITS:
            sample.append(counts)
        elif (slot := int(draw * seen)) < SUMMARY_SAMPLE_UNITS:
            sample[slot] = counts

    def _is_unexpired(self, row: dict[str, Any]) -> bool:
        through_s = self.details["expired"]["through_s"]
        return through_s is None or row["end_s"] > through_s

    def _record_expired(self, key: SeriesKey, counts: SpecCounts, num_units: int) -> None:
        """``num_units`` units of ``key`` have left the folder: their counts join ``details["expired"]``, what a
        continued watch restores its totals from."""
        series = self.details["expired"]["series"]
        entry = next((e for e in series if (e["model"], e["class"]) == (key.model, key.cls)), None)
        if entry is None:
            series.append({"model": key.model, "class": key.cls, "num_units": num_units, **counts.as_dict()})
        else:
            total = _unit_counts(entry).plus(counts)
            entry.update(num_units=entry["num_units"] + num_units, **total.as_dict())

    def _take_unit(self, key: SeriesKey, counts: SpecCounts) -> None:
        """A unit joins its series' and the overall totals and samples, with one draw for both."""
        draw = self._rng.random()
        self._take(key, counts, draw)
        self._take(None, counts, draw)

    def update(self, verdicts: list[WindowVerdict], units: list[Unit], events: list[Event], notes: list[str]) -> None:
        """Append the new windows and units, refresh the summary and run.json; consolidate once an hour
        (or once a retention period, when shorter) has passed since the last time."""
        self._windows.append([verdict.as_row() for verdict in verdicts])
        for verdict in verdicts:
            for alert in verdict.alerts:
                self.details["alerts"].append(
                    {
                        "time_s": verdict.window.end_s,
                        "kind": alert.kind,
                        "series": alert.series,
                        "message": alert.message,
                        "advice": list(alert.advice),
                    }
                )
        kept = [
            unit for unit in units if unit.counts.num_drafts is not None or unit.counts.num_generated_tokens is not None
        ]
        self._units.append(
            [
                {
                    "end_s": unit.end_s,
                    "model": unit.key.model,
                    "class": unit.key.cls,
                    "source": unit.source,
                    **unit.counts.as_dict(),
                }
                for unit in kept
            ]
        )
        for unit in kept:
            self._take_unit(unit.key, unit.counts)
        self.details["events"] = [
            {"time_s": e.time_s, "kind": e.kind, "source": e.source, "message": e.message} for e in events
        ]
        self.details["notes"] = list(notes)
        now_s = max([v.window.end_s for v in verdicts] + [u.end_s for u in kept], default=None)
        if now_s is not None:
            if self.retain_s is not None:
                self._drop_details_before(now_s - self.retain_s)
            if self._consolidated_at is None:
                self._consolidated_at = now_s
            elif now_s - self._consolidated_at >= min(self.retain_s or CONSOLIDATE_EVERY_S, CONSOLIDATE_EVERY_S):
                self.consolidate(now_s)
        served = sorted({key.model for key in self._totals if key is not None})
        # The served model is the run's target (one model), or "served
        # N" roles; identity beyond the name is not observable.
        self.record.models = {
            ("target" if len(served) == 1 else f"served {i + 1}"): ModelInfo(
                id=name, revision_or_hash="unknown (served)", dtype="unknown", device="serving engine", kind="target"
            )
            for i, name in enumerate(served)
        }
        self.record.summary = self._summary()
        write_run_json(self.run_dir, self.record.to_json())

    def _drop_details_before(self, time_s: float) -> None:
        for name in ("alerts", "events"):
            self.details[name] = [item for item in self.details[name] if item["time_s"] > time_s]

    def consolidate(self, now_s: float | None = None, *, final: bool = False) -> None:
        """Fold the journal into the Parquet files (dropping rows older than the retention before ``now_s``)."""
        keep_after = now_s - self.retain_s if self.retain_s is not None and now_s is not None else None
        self._windows.consolidate(keep_after, reopen=not final)
        self._units.consolidate(keep_after, reopen=not final, before_dropping=self._expire_units)
        self._consolidated_at = now_s

    def _expire_units(self, dropped: pa.Table, through_s: float) -> None:
        """The units at or before ``through_s`` are about to leave the folder: their totals go into run.json
        first, so a watch killed in between counts them once (see ``__init__``). A cut that drops nothing
        leaves run.json alone: ``through_s`` only matters for units that were in the folder when it was made."""
        if dropped.num_rows == 0:
            return
        for row in dropped.to_pylist():
            if self._is_unexpired(row):
                self._record_expired(SeriesKey(row["model"], row["class"]), _unit_counts(row), 1)
        previous = self.details["expired"]["through_s"]
        self.details["expired"]["through_s"] = (
            through_s if previous is None else max(previous, through_s)
        )  # a cut never moves back
        write_run_json(self.run_dir, self.record.to_json())

    def close(self, now_s: float | None = None) -> None:
        """End of the watch: the journal becomes the Parquet files and is removed."""
        self.consolidate(now_s, final=True)
        (self.run_dir / JOURNAL_DIR).rmdir()
        release_run_dir(self.run_dir)

    def _summary(self) -> Summary:
        by_class: dict[str, Metrics] = {}
        keys = sorted(key for key in self._totals if key is not None)
        several_models = len({key.model for key in keys}) > 1
        for key in keys:
            if key.cls == ALL_CLASSES and not several_models:
                continue
            name = str(key) if several_models else key.cls
            by_class[name] = _summary_block(self._totals[key], self._samples[key], self._num_units[key])
        overall = (
            _summary_block(self._totals[None], self._samples[None], self._num_units[None])
            if None in self._totals
            else None
        )
        return Summary(overall=overall, by_class=by_class)


def _read(run_dir: Path | str, file_name: str, schema: pa.Schema) -> pd.DataFrame:
    run_dir = Path(run_dir)
    return read_time_series(
        run_dir / file_name, journal_path(run_dir, file_name.removesuffix(".parquet")), schema
    ).to_pandas()


def read_windows(run_dir: Path | str) -> pd.DataFrame:
    """The windows of a watch run, finished or still going (an empty frame with the columns when there are none)."""
    return _read(run_dir, WINDOWS_FILE, WINDOWS_SCHEMA)


def read_units(run_dir: Path | str) -> pd.DataFrame:
    """The units of a watch run: the counts between consecutive scrapes (or per line / response)."""
    return _read(run_dir, UNITS_FILE, UNITS_SCHEMA)


class WatchSetup(TypedDict):
    """How a watch was set up: its sources, window and poll interval, the baseline's description (None
    without one), and its ``Thresholds`` as a dict."""

    sources: list[str]
    window_s: float
    interval_s: float
    baseline: str | None
    thresholds: dict[str, float]


class WatchDetails(WatchSetup):
    """What only a watch records (``source.details`` of its run record; every key is always written):
    its setup and what happened so far."""

    events: list[dict[str, Any]]  # time_s, kind, source, message
    alerts: list[dict[str, Any]]  # time_s, kind, series, message, advice (list of engine settings)
    notes: list[str]
    expired: dict[
        str, Any
    ]  # through_s (the last retention cut, or None) and series: per model and class, num_units and the counts


def _unit_counts(row: dict[str, Any]) -> SpecCounts:
    """The counts of a ``units.parquet`` row."""
    per_pos = row["num_accepted_tokens_per_pos"]
    return SpecCounts(
        num_drafts=row["num_drafts"],
        num_draft_tokens=row["num_draft_tokens"],
        num_accepted_tokens=row["num_accepted_tokens"],
        num_accepted_tokens_per_pos=None if per_pos is None else tuple(per_pos),
        num_generated_tokens=row["num_generated_tokens"],
    )


def holds_watch_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds the run directory of a watch this version can continue (its run.json reads
    as a watch's record)."""
    try:
        return is_watch_run(RunRecord.from_json(read_run_meta(run_dir)))
    except UsageError:  # no run.json, not JSON, another schema version: not a watch to continue
        return False


def is_watch_run(record: RunRecord) -> bool:
    """The record of a watch (its ``source.kind`` is telemetry)."""
    return record.source.kind == SOURCE_TELEMETRY


def telemetry_details(record: RunRecord) -> WatchDetails:
    """A watch run's :class:`WatchDetails` (``record`` is a watch run: :func:`is_watch_run`)."""
    return cast(WatchDetails, record.source.details)  # written by WatchRecord with exactly these keys
