"""Log-line parsers: vLLM on lines captured from the real CPU server, the others built from their format strings.

Format strings followed (quoted from the programs' source):

* vLLM 0.32.0 (the real server in .venv-vllm, and tests/data/telemetry/vllm_server_*.log captured
  from it): vllm/v1/spec_decode/metrics.py lines 120-135, ``SpecDecodingLogging.log``:
  ``"SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, Drafted
  throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, Per-position acceptance rate: %s,
  Avg Draft acceptance rate: %.1f%%"``; the older order is vllm-project/vllm#24127.
* SGLang: python/sglang/srt/managers/scheduler_components/metrics_reporter.py (commit 00df707e),
  ``SchedulerMetricsReporter.report_decode_stats``: ``f"Decode batch{iter_msg}, #running-req:
  {num_running_reqs}, #cached-token: {num_decode_cached_tokens}, {token_usage_msg}"`` +
  ``f"accept len: {spec_accept_length:.2f}, accept rate: {spec_accept_rate:.2f}, "`` +
  ``f"{self._graph_backend_label}: {can_run_cuda_graph}, gen throughput (token/s): {...:.2f}, #queue-req: {...}"``.
* llama.cpp: tools/server/server-context.cpp ``server_slot::print_timings``:
  ``SLT_INF(*this, "draft acceptance = %0.5f (%5d accepted / %5d generated), mean len = %5.2f\\n", ...)``,
  prefix ``"slot %12.*s: id %2d | task %d | "`` (tools/server/server-common.h); the PR #24536 form
  ``mean acceptance length = ..., acceptance rate per position = (...)`` and the older
  ``draft acceptance rate = ...`` are quoted from real llama-server logs.
* TensorRT-LLM: iteration stats (``GET /metrics`` of trtllm-serve) read by tensorrt_llm/metrics/collector.py
  ``log_iteration_stats``: ``specDecodingStats`` with ``numDraftTokens``, ``numAcceptedTokens``,
  ``acceptanceLength``, ``draftOverhead``; ``numRequestsWithDraftTokens``.
"""

from __future__ import annotations

import json

import pytest

from dflash_doctor.telemetry.logs import LogContext, detect_log_server_kind, parse_log_lines
from dflash_doctor.telemetry.observation import ParseProblems
from telemetry_fixtures import DATA


def parse(lines: list[str], server_kind: str | None = None):
    server_kind = server_kind or detect_log_server_kind(lines)
    problems = ParseProblems()
    ctx = LogContext(model="m", origin="test.log", year=2026, problems=problems)
    return list(parse_log_lines(lines, server_kind=server_kind, ctx=ctx)), problems


def test_vllm_real_log_lines():
    lines = (DATA / "vllm_server_good.log").read_text().splitlines()
    spec_lines = [line for line in lines if "SpecDecoding metrics:" in line]
    assert spec_lines, "the capture holds SpecDecoding lines"
    observations, problems = parse(lines)
    assert problems.count == 0
    assert len(observations) == len(spec_lines)
    for obs, line in zip(observations, spec_lines):
        accepted = int(line.split("Accepted: ")[1].split(" tokens")[0])
        printed_tau = float(line.split("Mean acceptance length: ")[1].split(",")[0])
        assert obs.counts.num_accepted_tokens == accepted
        assert obs.counts.k == 15
        # our tau from the recovered counts agrees with the one vLLM printed, to its 2 decimals
        assert obs.counts.mean_acceptance_length == pytest.approx(printed_tau, abs=0.0051)
        assert obs.time_s is not None


def test_vllm_field_order_changed_between_versions():
    old = (
        "(APIServer pid=2236552) INFO 09-09 11:51:35 [metrics.py:96] "
        "SpecDecoding metrics: Draft acceptance rate: 88.8%, "
        "Mean acceptance length: 5.44, Accepted throughput: 4.37 tokens/s, Drafted throughput: 4.92 tokens/s, "
        "Accepted: 262 tokens, Drafted: 295 tokens, Per-position acceptance rate: 0.983, 0.949, 0.915, 0.881, 0.712"
    )
    (obs,), _ = parse([old])
    assert obs.counts.num_drafts == 59 and obs.counts.num_accepted_tokens == 262
    assert obs.counts.mean_acceptance_length == pytest.approx(5.44, abs=0.005)
    assert obs.reported["draft_acceptance_rate"] == pytest.approx(0.888)


