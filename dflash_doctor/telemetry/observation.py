"""One reading from any source, before windowing: counts for a series at a time.

Prometheus counters are *cumulative* (since the server started); log lines, iteration stats and
responses carry the counts of their own interval (*incremental*). The watcher turns both into windows.
Values an engine computed itself (SGLang's accept-length gauge, vLLM's printed mean acceptance length)
travel in ``reported``: shown beside ours, averaged per window, never mixed into the counts. Those that are
averages since the server started (SGLang's ``spec_accept_length`` / ``spec_accept_rate``) are named in
``averages_since_start`` with their weight in ``reported[AVERAGE_WEIGHT]``; the watcher turns them into the
average over each interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_doctor.telemetry.counts import SeriesKey, SpecCounts


AVERAGE_WEIGHT = "average_weight"  # what an average-since-start averages over (SGLang: verify calls), cumulative


@dataclass(frozen=True)
class Observation:
    key: SeriesKey
    counts: SpecCounts
    cumulative: bool
    time_s: float | None = None  # seconds since the epoch; None when the source has no clock (order only)
    reported: dict[str, float] = field(default_factory=dict, hash=False)
    origin: str = ""  # "file:line" or the URL, for messages
    averages_since_start: tuple[str, ...] = ()  # names in ``reported`` averaged since the server started


@dataclass
class ParseProblems:
    """Lines that looked like an engine's metrics line but could not be read (counted, never fatal)."""

    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, where: str, line: str) -> None:
        self.count += 1
        if len(self.examples) < 3:
            self.examples.append(f"{where}: {line.strip()[:160]}")

    def message(self, what: str) -> str | None:
        if not self.count:
            return None
        return f"{self.count} {what} line(s) could not be read and were skipped, e.g. {self.examples[0]}"
