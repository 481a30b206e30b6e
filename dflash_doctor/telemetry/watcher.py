"""From observations to windows: counter differences, resets, gaps, and the window each row covers.

A *unit* is the counts accrued between two scrapes (or in one log line, iteration record or response).
A *window* pools the units of one series whose end time falls in ``(end - window_s, end]``. Live, the
watcher polls every source, then evaluates the window ending now; reading files after the fact
(:meth:`Watcher.tumbling_windows`), it cuts the files' own time axis into consecutive windows.

Failure handling, by design rather than by accident:

* a counter that went down is a restart: the unit counts from zero (:meth:`SpecCounts.since`) and an
  event says so; the counts between the last scrape and the restart are gone on the server too;
* a source that cannot be read keeps its last snapshot: the next successful scrape's difference covers
  the gap, so no count is lost, and the window in between says ``source-unavailable``;
* a series that appears late simply starts; one that stops reporting keeps getting rows (``no-data``),
  so a draft that disappears with its counters is still seen.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from statistics import fmean

from dflash_doctor.telemetry.counts import SeriesKey, SpecCounts, total
from dflash_doctor.telemetry.observation import AVERAGE_WEIGHT, Observation
from dflash_doctor.telemetry.sources import Source, SourceUnavailable


@dataclass(frozen=True)
class Unit:
    key: SeriesKey
    end_s: float
    counts: SpecCounts
    reported: dict[str, float]
    source: str


@dataclass(frozen=True)
class Event:
    """Something that happened to a source (not a verdict): a failed scrape, a counter reset."""

    time_s: float
    kind: str  # source-unavailable | counter-reset | source-note
    source: str
    message: str


@dataclass
class Window:
    """Counts of one series over one window, with the units they came from."""

    key: SeriesKey
    start_s: float
    end_s: float
    counts: SpecCounts
    units: list[SpecCounts] = field(default_factory=list)
    reported: dict[str, float] = field(default_factory=dict)  # engine-computed values, averaged over the window
    source_unavailable: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.units and not self.reported


class Watcher:
    """Polls sources and keeps their units; windows are views over the units (a live watch forgets the
    units before its latest window once they are recorded)."""

    def __init__(self, sources: list[Source], *, window_s: float, count_since_start: bool = False):
        """``count_since_start``: the first scrape of a counter counts everything since the server started
        (``watch --once`` without ``--window``: "what do its counters say so far"); otherwise the first
        scrape is only the starting point of the first difference."""
        self.sources = sources
        self.window_s = window_s
        self.count_since_start = count_since_start
        self.units: list[Unit] = []
        self.events: list[Event] = []
        self._snapshots: dict[tuple[str, SeriesKey], SpecCounts] = {}
        self._keys_by_source: dict[str, set[SeriesKey]] = {}
        self._unavailable_at: dict[str, float] = {}
        self._averages: dict[
            tuple[str, SeriesKey], tuple[float | None, dict[str, float]]
        ] = {}  # last since-start averages
        self._polled_at: float | None = None

    @property
    def keys(self) -> list[SeriesKey]:
        return sorted(set().union(*self._keys_by_source.values())) if self._keys_by_source else []

    def poll(self, now: float | None = None) -> None:
        """Read every source once; failures become events, never exceptions."""
        now = time.time() if now is None else now
        self._polled_at = now
        for source in self.sources:
            try:
                observations = source.poll()
            except SourceUnavailable as exc:
                self.events.append(Event(now, "source-unavailable", source.name, str(exc)))
                self._unavailable_at[source.name] = now
                continue
            for observation in observations:
                self._take(source.name, observation, now)

    def _take(self, source: str, observation: Observation, now: float) -> None:
        key = observation.key
        self._keys_by_source.setdefault(source, set()).add(key)
        # A scrape counts up to the poll; files and Prometheus carry their own clock.
        end_s = now if observation.cumulative or observation.time_s is None else observation.time_s
        counts = observation.counts
        reported = (
            self._interval_averages(source, observation)
            if observation.averages_since_start
            else dict(observation.reported)
        )
        if observation.cumulative:
            previous = self._snapshots.get((source, key))
            self._snapshots[(source, key)] = counts
            if previous is None:
                if not self.count_since_start:
                    return
            else:
                counts, reset = counts.since(previous)
                if reset:
                    self.events.append(
                        Event(
                            now,
                            "counter-reset",
                            source,
                            f"{key}: counters went down (server restart?); counting from zero again",
                        )
                    )
        self.units.append(Unit(key, end_s, counts, reported, source))

    def forget_units_before(self, time_s: float) -> None:
        """Drop the units ending at or before ``time_s`` (live watching: no later window reaches back there)."""
        self.units = [u for u in self.units if u.end_s > time_s]

    def _interval_averages(self, source: str, observation: Observation) -> dict[str, float]:
        """Engine averages since the server started (SGLang's gauges) -> their average over the interval
        since the last scrape, from the change of average x weight; dropped when it cannot be known."""
        reported = dict(observation.reported)
        weight = reported.pop(AVERAGE_WEIGHT, None)
        previous_weight, previous = self._averages.get((source, observation.key), (None, None))
        self._averages[(source, observation.key)] = (weight, observation.reported)
        first_counted = previous is None and self.count_since_start  # counts since start: so is the average
        restarted = (
            weight is not None and previous_weight is not None and weight < previous_weight
        )  # averages start over
        for name in [n for n in observation.averages_since_start if n in reported]:
            if first_counted or restarted:
                continue
            if (
                weight is not None
                and previous_weight is not None
                and previous
                and name in previous
                and weight > previous_weight
            ):
                reported[name] = (reported[name] * weight - previous[name] * previous_weight) / (
                    weight - previous_weight
                )
            else:
                del reported[name]
        return reported

    def window(self, key: SeriesKey, start_s: float, end_s: float) -> Window:
        """The units of ``key`` ending in ``(start_s, end_s]`` pooled into one window."""
        units = [u for u in self.units if u.key == key and start_s < u.end_s <= end_s]
        with_counts = [u.counts for u in units if u.counts != SpecCounts()]
        reported: dict[str, float] = {}
        for name in sorted({name for u in units for name in u.reported}):
            carrying = [u for u in units if name in u.reported]
            values = [u.reported[name] for u in carrying]
            weights = [u.counts.num_drafts or 0.0 for u in carrying]
            if name in ("running_requests", "configured_k"):
                reported[name] = max(values)
            elif all(w > 0 for w in weights):  # per-window averages pool by their drafts (vLLM's lines: = pooled tau)
                reported[name] = sum(v * w for v, w in zip(values, weights)) / sum(weights)
            else:
                reported[name] = fmean(values)
        sources = {source for source, keys in self._keys_by_source.items() if key in keys}
        unavailable = any(start_s < self._unavailable_at.get(source, float("-inf")) <= end_s for source in sources)
        return Window(key, start_s, end_s, total(with_counts), with_counts, reported, unavailable)

    def current_windows(self, now: float | None = None) -> list[Window]:
        """One window per known series, ending at the last poll (live watching)."""
        end = now if now is not None else (self._polled_at or time.time())
        return [self.window(key, end - self.window_s, end) for key in self.keys]

    def tumbling_windows(self) -> list[list[Window]]:
        """Consecutive windows over the time the units span (reading files after the fact), oldest first."""
        if not self.units:
            return []
        first = min(u.end_s for u in self.units)
        last = max(u.end_s for u in self.units)
        count = math.floor((last - first) / self.window_s) + 1  # the first window still holds the first unit
        # The last window ends at the last unit, so "the latest window" is the freshest data, as live.
        ends = [last - self.window_s * (count - 1 - i) for i in range(count)]
        return [[self.window(key, end - self.window_s, end) for key in self.keys] for end in ends]

    @property
    def engines(self) -> set[str]:
        """The engines the sources were given or detected (after a poll)."""
        return {source.server_kind for source in self.sources if source.server_kind}

    def sources_up(self) -> dict[str, bool]:
        """Per source: whether it answered the last poll."""
        return {source.name: self._unavailable_at.get(source.name) != self._polled_at for source in self.sources}

    def source_notes(self) -> list[str]:
        return [f"{source.name}: {note}" for source in self.sources for note in source.notes]
