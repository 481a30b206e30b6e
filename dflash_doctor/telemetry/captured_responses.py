"""Per-request speculative metrics in captured responses (one JSON object per line).

A line is either the engine's response body itself, or a wrapper ``{"class": ..., "time": ...,
"response": {...}}`` written by a client that tags its own requests - the cleanest way to get acceptance
per request class from engines that have no class label (vLLM, llama.cpp). The body is read by the one
engine-response parser, :func:`dflash_doctor.serving.responses.parse_response` (its docstring says which
fields of vLLM, SGLang and llama.cpp it reads, and how each converts to vLLM's definitions), so a captured
body and the same body answered to ``check --engine`` give the same figures.
"""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any, Iterable, Iterator

from dflash_doctor.serving.responses import (
    MalformedResponse,
    MissingMetrics,
    SpecMeasurement,
    check_response_shape,
    parse_response,
    per_pos_from_histogram,
)
from dflash_doctor.telemetry.counts import ALL_CLASSES, SeriesKey, SpecCounts
from dflash_doctor.telemetry.observation import Observation, ParseProblems


def spec_counts(measurement: SpecMeasurement) -> SpecCounts:
    """One request's figures as watch's counts (a histogram of one step or more gives the per-position counts)."""
    histogram = measurement.acceptance_histogram
    return SpecCounts(
        num_drafts=None if measurement.num_drafts is None else float(measurement.num_drafts),
        num_draft_tokens=None if measurement.num_draft_tokens is None else float(measurement.num_draft_tokens),
        num_accepted_tokens=float(measurement.num_accepted_tokens),
        num_accepted_tokens_per_pos=per_pos_from_histogram(histogram)
        if histogram is not None and len(histogram) > 1
        else None,
        num_generated_tokens=None
        if measurement.num_generated_tokens is None
        else float(measurement.num_generated_tokens),
    )


def _time(value: Any) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return _dt.datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    return None


def parse_response_lines(
    lines: Iterable[str], *, default_model: str, origin: str, problems: ParseProblems, first_line_number: int = 1
) -> Iterator[Observation]:
    """One observation per response that carries speculative metrics; other lines are counted as problems.

    A response without speculative metrics (speculation off, or the server flag not set) is not an error
    of the file, but a whole file of them is: the caller reports that.
    """
    for number, raw in enumerate(lines, start=first_line_number):
        if not raw.strip():
            continue
        where = f"{origin}:{number}"
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            problems.add(where, raw)
            continue
        if not isinstance(record, dict):
            problems.add(where, raw)
            continue
        response = record.get("response")
        body: dict[str, Any] = response if isinstance(response, dict) else record
        try:
            check_response_shape(body)
            counts = spec_counts(parse_response(body))
        except MissingMetrics:  # speculation off, or the server flag not set: not an error of the line
            continue
        except (MalformedResponse, TypeError, ValueError):
            problems.add(where, raw)
            continue
        if counts.impossible() is not None:  # refused as data: figures no engine can report
            problems.add(where, raw)
            continue
        cls = record.get("class") or ALL_CLASSES
        model = str(body.get("model") or record.get("model") or default_model)
        time_s = _time(record.get("time")) or _time(body.get("created"))
        yield Observation(
            SeriesKey(model, str(cls)), counts, cumulative=False, time_s=time_s, origin=where, reported={}
        )
