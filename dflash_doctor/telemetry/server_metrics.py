"""One reader per engine: its Prometheus metric names mapped onto :class:`SpecCounts` (docs/engines.md).

Every reader works by metric name and label, never by line order, and groups series by the model label
(``model_name``; llama.cpp has none, so the source's own name is used) and, when asked, by a request-class
label. Series that differ only in other labels (vLLM's ``engine`` = data-parallel rank, SGLang's
``tp_rank``, Prometheus' ``instance``) are summed, as vLLM's own PromQL does.

What each engine gives, and how it becomes vLLM's definitions:

* **vLLM** (vllm/v1/spec_decode/metrics.py ``SpecDecodingProm``): the four counters verbatim; K is the
  number of ``position`` series (K is not exported).
* **llama.cpp** (tools/server, PR #26389, "matching the vLLM counter schema"): the same four names with
  the ``llamacpp:`` prefix; older builds only ``llamacpp:n_drafted_total`` / ``n_accepted_total``
  (tokens), which give the draft acceptance rate but not tau.
* **TensorRT-LLM** (tensorrt_llm/metrics/collector.py): token counters, plus drafted / accepted tokens
  per ``token_position`` (0-based). Every draft drafts position 0, so ``num_drafts`` is the drafted count
  at position 0, and K the number of positions.
* **SGLang** (srt/observability/metrics_collector.py): no draft-token counters; ``spec_verify_calls_total``
  counts verify forwards (= drafts) and ``generation_tokens_total`` output tokens, so tau is SGLang's own
  ``generated / verify calls``, which counts each request's first (prefill) token as accepted: biased up
  for short outputs (docs/definitions.md). Its gauges ``spec_accept_length`` / ``spec_accept_rate`` are
  averages since the server started (docs/engines.md), reported beside the counts with the model's
  verify calls as their weight, so the watcher can take the average over each interval from their change.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from dflash_doctor.telemetry.counts import ALL_CLASSES, SeriesKey, SpecCounts
from dflash_doctor.telemetry.exposition import Exposition, Sample
from dflash_doctor.telemetry.observation import AVERAGE_WEIGHT

MODEL_LABEL = "model_name"


@dataclass
class Reading:
    """What one scrape said: counts per series, the engine's own gauges, and notes for the user."""

    server_kind: str
    counts: dict[SeriesKey, SpecCounts] = field(default_factory=dict)
    reported: dict[SeriesKey, dict[str, float]] = field(default_factory=dict)  # engine-computed gauges
    configured_k: dict[SeriesKey, int] = field(default_factory=dict)  # K from an info metric, where exported
    averages_since_start: tuple[
        str, ...
    ] = ()  # reported values averaged since the server started (weight: AVERAGE_WEIGHT)
    notes: list[str] = field(default_factory=list)


def _key(sample: Sample, default_model: str, class_label: str | None) -> SeriesKey:
    model = sample.labels.get(MODEL_LABEL) or default_model
    cls = sample.labels.get(class_label, ALL_CLASSES) if class_label else ALL_CLASSES
    return SeriesKey(model, cls or ALL_CLASSES)


def _sum_by_key(samples: list[Sample], default_model: str, class_label: str | None) -> dict[SeriesKey, float]:
    sums: dict[SeriesKey, float] = defaultdict(float)
    for sample in samples:
        sums[_key(sample, default_model, class_label)] += sample.value
    return dict(sums)


