"""One request's speculative-decoding figures from an engine's ``/metrics`` counters scraped around it.

The fallback of ``check --engine`` when a server was started without per-request metrics: two scrapes
around one request on an otherwise idle server give that request's figures. A scrape is read by the same
exposition parser and engine readers as ``watch`` (``telemetry/``): vLLM's
``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total``
and ``..._num_accepted_tokens_per_pos_total{position="i"}``, llama.cpp's same names under ``llamacpp:``
(docs/engines.md); series of the served model only (``model_name``), summed over their other
labels (vLLM's ``engine`` index in data-parallel mode); a counter that went down between the two scrapes
is a server restart, not a negative count.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_doctor.serving.client import ServerEndpoint, scrape_metrics
from dflash_doctor.serving.responses import LLAMA_CPP, VLLM, MissingMetrics, SpecMeasurement, histogram_from_per_pos
from dflash_doctor.telemetry.counts import SeriesKey, SpecCounts
from dflash_doctor.telemetry.server_metrics import read_exposition
from dflash_doctor.telemetry.exposition import parse_exposition

# the engines whose counters carry all of a SpecMeasurement's figures (drafts, draft tokens, accepted
# tokens, per-position acceptances)
_FULL_COUNTERS = (VLLM, LLAMA_CPP)


@dataclass(frozen=True)
class ServerCounters:
    """The served model's cumulative spec-decode counters at one scrape."""

    server_kind: str
    counts: SpecCounts


def read_counters(text: str, model: str | None) -> ServerCounters | None:
    """``model``'s spec-decode counters on a ``/metrics`` page; None when it has none (no speculation, no
    metrics, or another model's only). ``model=None``, or a page with one model only: that model's."""
    reading = read_exposition(parse_exposition(text), server_kind=None, default_model=model or "")
    server_kind = reading.server_kind if reading.server_kind in _FULL_COUNTERS else None
    series = reading.counts.get(SeriesKey(model or ""))
    if series is None and len(reading.counts) == 1:
        series = next(iter(reading.counts.values()))
    if server_kind is None or series is None or series.num_drafts is None or series.num_draft_tokens is None:
        return None
    return ServerCounters(server_kind, series)


def scrape_counters(endpoint: ServerEndpoint) -> ServerCounters | None:
    """The served model's spec-decode counters now (None: the server has no readable /metrics page, or none on it)."""
    text = scrape_metrics(endpoint)
    return read_counters(text, endpoint.model) if text else None


def measurement_between(before: ServerCounters, after: ServerCounters) -> SpecMeasurement:
    """One request's figures from two scrapes around it; the per-position counts give its histogram
    exactly (:func:`~dflash_doctor.serving.responses.histogram_from_per_pos`). Step order is lost."""
    counts, reset = after.counts.since(before.counts)
    if reset:
        raise MissingMetrics(
            "the server's /metrics counters went down during a request (the server restarted); retry once it stays up"
        )
    drafts = round(counts.num_drafts or 0.0)
    per_pos = [round(value) for value in counts.num_accepted_tokens_per_pos or ()]
    histogram = histogram_from_per_pos(drafts, per_pos) if per_pos else None
    return SpecMeasurement(
        server_kind=after.server_kind,
        num_spec_tokens=len(per_pos) or None,
        num_drafts=drafts,
        num_draft_tokens=round(counts.num_draft_tokens or 0.0),
        num_accepted_tokens=round(counts.accepted or 0.0),
        acceptance_histogram=histogram,
    )