def test_vllm_json_log_record():
    record = {
        "asctime": "2026-11-30 15:40:01,123",
        "levelname": "INFO",
        "name": "vllm.v1.spec_decode.metrics",
        "message": "SpecDecoding metrics: Mean acceptance length: 2.00, Accepted "
        "throughput: 1.00 tokens/s, Drafted throughput: 3.00 tokens/s, "
        "Accepted: 30 tokens, Drafted: 90 tokens, Per-position acceptance "
        "rate: 0.600, 0.300, 0.100, Avg Draft acceptance rate: 33.3%",
    }
    (obs,), _ = parse([json.dumps(record)], server_kind="vllm")
    assert obs.counts.num_drafts == 30 and obs.counts.mean_acceptance_length == pytest.approx(2.0)
    assert obs.time_s is not None


def test_garbage_and_truncated_lines_are_counted_not_fatal():
    lines = [
        "\x00\xff binary junk",
        "(APIServer pid=1) INFO 11-30 15:00:00 [metrics.py:120] "
        "SpecDecoding metrics: Mean acceptance length: 1.5, Accep",  # cut off
        "(APIServer pid=1) INFO 11-30 15:00:10 [metrics.py:120] SpecDecoding "
        "metrics: Mean acceptance length: 1.50, Accepted throughput: 1.00 tokens/s, "
        "Drafted throughput: 2.00 tokens/s, Accepted: 5 tokens, Drafted: 20 tokens, Per-position "
        "acceptance rate: 0.300, 0.100, 0.100, 0.000, Avg Draft acceptance rate: 25.0%",
        "",
        "random text with Drafted: but no marker",
    ]
    observations, problems = parse(lines, server_kind="vllm")
    assert len(observations) == 1 and observations[0].counts.num_accepted_tokens == 5
    assert problems.count == 1 and "test.log:2" in problems.examples[0]
    assert "could not be read" in problems.message("vllm metrics")


def test_sglang_decode_batch_line():
    # Built from report_decode_stats' f-strings, with the "[iter]" option and a TP prefix.
    line = (
        "[2026-11-30 15:00:00 TP0] Decode batch [1234], #running-req: "
        "9, #cached-token: 0, #token: 11584, token usage: 0.01, "
        "accept len: 3.04, accept rate: 0.68, cuda graph: True, gen throughput (token/s): 22.40, #queue-req: 1"
    )
    assert detect_log_server_kind([line]) == "sglang"
    (obs,), problems = parse([line])
    assert obs.reported == {"mean_acceptance_length": 3.04, "draft_acceptance_rate": 0.68, "running_requests": 9.0}
    assert obs.counts.num_drafts is None  # SGLang prints averages, no counts
    assert obs.time_s is not None and problems.count == 0
    prefill = "[2026-11-30 15:00:00] Prefill batch, #new-seq: 1, #new-token: 12, #cached-token: 0, cuda graph: False"
    assert parse([prefill], server_kind="sglang")[0] == []


def test_llamacpp_slot_lines_all_spellings():
    current = (
        "0.06.896.015 I slot print_timing: id  1 | task 0 | draft acceptance "
        "= 0.64479 (  167 accepted /   259 generated), mean len =  2.92"
    )
    pr_24536 = (
        "0.06.896.015 I slot print_timing: id  1 | task 0 | draft "
        "acceptance = 0.64479 (  167 accepted /   259 generated), "
        "mean acceptance length =  2.92, acceptance rate per position = (0.805, 0.632, 0.483)"
    )
    older = "slot print_timing: id  0 | task 5 | draft acceptance rate = 0.71901 (  174 accepted /   242 generated)"
    (a,), _ = parse([current])
    (b,), _ = parse([pr_24536])
    (c,), _ = parse([older])
    assert a.counts.num_drafts == b.counts.num_drafts == 87  # = 167 / (2.92 - 1), the "#gen drafts" of the same run
    assert b.counts.num_accepted_tokens_per_pos == (70.0, 55.0, 42.0)  # "#acc drafts = 70" in the statistics line
    assert a.time_s == pytest.approx(6.896)
    assert c.counts.num_drafts is None and c.counts.draft_acceptance_rate == pytest.approx(174 / 242)


