"""A watch's run directory: the typed run record with ``source.kind = "telemetry"``, plus the time series.

Production has no per-step rows, so ``requests`` / ``steps`` / ``tokens`` are written empty (every view
still loads the directory) and the substance is ``windows.parquet``: one row per series and window with
vLLM's metric names, the baseline, the net speedup and the alerts (:meth:`WindowVerdict.as_row`), and
``units.parquet``, the raw counts between scrapes. The record's ``summary`` pools every unit of the watch,
per class, in the same :class:`~dflash_doctor.rundir.record.Metrics` a ``check`` run has, so ``report`` and the
dashboard's overview read it unchanged (requests are not observed: ``num_requests`` is 0);
``source.details`` holds what only a watch has (sources, window length, events, alerts). Everything is
rewritten atomically after every evaluation, so a watch killed at any moment leaves a readable directory
with every window it finished.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypedDict, cast

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_doctor.stats.metrics import conditional_rates
from dflash_doctor.rundir.record import Metrics, ModelInfo, RunMeta, RunRecord, Source, Summary, TauDistribution
from dflash_doctor.rundir.tables import TABLES, read_table_or_empty
from dflash_doctor.rundir.writer import utc_now, write_run_json
from dflash_doctor.telemetry.counts import ALL_CLASSES, SeriesKey, SpecCounts, rate_intervals, total, window_tau_interval
from dflash_doctor.telemetry.verdict import WindowVerdict
from dflash_doctor.telemetry.watcher import Event, Unit

SOURCE_TELEMETRY = "telemetry"
WINDOWS_FILE = "windows.parquet"
UNITS_FILE = "units.parquet"  # the raw, non-overlapping counts between scrapes (canary compares resample them)

UNITS_SCHEMA = pa.schema(
    [
        ("end_s", pa.float64()), ("model", pa.string()), ("class", pa.string()), ("source", pa.string()),
        ("num_drafts", pa.float64()), ("num_draft_tokens", pa.float64()), ("num_accepted_tokens", pa.float64()),
        ("num_accepted_tokens_per_pos", pa.list_(pa.float64())), ("num_generated_tokens", pa.float64()),
    ]
)

WINDOWS_SCHEMA = pa.schema(
    [
        ("end_s", pa.float64()), ("start_s", pa.float64()), ("model", pa.string()), ("class", pa.string()), ("status", pa.string()),
        ("num_drafts", pa.float64()), ("num_draft_tokens", pa.float64()), ("num_accepted_tokens", pa.float64()),
        ("num_accepted_tokens_per_pos", pa.list_(pa.float64())), ("num_generated_tokens", pa.float64()),
        ("mean_acceptance_length", pa.float64()), ("mean_acceptance_length_lo", pa.float64()), ("mean_acceptance_length_hi", pa.float64()),
        ("draft_acceptance_rate", pa.float64()), ("acceptance_rate_per_pos", pa.list_(pa.float64())), ("k", pa.int32()),
        ("baseline_tau", pa.float64()), ("baseline_tau_lo", pa.float64()), ("baseline_tau_hi", pa.float64()),
        ("engine_mean_acceptance_length", pa.float64()),
        ("speedup", pa.float64()), ("best_k", pa.int32()), ("best_speedup", pa.float64()),
        ("alerts", pa.list_(pa.string())), ("alert_messages", pa.list_(pa.string())), ("advice", pa.list_(pa.string())), ("notes", pa.list_(pa.string())),
    ]
)


def _count(value: float | None) -> int:
    return int(round(value or 0.0))


def _summary_block(counts: SpecCounts, units: list[SpecCounts]) -> Metrics:
    """One summary scope from pooled counts (the fields ``check`` writes; no requests in telemetry)."""
    rates = counts.acceptance_rate_per_pos
    per_pos = [_count(v) for v in counts.num_accepted_tokens_per_pos or ()]
    drafts = _count(counts.num_drafts)
    at_least = [drafts, *per_pos, 0]
    ci = window_tau_interval(counts, units)
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
        acceptance_histogram=[at_least[j] - at_least[j + 1] for j in range(len(per_pos) + 1)] if per_pos else [],
        request_tau=TauDistribution(None, None, None, None),
        wasted_verify_tokens_per_output_token=wasted,
    )


class WatchRecord:
    """Writes a watch's run directory; :meth:`update` after every evaluation keeps it current on disk."""

    def __init__(self, run_dir: Path | str, config: dict[str, Any], telemetry: WatchSetup):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        urls = [s for s in telemetry.get("sources", []) if str(s).startswith(("http://", "https://", "prometheus "))]
        self.record = RunRecord(
            meta=RunMeta(command="watch", created_at=utc_now()),
            source=Source(kind=SOURCE_TELEMETRY, description="production telemetry read by `dflash-doctor watch`",
                          url=urls[0].removeprefix("prometheus ") if urls else None,
                          details={**telemetry, "events": [], "alerts": [], "notes": []}),
            config=dict(config),
        )
        self.rows: list[dict[str, Any]] = []
        self.unit_rows: list[dict[str, Any]] = []
        self._units: dict[SeriesKey, list[SpecCounts]] = {}
        for name, schema in TABLES.items():  # production has no per-step rows; the tables exist, empty
            path = self.run_dir / f"{name}.parquet"
            if not path.exists():
                pq.write_table(schema.empty_table(), path)
        self.update([], [], [], [])

    @property
    def details(self) -> dict[str, Any]:
        return self.record.source.details

    def update(self, verdicts: list[WindowVerdict], units: list[Unit], events: list[Event], notes: list[str]) -> None:
        """Append the new windows and units, refresh the summary, rewrite the files atomically."""
        for verdict in verdicts:
            self.rows.append(verdict.as_row())
            for alert in verdict.alerts:
                self.details["alerts"].append({"time_s": verdict.window.end_s, "kind": alert.kind, "series": alert.series, "message": alert.message, "advice": list(alert.advice)})
        for unit in units:
            if unit.counts.num_drafts is None and unit.counts.num_generated_tokens is None:
                continue
            self._units.setdefault(unit.key, []).append(unit.counts)
            self.unit_rows.append({"end_s": unit.end_s, "model": unit.key.model, "class": unit.key.cls, "source": unit.source, **unit.counts.as_dict()})
        self.details["events"] = [{"time_s": e.time_s, "kind": e.kind, "source": e.source, "message": e.message} for e in events]
        self.details["notes"] = list(notes)
        served = sorted({key.model for key in self._units})
        # The served model is the run's target (one model), or "served N" roles; identity beyond the name is not observable.
        self.record.models = {
            ("target" if len(served) == 1 else f"served {i + 1}"): ModelInfo(id=name, revision_or_hash="unknown (served)", dtype="unknown", device="serving engine", kind="target")
            for i, name in enumerate(served)
        }
        self.record.summary = self._summary()
        for name, rows, schema in ((WINDOWS_FILE, self.rows, WINDOWS_SCHEMA), (UNITS_FILE, self.unit_rows, UNITS_SCHEMA)):
            tmp = self.run_dir / (name + ".tmp")
            pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
            tmp.replace(self.run_dir / name)
        write_run_json(self.run_dir, self.record.to_json())

    def _summary(self) -> Summary:
        all_units = [u for units in self._units.values() for u in units]
        by_class: dict[str, Metrics] = {}
        several_models = len({key.model for key in self._units}) > 1
        for key, units in sorted(self._units.items()):
            if key.cls == ALL_CLASSES and not several_models:
                continue
            name = str(key) if several_models else key.cls
            by_class[name] = _summary_block(total(units), units)
        return Summary(overall=_summary_block(total(all_units), all_units) if all_units else None, by_class=by_class)


def read_windows(run_dir: Path | str) -> pd.DataFrame:
    """``windows.parquet`` of a watch run (an empty frame with the columns when there is none)."""
    return read_table_or_empty(Path(run_dir) / WINDOWS_FILE, WINDOWS_SCHEMA)


def read_units(run_dir: Path | str) -> pd.DataFrame:
    """``units.parquet`` of a watch run: the counts between consecutive scrapes (or per line / response)."""
    return read_table_or_empty(Path(run_dir) / UNITS_FILE, UNITS_SCHEMA)



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


def is_watch_run(record: RunRecord) -> bool:
    """The record of a watch (its ``source.kind`` is telemetry)."""
    return record.source.kind == SOURCE_TELEMETRY


def telemetry_details(record: RunRecord) -> WatchDetails:
    """A watch run's :class:`WatchDetails` (``record`` is a watch run: :func:`is_watch_run`)."""
    return cast(WatchDetails, record.source.details)  # written by WatchRecord with exactly these keys


