"""Engine readers on /metrics text: vLLM captured from the real CPU server, the others from their source.

Sources of the non-vLLM texts in tests/data/telemetry (names, labels and types as each program
registers them; the text is what prometheus_client / llama.cpp's writer emits for them):

* sglang_metrics.txt - sgl-project/sglang python/sglang/srt/observability/metrics_collector.py
  (commit 44cedc2b): scheduler gauges ``sglang:spec_accept_length``, ``sglang:spec_accept_rate``,
  ``sglang:spec_num_draft_tokens`` with labels model_name/engine_type/tp_rank/pp_rank/moe_ep_rank;
  tokenizer counters ``sglang:spec_verify_calls_total`` and ``sglang:generation_tokens_total`` with
  custom labels (``--tokenizer-metrics-allowed-custom-labels cls``, header ``x-custom-labels``).
* llamacpp_metrics.txt - ggml-org/llama.cpp tools/server/server-context.cpp (metrics handler, PR #26389
  "matching the vLLM counter schema", no labels); llamacpp_metrics_old.txt - the older
  ``llamacpp:n_drafted_total`` / ``n_accepted_total`` names. Counts are those of the real slot log
  in test_telemetry_logs.py (87 drafts, 259 drafted, 167 accepted).
* trtllm_prometheus.txt - NVIDIA/TensorRT-LLM tensorrt_llm/metrics/collector.py (commit 050f80de):
  ``MetricsCollector.__init__`` ("Speculative decoding metrics": ``spec_decode_num_draft_tokens_total``,
  ``spec_decode_num_accepted_tokens_total``, gauge ``spec_decode_acceptance_length``; "Per-position
  speculative decoding acceptance counters": ``spec_decode_drafted_tokens_total`` /
  ``spec_decode_accepted_tokens_total`` with label ``token_position``, 0-based, set in
  ``log_request_metrics_dict``), ``log_config_info`` (``trtllm_speculative_config_info``).
"""

from __future__ import annotations

import pytest

from dflash_doctor.telemetry.counts import SeriesKey
from dflash_doctor.telemetry.server_metrics import detect_server_kind, read_exposition
from dflash_doctor.telemetry.exposition import parse_exposition
from telemetry_fixtures import DATA


def read(name: str, **kwargs):
    expo = parse_exposition((DATA / name).read_text())
    return read_exposition(
        expo, server_kind=kwargs.pop("engine", None), default_model=kwargs.pop("default_model", "src"), **kwargs
    )


