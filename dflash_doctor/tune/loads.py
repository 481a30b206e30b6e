"""Load levels of a tune run: their two kinds, how a level is written (tune.json keys, table columns, words)
and when each request of a level is sent.

A load level is a closed loop or an open loop (:class:`LoadLevel`), as ``vllm bench serve`` has them:
``concurrency`` N keeps N requests in flight, the next one sent when one is answered (a benchmark's
batch size); ``request_rate`` R sends each request at its own arrival time whatever is in flight
(production traffic): inter-arrival times gamma-distributed with shape = burstiness and mean 1 / R (1 =
Poisson; below 1 burstier, above 1 steadier), drawn from the run's seed so every K sees the same offsets,
and scaled so the last one falls at N / R (vllm/benchmarks/serve.py ``get_request``); R = inf sends all at
once; ``max_concurrency`` caps the requests in flight (a late arrival waits for a slot, as ``vllm bench
serve --max-concurrency`` with a rate). The two differ only in when a request starts; the measuring is one path.

Kept apart from :mod:`.measure` (which streams requests with the replay's turn limits, and so imports the
engine and torch) because the views and the dashboard name load levels too, and a monitoring install must
render a tune run without the model stack (tests/test_light_install.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

CONCURRENCY = "concurrency"
REQUEST_RATE = "request_rate"
LOAD_KINDS = (CONCURRENCY, REQUEST_RATE)  # a load is recorded under its kind's name (requests.parquet, tune.json)


def load_kind(record: Any) -> str:
    """The kind of load a request row, a frame of them or a tune.json cell is recorded under."""
    return next(kind for kind in LOAD_KINDS if kind in record)


def load_of(record: dict[str, Any]) -> Any:
    """The load level of a cell or prediction row (a concurrency, or a request rate: a number or "inf")."""
    return record[load_kind(record)]


def load_text(value: Any) -> str:
    """A load level as tune.json's keys and the tables write it: 8, 0.5, inf."""
    return value if isinstance(value, str) else f"{value:g}"


def load_label(kind: str, value: Any) -> str:
    """A load level in words: "concurrency 8", "request rate 2/s", "request rate inf (all at once)"."""
    text = load_text(value)
    if kind == CONCURRENCY:
        return f"concurrency {text}"
    return "request rate inf (all at once)" if text == "inf" else f"request rate {text}/s"


@dataclass(frozen=True)
class LoadLevel:
    """One load level: ``concurrency`` requests in flight (closed loop) or ``request_rate`` requests per second
    arriving with gamma inter-arrival times of shape ``burstiness``, at most ``max_concurrency`` in flight
    (open loop); see the module doc."""

    kind: str
    value: int | float
    burstiness: float = 1.0
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        return load_label(self.kind, self.value)

    def arrival_offsets(self, num_requests: int, seed: int) -> list[float]:
        """Seconds from the run's start at which each request is sent (all 0 for a closed loop, whose
        pacing is its workers)."""
        if self.kind == CONCURRENCY:
            return [0.0] * num_requests
        return arrival_offsets(num_requests, float(self.value), self.burstiness, seed)

    def workers(self, num_requests: int) -> int:
        """Threads sending: the concurrency, or one per request up to the cap (an open loop waits for nothing
        in flight; the threads take requests in arrival order, so a capped one starts when a slot frees)."""
        if self.kind == CONCURRENCY:
            return int(self.value)
        return max(min(num_requests, self.max_concurrency or num_requests), 1)


def arrival_offsets(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """vLLM's arrival schedule: cumulative gamma(shape=burstiness, scale=1 / (rate * burstiness)) gaps, the
    first one included, scaled so the last arrival is at num_requests / rate; rate inf: all at 0."""
    if math.isinf(rate) or num_requests == 0:
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)
    offsets = np.cumsum(gaps)
    return [float(x) for x in offsets * (num_requests / rate / offsets[-1])]
