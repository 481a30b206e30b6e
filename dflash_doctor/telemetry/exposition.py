"""The Prometheus text exposition format (what ``GET /metrics`` returns), read by name and label.

Only the sample lines matter here: ``name{label="value",...} value [timestamp]``. ``# HELP`` / ``# TYPE``
lines and blank lines are skipped; a line that is not a valid sample is counted, not fatal, so one
malformed line from a proxy does not hide every other metric. Label values are unescaped (``\\"``,
``\\\\``, ``\\n``) as the format defines. Written here rather than taken from ``prometheus-client``
because that package is an optional extra (only the exporter needs it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^(?P<name>{_NAME})(?:\{{(?P<labels>.*)\}})?\s+(?P<value>\S+)(?:\s+(?P<timestamp>-?\d+))?\s*$")
_LABEL = re.compile(r'\s*(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"(?P<value>(?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    """One sample line: metric name, labels, value."""

    name: str
    labels: dict[str, str] = field(hash=False)
    value: float


@dataclass
class Exposition:
    """All samples of one scrape, plus how many lines could not be read."""

    samples: list[Sample]
    num_unreadable_lines: int = 0
    first_unreadable_line: str | None = None

    def named(self, *names: str) -> list[Sample]:
        """Samples whose name is one of ``names``, in the order they appeared."""
        wanted = set(names)
        return [s for s in self.samples if s.name in wanted]

    def has(self, prefix: str) -> bool:
        return any(s.name.startswith(prefix) for s in self.samples)


def _parse_labels(text: str) -> dict[str, str] | None:
    labels: dict[str, str] = {}
    position = 0
    text = text.strip()
    while position < len(text):
        match = _LABEL.match(text, position)
        if match is None:
            return None
        value = re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], match.group("value"))
        labels[match.group("key")] = value
        position = match.end()
    return labels


def _parse_value(text: str) -> float | None:
    try:
        value = float(text)  # accepts NaN, +Inf, -Inf and exponents, as the format allows
    except ValueError:
        return None
    return value


def parse_exposition(text: str) -> Exposition:
    """Parse a whole scrape; never raises on content (unreadable lines are counted)."""
    samples: list[Sample] = []
    unreadable = 0
    first_bad: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        labels = _parse_labels(match.group("labels") or "") if match else None
        value = _parse_value(match.group("value")) if match else None
        if match is None or labels is None or value is None:
            unreadable += 1
            first_bad = first_bad or line[:120]
            continue
        if math.isnan(value):
            continue  # a NaN counter carries no count
        samples.append(Sample(match.group("name"), labels, value))
    return Exposition(samples, unreadable, first_bad)
