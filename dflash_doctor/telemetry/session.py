"""One watch from start to finish: sources -> watcher -> judge -> run directory (+ exporter); no printing.

``dflash-doctor watch`` builds a :class:`WatchSession` from its flags and shows what :meth:`once` or
each :meth:`step` returns (the CLI is flags -> session -> view, like every other command).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Mapping

from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.ownership import new_run_dir
from dflash_doctor.rundir.run_record import StepCosts
from dflash_doctor.telemetry.alarms import apply_alarms
from dflash_doctor.telemetry.exporter import VerdictExporter
from dflash_doctor.telemetry.hooks import AlertHooks
from dflash_doctor.telemetry.logs import log_zone
from dflash_doctor.telemetry.watch_record import WatchRecord
from dflash_doctor.telemetry.settings import WatchSettings
from dflash_doctor.telemetry.sources import (
    LogFile,
    MetricsEndpoint,
    PrometheusServer,
    ResponsesFile,
    Source,
    open_source,
)
from dflash_doctor.telemetry.verdict import Judge, WindowVerdict, load_baseline
from dflash_doctor.telemetry.watcher import Watcher, Window


def open_sources(
    specs: list[str],
    prometheus: str | None,
    settings: WatchSettings,
    *,
    api_key: str | None = None,
    prometheus_headers: Mapping[str, str] | None = None,
) -> list[Source]:
    """SOURCE arguments and ``--prometheus`` as sources; none at all is a usage error. The credentials
    (``api_key`` for the /metrics URLs, ``prometheus_headers``) stay inside the sources' HTTP clients."""
    zone = log_zone(settings.log_timezone)
    sources: list[Source] = [
        open_source(
            s,
            server_kind=settings.server_kind,
            model=settings.model,
            class_label=settings.class_label,
            log_zone=zone,
            api_key=api_key,
        )
        for s in specs
    ]
    if prometheus:
        sources.append(
            PrometheusServer(
                prometheus,
                window_s=settings.window_s,
                server_kind=settings.server_kind,
                class_label=settings.class_label,
                headers=prometheus_headers,
            )
        )
    if not sources:
        raise UsageError(
            "watch needs at least one SOURCE (a /metrics URL, a log file, a responses .jsonl) or --prometheus URL."
        )
    return sources