def _sum_by_key_and_position(
    samples: list[Sample], position_label: str, default_model: str, class_label: str | None
) -> dict[SeriesKey, tuple[float, ...]]:
    """Per-position counters as dense tuples; a missing position inside the range counts 0."""
    by_key: dict[SeriesKey, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for sample in samples:
        try:
            position = int(sample.labels[position_label])
        except (KeyError, ValueError):
            continue
        if position >= 0:
            by_key[_key(sample, default_model, class_label)][position] += sample.value
    return {key: tuple(positions.get(i, 0.0) for i in range(max(positions) + 1)) for key, positions in by_key.items()}


def _names(expo: Exposition, *names: str) -> list[Sample]:
    """Samples under any of ``names``, each also accepted without the ``_total`` suffix (offline readers drop it)."""
    variants = set(names) | {n.removesuffix("_total") for n in names}
    return expo.named(*variants)


def _vllm_schema(prefix: str, server_kind: str) -> Callable[[Exposition, str, str | None], Reading]:
    """vLLM's counter schema under ``prefix`` (``vllm:`` or llama.cpp's ``llamacpp:``)."""

    def read(expo: Exposition, default_model: str, class_label: str | None) -> Reading:
        reading = Reading(server_kind)
        drafts = _sum_by_key(_names(expo, f"{prefix}spec_decode_num_drafts_total"), default_model, class_label)
        draft_tokens = _sum_by_key(
            _names(expo, f"{prefix}spec_decode_num_draft_tokens_total"), default_model, class_label
        )
        accepted = _sum_by_key(
            _names(expo, f"{prefix}spec_decode_num_accepted_tokens_total"), default_model, class_label
        )
        per_pos = _sum_by_key_and_position(
            _names(expo, f"{prefix}spec_decode_num_accepted_tokens_per_pos_total"),
            "position",
            default_model,
            class_label,
        )
        generated_name = "vllm:generation_tokens_total" if prefix == "vllm:" else "llamacpp:tokens_predicted_total"
        generated = _sum_by_key(_names(expo, generated_name), default_model, class_label)
        if prefix == "llamacpp:" and not draft_tokens:
            # Builds before PR #26389 export token totals only (tau needs the number of drafts).
            draft_tokens = _sum_by_key(_names(expo, "llamacpp:n_drafted_total"), default_model, class_label)
            accepted = _sum_by_key(
                _names(expo, "llamacpp:n_accepted_total", "llamacpp:n_drafted_accepted_total"),
                default_model,
                class_label,
            )
            if draft_tokens:
                reading.notes.append(
                    "this llama.cpp build exports llamacpp:n_drafted_total / "
                    "n_accepted_total only: acceptance rate but no tau (no draft count)."
                )
        keys = set(drafts) | set(draft_tokens) | set(accepted) | set(per_pos)
        for key in keys:
            reading.counts[key] = SpecCounts(
                num_drafts=drafts.get(key),
                num_draft_tokens=draft_tokens.get(key),
                num_accepted_tokens=accepted.get(key),
                num_accepted_tokens_per_pos=per_pos.get(key),
                num_generated_tokens=generated.get(key),
            )
        if prefix == "vllm:":  # requests in the batch: tells which batch range a K = 0 schedule must cover
            for sample in _names(expo, "vllm:num_requests_running"):
                reported = reading.reported.setdefault(_key(sample, default_model, class_label), {})
                reported["running_requests"] = reported.get("running_requests", 0.0) + sample.value
        # A model that generates but has no spec counters is worth saying (speculation off, or stats disabled).
        for key in set(generated) - keys:
            reading.counts[key] = SpecCounts(num_generated_tokens=generated[key])
        return reading

    return read


def _read_trtllm(expo: Exposition, default_model: str, class_label: str | None) -> Reading:
    reading = Reading("trtllm")
    for prefix in ("trtllm_", "trtllm:"):  # behind NVIDIA Dynamo the prefix is rewritten to "trtllm:"
        draft_tokens = _sum_by_key(
            _names(expo, f"{prefix}spec_decode_num_draft_tokens_total"), default_model, class_label
        )
        accepted = _sum_by_key(
            _names(expo, f"{prefix}spec_decode_num_accepted_tokens_total"), default_model, class_label
        )
        drafted_pos = _sum_by_key_and_position(
            _names(expo, f"{prefix}spec_decode_drafted_tokens_total"), "token_position", default_model, class_label
        )
        accepted_pos = _sum_by_key_and_position(
            _names(expo, f"{prefix}spec_decode_accepted_tokens_total"), "token_position", default_model, class_label
        )
        generated = _sum_by_key(_names(expo, f"{prefix}generation_tokens_total"), default_model, class_label)
        gauge = _sum_by_key(_names(expo, f"{prefix}spec_decode_acceptance_length"), default_model, class_label)
        for key in set(draft_tokens) | set(accepted) | set(drafted_pos) | set(accepted_pos):
            positions = drafted_pos.get(key)
            k = len(positions) if positions else None
            per_pos = accepted_pos.get(key)
            if per_pos is not None and k:
                per_pos = per_pos + (0.0,) * (k - len(per_pos))
            reading.counts[key] = SpecCounts(
                num_drafts=positions[0] if positions else None,
                num_draft_tokens=draft_tokens.get(key),
                num_accepted_tokens=accepted.get(key),
                num_accepted_tokens_per_pos=per_pos,
                num_generated_tokens=generated.get(key),
            )
        for key, value in gauge.items():
            reading.reported.setdefault(key, {})["mean_acceptance_length"] = value
        for sample in _names(expo, f"{prefix}speculative_config_info"):
            for label in ("max_draft_len", "num_speculative_tokens", "max_draft_tokens"):
                if sample.labels.get(label, "").isdigit():
                    reading.configured_k[_key(sample, default_model, class_label)] = int(sample.labels[label])
    return reading


def _read_sglang(expo: Exposition, default_model: str, class_label: str | None) -> Reading:
    reading = Reading("sglang")
    verify_calls = _sum_by_key(_names(expo, "sglang:spec_verify_calls_total"), default_model, class_label)
    generated = _sum_by_key(_names(expo, "sglang:generation_tokens_total"), default_model, class_label)
    for key in set(verify_calls) | set(generated):
        calls, tokens = verify_calls.get(key), generated.get(key)
        reading.counts[key] = SpecCounts(
            num_drafts=calls,
            num_accepted_tokens=None if calls is None or tokens is None else max(tokens - calls, 0.0),
            num_generated_tokens=tokens,
        )
    if verify_calls:
        reading.notes.append(
            "SGLang: tau = generation tokens / verify calls (SGLang's definition; counts each request's first token, "
            "so it reads high for short outputs); no per-position counters."
        )
    # Gauges are averages since the server started, the same on every tp_rank: shown, never summed; their
    # weight is the model's verify calls over all classes (the scheduler does not see request classes).
    calls_by_model: dict[str, float] = defaultdict(float)
    for key, calls in verify_calls.items():
        calls_by_model[key.model] += calls
    for gauge_name, metric in (
        ("sglang:spec_accept_length", "mean_acceptance_length"),
        ("sglang:spec_accept_rate", "draft_acceptance_rate"),
    ):
        for sample in _names(expo, gauge_name):
            key = _key(sample, default_model, class_label)
            reported = reading.reported.setdefault(key, {})
            reported[metric] = sample.value
            if key.model in calls_by_model:
                reported[AVERAGE_WEIGHT] = calls_by_model[key.model]
    reading.averages_since_start = ("mean_acceptance_length", "draft_acceptance_rate")
    for sample in _names(expo, "sglang:spec_num_draft_tokens"):
        if sample.value >= 1:  # SGLang counts the anchor: block size = K + 1
            reading.configured_k[_key(sample, default_model, class_label)] = int(sample.value) - 1
    return reading


READERS: dict[str, Callable[[Exposition, str, str | None], Reading]] = {
    "vllm": _vllm_schema("vllm:", "vllm"),
    "sglang": _read_sglang,
    "llamacpp": _vllm_schema("llamacpp:", "llamacpp"),
    "trtllm": _read_trtllm,
}
SERVER_PREFIXES = {
    "vllm": ("vllm:",),
    "sglang": ("sglang:",),
    "llamacpp": ("llamacpp:",),
    "trtllm": ("trtllm_", "trtllm:"),
}
SPEC_METRICS_HINT = {
    "vllm": "vLLM exports vllm:spec_decode_* only with --speculative-config set and without --disable-log-stats",
    "sglang": "SGLang exports sglang:spec_verify_calls_total with --enable-metrics and a --speculative-algorithm",
    "llamacpp": "llama-server exports llamacpp:spec_decode_* with --metrics, after the first speculative request",
    "trtllm": "trtllm-serve exports trtllm_spec_decode_* on /prometheus/metrics with a speculative_config",
}


def detect_server_kind(expo: Exposition) -> str | None:
    """The engine whose metric prefix appears (the first found in READERS order), or None."""
    for server_kind, prefixes in SERVER_PREFIXES.items():
        if any(expo.has(prefix) for prefix in prefixes):
            return server_kind
    return None


def read_exposition(
    expo: Exposition, *, server_kind: str | None, default_model: str, class_label: str | None = None
) -> Reading:
    """Counts per series from one scrape; ``server_kind=None`` detects it from the metric prefixes.

    Never raises on content: an endpoint with no engine metrics, or an engine without speculative
    counters, gives an empty reading whose note says which, and what to change.
    """
    server_kind = server_kind or detect_server_kind(expo)
    if server_kind is None:
        return Reading(
            "unknown",
            notes=[
                "no vllm:, sglang:, llamacpp: or trtllm_ metrics in the scrape: is this a serving engine's /metrics?"
            ],
        )
    reading = READERS[server_kind](expo, default_model, class_label)
    if not any(c.num_drafts is not None or c.num_draft_tokens is not None for c in reading.counts.values()):
        reading.notes.append(
            f"no speculative-decoding counters in the {server_kind} metrics ({SPEC_METRICS_HINT[server_kind]})."
        )
    if expo.num_unreadable_lines:
        reading.notes.append(
            f"{expo.num_unreadable_lines} unreadable line(s) skipped, first: {expo.first_unreadable_line!r}"
        )
    return reading
