"""Per-request speculative metrics in captured responses (one JSON object per line).

A line is either the engine's response body itself, or a wrapper ``{"class": ..., "time": ...,
"response": {...}}`` written by a client that tags its own requests - the cleanest way to get acceptance
per request class from engines that have no class label (vLLM, llama.cpp). Fields read, by key:

* vLLM (``--per-request-spec-decode-metrics``): ``metrics.speculative_decoding`` with ``num_spec_steps``
  (drafts), ``num_draft_tokens``, ``num_accepted_draft_tokens``, ``acceptance_histogram`` (index j =
  steps that accepted exactly j; turned into per-position counts), ``num_spec_tokens`` (K).
* SGLang: ``meta_info`` (native ``/generate``), ``choices[i].meta_info`` or ``sglext.spec_tokens_details``
  with ``spec_verify_ct`` (drafts), ``spec_num_proposed_drafts``, ``spec_num_correct_drafts``,
  ``spec_correct_drafts_histogram`` (bonus excluded, like vLLM's).
* llama.cpp: ``timings.draft_n`` / ``timings.draft_n_accepted`` (tokens only: no draft count, so no tau).
"""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any, Iterable, Iterator

from dflash_doctor.telemetry.counts import ALL_CLASSES, SeriesKey, SpecCounts
from dflash_doctor.telemetry.observation import Observation, ParseProblems


def per_pos_from_histogram(histogram: list[float]) -> tuple[float, ...]:
    """``histogram[j]`` = drafts accepting exactly j tokens (j = 0..K) -> drafts accepting at least i + 1 (i = 0..K-1)."""
    return tuple(float(sum(histogram[i + 1 :])) for i in range(len(histogram) - 1))


def _vllm(body: dict[str, Any]) -> SpecCounts | None:
    spec = (body.get("metrics") or {}).get("speculative_decoding") if isinstance(body.get("metrics"), dict) else None
    if not isinstance(spec, dict):
        return None
    histogram = spec.get("acceptance_histogram")
    return SpecCounts(
        num_drafts=float(spec["num_spec_steps"]),
        num_draft_tokens=float(spec["num_draft_tokens"]),
        num_accepted_tokens=float(spec["num_accepted_draft_tokens"]),
        num_accepted_tokens_per_pos=per_pos_from_histogram(histogram) if isinstance(histogram, list) and len(histogram) > 1 else None,
        num_generated_tokens=_completion_tokens(body),
    )


def _sglang_fields(body: dict[str, Any]) -> dict[str, Any] | None:
    candidates = [body.get("meta_info"), (body.get("sglext") or {}).get("spec_tokens_details") if isinstance(body.get("sglext"), dict) else None]
    for choice in body.get("choices") or []:
        if isinstance(choice, dict):
            candidates.append(choice.get("meta_info"))
    for fields in candidates:
        if isinstance(fields, list) and fields:  # n > 1: one details object per choice; the first is read
            fields = fields[0]
        if isinstance(fields, dict) and "spec_verify_ct" in fields:
            return fields
    return None


def _sglang(body: dict[str, Any]) -> SpecCounts | None:
    fields = _sglang_fields(body)
    if fields is None:
        return None
    histogram = fields.get("spec_correct_drafts_histogram")
    accepted = fields.get("spec_num_correct_drafts")
    return SpecCounts(
        num_drafts=float(fields["spec_verify_ct"]),
        num_draft_tokens=None if fields.get("spec_num_proposed_drafts") is None else float(fields["spec_num_proposed_drafts"]),
        num_accepted_tokens=None if accepted is None else float(accepted),
        num_accepted_tokens_per_pos=per_pos_from_histogram(histogram) if isinstance(histogram, list) and len(histogram) > 1 else None,
        num_generated_tokens=_completion_tokens(body) or (float(fields["completion_tokens"]) if "completion_tokens" in fields else None),
    )


def _llamacpp(body: dict[str, Any]) -> SpecCounts | None:
    timings = body.get("timings")
    if not isinstance(timings, dict) or "draft_n" not in timings:
        return None
    return SpecCounts(
        num_draft_tokens=float(timings["draft_n"]),
        num_accepted_tokens=float(timings.get("draft_n_accepted", 0)),
        num_generated_tokens=float(timings["predicted_n"]) if "predicted_n" in timings else None,
    )


def _completion_tokens(body: dict[str, Any]) -> float | None:
    usage = body.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), (int, float)):
        return float(usage["completion_tokens"])
    return None


RESPONSE_READERS = {"vllm": _vllm, "sglang": _sglang, "llamacpp": _llamacpp}


def _time(value: Any) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return _dt.datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    return None


def parse_response_lines(lines: Iterable[str], *, default_model: str, origin: str, problems: ParseProblems, first_line_number: int = 1) -> Iterator[Observation]:
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
        for engine, reader in RESPONSE_READERS.items():
            try:
                counts = reader(body)
            except (KeyError, TypeError, ValueError):
                problems.add(where, raw)
                counts = None
                break
            if counts is not None:
                break
        if counts is None:
            continue
        if counts.impossible() is not None:  # refused as data: figures no engine can report
            problems.add(where, raw)
            continue
        cls = record.get("class") or ALL_CLASSES
        model = str(body.get("model") or record.get("model") or default_model)
        time_s = _time(record.get("time")) or _time(body.get("created"))
        yield Observation(SeriesKey(model, str(cls)), counts, cumulative=False, time_s=time_s, origin=where, reported={})