def vllm_counts_by_hand(text: str, model: str) -> dict[str, float]:
    """The real capture's counters read line by line, independently of the reader under test."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode") and f'model_name="{model}"' in line and "_created" not in line:
            name = line.split("{")[0]
            position = line.split('position="')[1].split('"')[0] if 'position="' in line else None
            key = name if position is None else f"{name}[{position}]"
            values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def test_vllm_real_capture_tau_is_what_its_counters_imply():
    text = (DATA / "vllm_metrics_good.txt").read_text()
    reading = read("vllm_metrics_good.txt")
    assert reading.server_kind == "vllm"
    (key,) = [k for k, c in reading.counts.items() if c.num_drafts]
    by_hand = vllm_counts_by_hand(text, key.model)
    counts = reading.counts[key]
    drafts = by_hand["vllm:spec_decode_num_drafts_total"]
    accepted = by_hand["vllm:spec_decode_num_accepted_tokens_total"]
    assert counts.mean_acceptance_length == pytest.approx(1 + accepted / drafts)
    positions = sorted(int(k.split("[")[1][:-1]) for k in by_hand if "[" in k)
    assert counts.k == len(positions) == 15  # K is not exported: the number of position series
    # per-position counts add up to the accepted tokens (each accepted token sits at one position)
    assert sum(counts.num_accepted_tokens_per_pos) == pytest.approx(accepted)
    assert counts.num_generated_tokens and counts.num_generated_tokens > 0


def test_several_models_on_one_endpoint_stay_apart():
    # Two real captures (the good and the broken draft) served under two model names on one endpoint.
    good = (DATA / "vllm_metrics_good.txt").read_text()
    broken = (
        (DATA / "vllm_metrics_broken.txt")
        .read_text()
        .replace('model_name="smollm2-dflash"', 'model_name="smollm2-broken"')
    )
    samples_only = "\n".join(line for line in broken.splitlines() if not line.startswith("#"))
    reading = read_exposition(parse_exposition(good + "\n" + samples_only), server_kind=None, default_model="src")
    good_tau = read("vllm_metrics_good.txt").counts[SeriesKey("smollm2-dflash")].mean_acceptance_length
    broken_tau = read("vllm_metrics_broken.txt").counts[SeriesKey("smollm2-dflash")].mean_acceptance_length
    assert reading.counts[SeriesKey("smollm2-dflash")].mean_acceptance_length == pytest.approx(good_tau)
    assert reading.counts[SeriesKey("smollm2-broken")].mean_acceptance_length == pytest.approx(broken_tau)


def test_missing_spec_metrics_say_why():
    text = "\n".join(
        line for line in (DATA / "vllm_metrics_good.txt").read_text().splitlines() if "spec_decode" not in line
    )
    reading = read_exposition(parse_exposition(text), server_kind=None, default_model="src")
    assert reading.server_kind == "vllm"
    assert any("no speculative-decoding counters" in note and "--speculative-config" in note for note in reading.notes)
    assert all(c.num_drafts is None for c in reading.counts.values())
    nothing = read_exposition(
        parse_exposition("process_cpu_seconds_total 1.0\n"), server_kind=None, default_model="src"
    )
    assert nothing.server_kind == "unknown" and "serving engine" in nothing.notes[0]


def test_sglang_counts_per_custom_label_class():
    reading = read("sglang_metrics.txt", class_label="cls")
    assert reading.server_kind == "sglang"
    code = reading.counts[SeriesKey("glm", "code")]
    chat = reading.counts[SeriesKey("glm", "chat")]
    # SGLang's own definition: generation tokens / verify calls (streaming and non-streaming summed)
    assert code.mean_acceptance_length == pytest.approx((3100 + 300) / 1000)
    assert chat.mean_acceptance_length == pytest.approx(900 / 500)
    assert code.acceptance_rate_per_pos is None  # SGLang exports no per-position counter
    # gauges are reported beside the counts, never summed over tp ranks
    assert reading.reported[SeriesKey("glm")]["mean_acceptance_length"] == pytest.approx(3.04)
    assert reading.configured_k[SeriesKey("glm")] == 3  # block of 4 counts the anchor
    assert any("SGLang's definition" in note for note in reading.notes)


def test_llamacpp_current_and_old_names():
    reading = read("llamacpp_metrics.txt", default_model="llama-server")
    counts = reading.counts[SeriesKey("llama-server")]
    assert counts.mean_acceptance_length == pytest.approx(1 + 167 / 87)
    assert counts.acceptance_rate_per_pos == pytest.approx([70 / 87, 55 / 87, 42 / 87])
    assert counts.num_generated_tokens == 665
    old = read("llamacpp_metrics_old.txt", default_model="llama-server")
    old_counts = old.counts[SeriesKey("llama-server")]
    assert old_counts.draft_acceptance_rate == pytest.approx(515 / 604)
    assert old_counts.mean_acceptance_length is None  # no draft count: no tau, and it says so
    assert any("no tau" in note for note in old.notes)


def test_trtllm_drafts_are_position_zero_drafts():
    reading = read("trtllm_prometheus.txt")
    assert detect_server_kind(parse_exposition((DATA / "trtllm_prometheus.txt").read_text())) == "trtllm"
    counts = reading.counts[SeriesKey("nemotron-nano-3")]
    assert counts.num_drafts == 1000 and counts.k == 3
    assert counts.mean_acceptance_length == pytest.approx(1 + 1650 / 1000)
    assert counts.acceptance_rate_per_pos == pytest.approx([0.8, 0.55, 0.3])
    assert reading.reported[SeriesKey("nemotron-nano-3")]["mean_acceptance_length"] == 2.5
    assert reading.configured_k[SeriesKey("nemotron-nano-3")] == 3


def test_field_order_does_not_matter():
    text = (DATA / "trtllm_prometheus.txt").read_text()
    shuffled = "\n".join(reversed(text.splitlines()))
    assert (
        read_exposition(parse_exposition(shuffled), server_kind=None, default_model="x").counts
        == read("trtllm_prometheus.txt").counts
    )