class WatchSession:
    """Owns the pieces of one watch and keeps its run directory current after every evaluation."""

    def __init__(
        self,
        sources: list[Source],
        settings: WatchSettings,
        *,
        run_dir: Path | None,
        config: dict[str, Any],
        costs: StepCosts | None = None,
        once: bool = False,
        exporter_port: int | None = None,
        exporter_address: str = "127.0.0.1",
        hooks: AlertHooks | None = None,
        overwrite: bool = False,
    ):
        self.settings = settings
        self.once_mode = once
        self.judge = Judge(
            load_baseline(settings.baseline), settings.thresholds, server_kind=settings.server_kind, costs=costs
        )
        # --once on a /metrics URL without --window: "what do its counters say so far" (since the server started)
        self.watcher = Watcher(
            sources, window_s=settings.window_s, count_since_start=once and not settings.window_given
        )
        # no --out: a folder of its own, made once the baseline and sources proved good (a refused watch leaves none)
        self.run_dir = run_dir if run_dir is not None else new_run_dir("watch")
        self.record = WatchRecord(
            self.run_dir,
            config,
            {
                "sources": [s.name for s in sources],
                "window_s": settings.window_s,
                "interval_s": settings.interval_s,
                "baseline": self.judge.baseline.description if self.judge.baseline else None,
                "thresholds": dataclasses.asdict(settings.thresholds),
            },
            retain_s=settings.retain_s,
            overwrite=overwrite,
        )
        self.exporter = VerdictExporter(exporter_port, exporter_address) if exporter_port is not None else None
        self.hooks = hooks
        if hooks is not None:
            hooks.run_dir = self.run_dir  # named to the operator's command in DFLASH_DOCTOR_RUN_DIR
        self._units_recorded = 0

    def _judge(self, window: Window) -> WindowVerdict:
        """The Judge's rules, then the production alarms (collapse, per-position decay)."""
        return apply_alarms(self.judge.judge(window), self.judge)

    def _adopt_detected_server_kind(self) -> None:
        """Advice for the one engine the sources turned out to be (all engines' settings when it is not one)."""
        if self.judge.server_kind is None and len(self.watcher.engines) == 1:
            self.judge.server_kind = next(iter(self.watcher.engines))

    def _publish(self, rounds: list[list[WindowVerdict]]) -> None:
        if self.hooks and rounds:  # only the latest round can start an episode (not a file's history)
            self.watcher.events.extend(self.hooks.handle(rounds[-1], self.judge.server_kind))
        for i, verdicts in enumerate(rounds):
            last = i == len(rounds) - 1
            self.record.update(
                verdicts,
                self.watcher.units[self._units_recorded :] if last else [],
                self.watcher.events,
                self.watcher.source_notes(),
            )
        self._units_recorded = len(self.watcher.units)
        if self.exporter and rounds:
            self.exporter.publish(rounds[-1], self.watcher.sources_up(), time.time())

    def once(self) -> list[list[WindowVerdict]]:
        """One verdict for cron/CI; returns every window judged (files: their whole time axis, oldest
        first; live sources: one round), the last round being the latest window of every series."""
        sources = self.watcher.sources
        live = [s for s in sources if isinstance(s, (MetricsEndpoint, PrometheusServer))]
        files = [s for s in sources if isinstance(s, (LogFile, ResponsesFile))]
        scrapes = [s for s in live if isinstance(s, MetricsEndpoint)]
        self.watcher.poll()
        if scrapes and self.settings.window_given:  # two scrapes one window apart: the counts of that window
            time.sleep(self.settings.window_s)
            self.watcher.poll()
        self._adopt_detected_server_kind()
        failed = {e.source: e.message for e in self.watcher.events if e.kind == "source-unavailable"}
        if len(failed) == len(sources) and not self.watcher.units:
            raise UsageError(
                f"no source could be read: {'; '.join(failed.values())}; check the URL/path and that the server is up."
            )
        if files and not live:
            rounds = [[self._judge(w) for w in windows] for windows in self.watcher.tumbling_windows()]
        else:
            if scrapes and not self.settings.window_given:
                self.watcher.window_s = float("inf")  # counts since each server started
            rounds = [[self._judge(w) for w in self.watcher.current_windows()]]
        self._publish(rounds)
        return rounds

    def close(self, now_s: float | None = None) -> None:
        """End of a watch: wait briefly for alert commands still running, so their exit is reported, and
        consolidate the run directory (``now_s``: the clock of :meth:`step`, for the retention)."""
        if self.hooks:
            self.watcher.events.extend(self.hooks.close())
        self.record.close(now_s)

    def start(self, now_s: float | None = None) -> None:
        """The first poll of a live watch: only the starting point of the counters' differences.
        ``now_s``: a clock other than the wall clock (a soak run's simulated day)."""
        self.watcher.poll(now_s)

    def step(self, now_s: float | None = None) -> list[WindowVerdict]:
        """Poll, judge the window ending now (``now_s``, default the wall clock), record and export it."""
        self.watcher.poll(now_s)
        self._adopt_detected_server_kind()
        windows = self.watcher.current_windows(now_s)
        verdicts = [self._judge(w) for w in windows]
        self._publish([verdicts])
        # Every unit is in the run directory now; those before the window just judged are needed by no
        # later window, so the watcher's memory and each poll's scan stay flat over a days-long watch.
        if windows:
            self.watcher.forget_units_before(windows[0].start_s)
            self._units_recorded = len(self.watcher.units)
        return verdicts
