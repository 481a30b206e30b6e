"""The speculative-decoding counters of an engine's ``/metrics`` page, and per-request figures from their deltas.

vLLM exports ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
``..._num_accepted_tokens_total`` and ``..._num_accepted_tokens_per_pos_total{position="i"}``; llama.cpp
(``--metrics``) the same names under ``llamacpp:`` (ENGINES.md sections 1a, 3). Counters are summed over
their other labels (vLLM's ``engine`` index in data-parallel mode). Two scrapes around one request on an
otherwise idle server give that request's figures: the fallback when a server was started without
per-request metrics.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dflash_doctor.serving.responses import LLAMA_CPP, VLLM, SpecMeasurement

_SAMPLE = re.compile(r"^(?P<prefix>vllm|llamacpp):spec_decode_num_(?P<name>drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos)_total"
                     r"(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>[0-9.eE+-]+)\s*$")
_POSITION = re.compile(r'position="(\d+)"')


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative counters at one scrape."""

    engine: str
    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_pos: tuple[float, ...]


def parse_counters(text: str) -> SpecCounters | None:
    """The spec-decode counters on a ``/metrics`` page (None when there are none: no speculation, or no metrics)."""
    totals = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    engine = None
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        engine = VLLM if match["prefix"] == "vllm" else LLAMA_CPP
        value = float(match["value"])
        if match["name"] == "accepted_tokens_per_pos":
            position = _POSITION.search(match["labels"] or "")
            if position is not None:
                index = int(position.group(1))
                per_pos[index] = per_pos.get(index, 0.0) + value
        else:
            totals[match["name"]] += value
    if engine is None:
        return None
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
    return SpecCounters(engine, totals["drafts"], totals["draft_tokens"], totals["accepted_tokens"], positions)


def measurement_between(before: SpecCounters, after: SpecCounters) -> SpecMeasurement:
    """One request's figures from two scrapes around it; the per-position counts give its histogram exactly.

    ``accepted_per_pos[i]`` counts drafts that accepted more than i tokens, so the drafts that accepted
    exactly j are ``per_pos[j - 1] - per_pos[j]`` (``per_pos[-1]`` = all drafts). Step order is lost.
    """
    drafts = round(after.num_drafts - before.num_drafts)
    width = max(len(before.accepted_per_pos), len(after.accepted_per_pos))
    pad = lambda xs: list(xs) + [0.0] * (width - len(xs))  # noqa: E731
    per_pos = [round(a - b) for a, b in zip(pad(after.accepted_per_pos), pad(before.accepted_per_pos))]
    reach = [drafts, *per_pos, 0]
    histogram = tuple(reach[j] - reach[j + 1] for j in range(width + 1)) if width else None
    return SpecMeasurement(
        engine=after.engine,
        num_spec_tokens=width or None,
        num_drafts=drafts,
        num_draft_tokens=round(after.num_draft_tokens - before.num_draft_tokens),
        num_accepted_tokens=round(after.num_accepted_tokens - before.num_accepted_tokens),
        acceptance_histogram=histogram,
    )
