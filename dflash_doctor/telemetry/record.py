"""A watch's run directory: ``run.json`` (source = telemetry) plus ``windows.parquet``, the time series.

Production has no per-step rows, so ``requests`` / ``steps`` / ``tokens`` are written empty (every view
still loads the directory) and the substance is ``windows.parquet``: one row per series and window with
vLLM's metric names, the baseline, the net speedup and the alerts (:meth:`WindowVerdict.as_row`).
``run.json`` ``summary`` pools every window of the watch, per class, with the same keys a ``check`` run
has, so ``report`` and the dashboard's overview read it unchanged; ``telemetry`` holds what only a watch
has (sources, window length, events, alerts). Both files are rewritten atomically after every evaluation,
so a watch killed at any moment leaves a readable directory with every window it finished.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_doctor.metrics import conditional_rates
from dflash_doctor.schema import TABLES, new_run_meta, write_run_json
from dflash_doctor.telemetry.counts import ALL_CLASSES, SeriesKey, SpecCounts, total, window_tau_interval
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


def _summary_block(counts: SpecCounts, units: list[SpecCounts]) -> dict[str, Any]:
    """The metric block of run.json ``summary`` from pooled counts (keys as ``check`` writes them)."""
    rates = counts.acceptance_rate_per_pos
    per_pos = counts.num_accepted_tokens_per_pos
    histogram = None
    if per_pos is not None and counts.num_drafts:
        at_least = [counts.num_drafts, *per_pos, 0.0]
        histogram = [at_least[j] - at_least[j + 1] for j in range(len(per_pos) + 1)]
    ci = window_tau_interval(counts, units)
    return {
        "num_drafts": counts.num_drafts,
        "num_draft_tokens": counts.num_draft_tokens,
        "num_accepted_tokens": counts.accepted,
        "num_accepted_tokens_per_pos": list(per_pos) if per_pos is not None else None,
        "num_output_tokens": counts.num_generated_tokens,
        "mean_acceptance_length": counts.mean_acceptance_length,
        "mean_acceptance_length_ci": list(ci) if ci else None,
        "acceptance_rate_per_pos": rates,
        "conditional_acceptance_rate_per_pos": [float(x) for x in conditional_rates(rates)] if rates else None,
        "draft_acceptance_rate": counts.draft_acceptance_rate,
        "acceptance_histogram": histogram,
    }


class WatchRecord:
    """Writes a watch's run directory; :meth:`update` after every evaluation keeps it current on disk."""

    def __init__(self, run_dir: Path | str, config: dict[str, Any], telemetry: dict[str, Any]):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.meta = new_run_meta(config)
        self.meta["source"] = SOURCE_TELEMETRY
        self.meta["telemetry"] = {**telemetry, "events": [], "alerts": []}
        self.rows: list[dict[str, Any]] = []
        self.unit_rows: list[dict[str, Any]] = []
        self._units: dict[SeriesKey, list[SpecCounts]] = {}
        for name, schema in TABLES.items():  # production has no per-step rows; the tables exist, empty
            path = self.run_dir / f"{name}.parquet"
            if not path.exists():
                pq.write_table(schema.empty_table(), path)
        self.update([], [], [], [])

    def update(self, verdicts: list[WindowVerdict], units: list[Unit], events: list[Event], notes: list[str]) -> None:
        """Append the new windows and units, refresh the summary, rewrite the files atomically."""
        for verdict in verdicts:
            self.rows.append(verdict.as_row())
            for alert in verdict.alerts:
                self.meta["telemetry"]["alerts"].append({"time_s": verdict.window.end_s, "kind": alert.kind, "series": alert.series, "message": alert.message, "advice": list(alert.advice)})
        for unit in units:
            if unit.counts.num_drafts is None and unit.counts.num_generated_tokens is None:
                continue
            self._units.setdefault(unit.key, []).append(unit.counts)
            self.unit_rows.append({"end_s": unit.end_s, "model": unit.key.model, "class": unit.key.cls, "source": unit.source, **unit.counts.as_dict()})
        self.meta["telemetry"]["events"] = [{"time_s": e.time_s, "kind": e.kind, "source": e.source, "message": e.message} for e in events]
        self.meta["telemetry"]["notes"] = list(notes)
        served = sorted({key.model for key in self._units})
        # Roles as check writes them, so every view's model line works: the served model is the target.
        self.meta["models"] = {("target" if len(served) == 1 else f"served {i + 1}"): {"id": name, "kind": "served (telemetry)"} for i, name in enumerate(served)}
        self.meta["summary"] = self._summary()
        for name, rows, schema in ((WINDOWS_FILE, self.rows, WINDOWS_SCHEMA), (UNITS_FILE, self.unit_rows, UNITS_SCHEMA)):
            tmp = self.run_dir / (name + ".tmp")
            pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
            tmp.replace(self.run_dir / name)
        write_run_json(self.run_dir, self.meta)

    def _summary(self) -> dict[str, Any]:
        all_units = [u for units in self._units.values() for u in units]
        by_class: dict[str, dict[str, Any]] = {}
        several_models = len({key.model for key in self._units}) > 1
        for key, units in sorted(self._units.items()):
            if key.cls == ALL_CLASSES and not several_models:
                continue
            name = str(key) if several_models else key.cls
            by_class[name] = _summary_block(total(units), units)
        return {"overall": _summary_block(total(all_units), all_units) if all_units else {}, "by_class": by_class}


def read_windows(run_dir: Path | str) -> pd.DataFrame:
    """``windows.parquet`` of a watch run (an empty frame with the columns when there is none)."""
    return _read(Path(run_dir) / WINDOWS_FILE, WINDOWS_SCHEMA)


def read_units(run_dir: Path | str) -> pd.DataFrame:
    """``units.parquet`` of a watch run: the counts between consecutive scrapes (or per line / response)."""
    return _read(Path(run_dir) / UNITS_FILE, UNITS_SCHEMA)


def _read(path: Path, schema: pa.Schema) -> pd.DataFrame:
    if not path.is_file():
        return schema.empty_table().to_pandas()
    return pq.read_table(path).to_pandas()


def is_watch_run(meta: dict[str, Any]) -> bool:
    return meta.get("source") == SOURCE_TELEMETRY