def test_trtllm_iteration_stats_lines():
    stats = [
        {
            "iter": 10,
            "iterLatencyMS": 21.5,
            "numActiveRequests": 4,
            "specDecodingStats": {
                "numDraftTokens": 12,
                "numAcceptedTokens": 7,
                "numRequestsWithDraftTokens": 4,
                "acceptanceLength": 2.75,
                "iterLatencyMS": 21.5,
                "draftOverhead": 0.21,
            },
        },
        {
            "iter": 11,
            "iterLatencyMS": 20.9,
            "numActiveRequests": 4,
            "specDecodingStats": {
                "numDraftTokens": 12,
                "numAcceptedTokens": 5,
                "numRequestsWithDraftTokens": 4,
                "acceptanceLength": 2.25,
                "iterLatencyMS": 20.9,
                "draftOverhead": 0.2,
            },
        },
        {"iter": 12, "specDecodingStats": {"numDraftTokens": "n/a"}},
    ]
    observations, problems = parse([json.dumps(s) for s in stats])
    assert [o.counts.mean_acceptance_length for o in observations] == pytest.approx(
        [2.75, 2.25]
    )  # TRT-LLM's own tau agrees
    assert problems.count == 1


def _spec_lines():
    return [
        line for line in (DATA / "vllm_server_good.log").read_text().splitlines() if "SpecDecoding metrics:" in line
    ]


def test_a_followed_log_skips_a_line_over_the_cap_without_holding_it_in_memory(tmp_path, caplog):
    """A server's log with a 16 MiB line never ended by a newline (a dumped blob): the line is skipped while
    it is read (peak memory of opening and polling stays a small fraction of it), counted, named in one
    warning and one note, and the lines after it keep their numbers."""
    import logging
    import tracemalloc

    from dflash_doctor.telemetry import sources

    cap = 2**20  # sources.MAX_LINE_BYTES
    first, second, third = _spec_lines()[:3]
    log = tmp_path / "server.log"
    line_bytes = 16 * 2**20
    with log.open("w") as handle:
        handle.write(first + "\n")
        for _ in range(line_bytes // 2**20):
            handle.write("x" * 2**20)  # unterminated: the server is still writing it
    caplog.set_level(logging.WARNING, logger="dflash_doctor")
    tracemalloc.start()
    try:
        source = sources.open_source(str(log), server_kind="vllm", model="m")
        observations = source.poll()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * cap <= line_bytes / 5, peak  # about two pieces of the cap, not the line
    assert [o.origin for o in observations] == [f"{log}:1"]
    assert any("1 line(s)" in n and str(log) in n and "longer than 1 MiB" in n for n in source.notes), source.notes

    with log.open("a") as handle:  # the long line ends, a metrics line follows, then another long line
        handle.write("y" * 2**20 + "\n" + second + "\n" + "z" * (3 * 2**20) + "\n" + third + "\n")
    tracemalloc.start()
    try:
        observations = source.poll()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * cap, peak
    assert [o.origin for o in observations] == [f"{log}:3", f"{log}:5"]
    assert any("2 line(s)" in n and str(log) in n for n in source.notes), source.notes
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "longer than" in r.getMessage()]
    assert len(warnings) == 1 and str(log) in warnings[0].getMessage()
    assert cap == sources.MAX_LINE_BYTES


def test_a_short_unterminated_line_waits_for_its_newline(tmp_path):
    first, second = _spec_lines()[:2]
    log = tmp_path / "server.log"
    log.write_text(first + "\n" + second[:40])
    from dflash_doctor.telemetry.sources import LogFile

    source = LogFile(log, server_kind="vllm", model="m")
    assert [o.origin for o in source.poll()] == [f"{log}:1"]
    with log.open("a") as handle:
        handle.write(second[40:] + "\n")
    assert [o.origin for o in source.poll()] == [f"{log}:2"] and not source.notes


def test_captured_responses_keep_a_larger_cap_for_a_long_response_body(tmp_path):
    """One line of captured responses is a whole response body: a 2 MiB completion text is read, not skipped."""
    from dflash_doctor.telemetry.sources import ResponsesFile, open_source

    record = json.loads((DATA / "vllm_responses_good.jsonl").read_text().splitlines()[0])
    record["response"]["choices"][0]["message"]["content"] = "word " * (2 * 2**20 // 5)
    captured = tmp_path / "responses.jsonl"
    captured.write_text(json.dumps(record) + "\n")
    source = open_source(str(captured))
    assert isinstance(source, ResponsesFile)
    assert len(source.poll()) == 1 and not source.notes
