"""`dflash-doctor watch` end to end on captured real vLLM metric text served by a small exporter.

The texts in tests/data/telemetry/vllm_metrics_*.txt were scraped from the real vLLM 0.32.0 CPU server
serving the demo pair: ``good_1`` after a few requests, ``good`` after more, ``broken`` from the same
server restarted with the draft's ``target_layer_ids`` shifted by one (a forced acceptance drop).
"""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.rundir.load import load_run
from dflash_doctor.telemetry.counts import SeriesKey, SpecCounts
from dflash_doctor.telemetry.server_metrics import read_exposition
from dflash_doctor.telemetry.exposition import parse_exposition
from dflash_doctor.telemetry.watch_record import read_windows
from dflash_doctor.telemetry.sources import MetricsEndpoint
from dflash_doctor.telemetry.verdict import Baseline, Judge, Thresholds
from dflash_doctor.telemetry.watcher import Watcher, Window
from telemetry_fixtures import DATA, MetricsExporter, free_port

MODEL = SeriesKey("smollm2-dflash")
runner = CliRunner()


def capture(name: str) -> str:
    return (DATA / f"vllm_metrics_{name}.txt").read_text()


def counts_of(name: str) -> SpecCounts:
    return read_exposition(parse_exposition(capture(name)), server_kind="vllm", default_model="x").counts[MODEL]


def invoke(*args: str):
    result = runner.invoke(app, ["watch", *args])
    return result, re.sub(r"\s+", " ", result.output)


def test_once_prints_the_tau_its_counters_imply(tmp_path):
    expected = counts_of("good")
    with MetricsExporter(capture("good")) as exporter:
        result, text = invoke(exporter.url, "--once", "--out", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert f"{expected.mean_acceptance_length:.2f}" in text
    windows = read_windows(tmp_path / "run")
    (row,) = windows.to_dict("records")
    assert row["mean_acceptance_length"] == pytest.approx(expected.mean_acceptance_length)
    assert row["num_drafts"] == expected.num_drafts and row["k"] == 15


def test_forced_drop_alerts_with_fallback_advice(tmp_path):
    good, broken = counts_of("good"), counts_of("broken")
    assert broken.mean_acceptance_length < good.mean_acceptance_length - 0.2  # the capture really dropped
    cost_profile = tmp_path / "costs.toml"
    # Step times where the good draft pays (about 1.2x) and the broken one does not.
    cost_profile.write_text("t_decode_s = 0.010\nt_draft_s = 0.002\n[t_verify_s]\n1 = 0.0105\n15 = 0.012\n")
    with MetricsExporter(capture("broken")) as exporter:
        result, text = invoke(
            exporter.url,
            "--once",
            "--baseline",
            f"{good.mean_acceptance_length:.4f}",
            "--cost-profile",
            str(cost_profile),
            "--min-drafts",
            "20",
            "--out",
            str(tmp_path / "run"),
        )
    assert result.exit_code == 1, result.output
    assert "acceptance-drop" in text and "fallback" in text and "fall back" in text
    assert "num_speculative_tokens" in text and "num_speculative_tokens_per_batch_size" in text
    row = read_windows(tmp_path / "run").iloc[0]
    assert set(row["alerts"]) == {"acceptance-drop", "fallback"}
    assert row["speedup"] < 1.0
    recorded = load_run(tmp_path / "run").record.source.details["alerts"]
    assert [a["kind"] for a in recorded] == ["acceptance-drop", "fallback"]
    assert any("num_speculative_tokens_per_batch_size" in line for line in recorded[1]["advice"])


def test_no_alert_when_production_matches_the_baseline(tmp_path):
    good = counts_of("good")
    with MetricsExporter(capture("good")) as exporter:
        result, _ = invoke(
            exporter.url,
            "--once",
            "--baseline",
            f"{good.mean_acceptance_length:.4f}",
            "--min-drafts",
            "20",
            "--out",
            str(tmp_path / "run"),
        )
    assert result.exit_code == 0, result.output


def test_counter_reset_and_failed_scrape_lose_nothing():
    with MetricsExporter(capture("good_1")) as exporter:
        watcher = Watcher([MetricsEndpoint(exporter.url, server_kind="vllm")], window_s=1e9)
        watcher.poll(now=1.0)  # the starting point
        exporter.failing = True
        watcher.poll(now=2.0)  # fails mid-watch
        exporter.failing = False
        exporter.text = capture("good")
        watcher.poll(now=3.0)  # covers the gap
        exporter.text = capture("broken")  # the server restarted: counters start over
        watcher.poll(now=4.0)
    kinds = [e.kind for e in watcher.events]
    assert kinds == ["source-unavailable", "counter-reset"]
    first, second = [u.counts for u in watcher.units if u.counts.num_drafts is not None]
    gap_window, reset = counts_of("good").since(counts_of("good_1"))
    assert first == gap_window and not reset  # nothing lost across the failed scrape
    assert second == counts_of("broken")  # after the restart: what the new server counted, no negatives
    assert all(v >= 0 for v in second.num_accepted_tokens_per_pos)


def test_window_with_failed_scrape_says_so():
    judge = Judge(None, Thresholds(), server_kind="vllm")
    verdict = judge.judge(Window(MODEL, 0.0, 10.0, SpecCounts(), [], {}, source_unavailable=True))
    assert verdict.status == "source-unavailable" and not verdict.alerts


def test_idle_window_and_drafting_stopped():
    judge = Judge(None, Thresholds(min_drafts=1), server_kind="vllm")
    drafting = counts_of("good")
    judge.judge(Window(MODEL, 0, 10, drafting, [drafting]))
    idle = SpecCounts(
        num_drafts=0.0,
        num_draft_tokens=0.0,
        num_accepted_tokens=0.0,
        num_accepted_tokens_per_pos=(0.0,) * 15,
        num_generated_tokens=0.0,
    )
    verdict = judge.judge(Window(MODEL, 10, 20, idle, [idle]))
    assert verdict.status == "idle" and not verdict.alerts
    stopped = SpecCounts(
        num_drafts=0.0,
        num_draft_tokens=0.0,
        num_accepted_tokens=0.0,
        num_accepted_tokens_per_pos=(0.0,) * 15,
        num_generated_tokens=500.0,
    )
    verdict = judge.judge(Window(MODEL, 20, 30, stopped, [stopped]))
    assert [a.kind for a in verdict.alerts] == ["drafting-stopped"]


def test_k_changed_alerts():
    judge = Judge(None, Thresholds(min_drafts=1), server_kind="vllm")
    k15 = counts_of("good")
    k4 = SpecCounts(
        num_drafts=100.0,
        num_draft_tokens=400.0,
        num_accepted_tokens=80.0,
        num_accepted_tokens_per_pos=(50.0, 20.0, 8.0, 2.0),
        num_generated_tokens=180.0,
    )
    assert not judge.judge(Window(MODEL, 0, 10, k15, [k15])).alerts
    verdict = judge.judge(Window(MODEL, 10, 20, k4, [k4]))
    assert [a.kind for a in verdict.alerts] == ["k-changed"] and "K=15 to K=4" in verdict.alerts[0].message


def test_baseline_run_is_truncated_to_the_served_k():
    baseline = Baseline.fixed({"overall": 3.0})
    assert baseline.for_class("all").tau == 3.0
    from dflash_doctor.telemetry.verdict import BaselineEntry, _baseline_at_k

    entry = BaselineEntry(tau=1 + 0.6 + 0.3 + 0.1, tau_ci=(1.9, 2.1), rates=(0.6, 0.3, 0.1))
    tau, ci, note = _baseline_at_k(entry, 2)
    assert tau == pytest.approx(1.9) and ci == pytest.approx((1.8, 2.0)) and "truncated" in note


def test_missing_metric_is_a_clear_note_not_a_crash(tmp_path):
    text = "\n".join(line for line in capture("good").splitlines() if "spec_decode" not in line)
    with MetricsExporter(text) as exporter:
        result, out = invoke(exporter.url, "--once", "--out", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert "no speculative-decoding counters" in out and "Traceback" not in out


def test_unreachable_endpoint_and_bad_input_exit_2(tmp_path):
    port = free_port()
    result, out = invoke(f"http://127.0.0.1:{port}/metrics", "--once", "--out", str(tmp_path / "run"))
    assert (
        result.exit_code == 2
        and f"no answer from http://127.0.0.1:{port}/metrics (Connection refused)" in out
        and "Traceback" not in out
    )
    result, out = invoke(str(tmp_path / "nope.log"), "--once")
    assert result.exit_code == 2 and "neither an http(s) URL nor an existing file" in out
    result, out = invoke(str(DATA / "vllm_server_good.log"), "--once", "--window", "-5")
    assert result.exit_code == 2
    result, out = invoke(str(DATA / "vllm_server_good.log"), "--once", "--engine", "tgi")
    assert result.exit_code == 2 and "not one of" in out


def test_log_file_with_garbage_lines(tmp_path):
    log = tmp_path / "vllm.log"
    real = (DATA / "vllm_server_good.log").read_text().splitlines()
    garbage = [
        "\x00\x01garbage",
        "(APIServer pid=1) INFO 11-30 15:00:00 [metrics.py:120] SpecDecoding metrics: Mean acc",
    ]
    log.write_text("\n".join(garbage + real + garbage) + "\n")
    result, out = invoke(str(log), "--once", "--window", "1h", "--min-drafts", "1", "--out", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert "2 vllm metrics line(s) could not be read" in out
    windows = read_windows(tmp_path / "run")
    assert windows["num_drafts"].sum() > 0


def test_captured_responses_per_class(tmp_path):
    result, out = invoke(
        str(DATA / "vllm_responses_good.jsonl"),
        "--once",
        "--window",
        "1h",
        "--min-drafts",
        "1",
        "--out",
        str(tmp_path / "run"),
    )
    assert result.exit_code == 0, result.output
    windows = read_windows(tmp_path / "run")
    assert set(windows["class"]) == {"math", "code", "chat"}


def test_live_watch_writes_a_window_per_poll(tmp_path):
    import threading
    import time

    with MetricsExporter(capture("good_1")) as exporter:

        def serve_more_after_two_scrapes():  # more requests arrive while watch is running
            while exporter.scrapes < 2:
                time.sleep(0.05)
            exporter.text = capture("good")

        threading.Thread(target=serve_more_after_two_scrapes, daemon=True).start()
        result, out = invoke(
            exporter.url,
            "--interval",
            "0.5",
            "--window",
            "30s",
            "--duration",
            "3",
            "--min-drafts",
            "1",
            "--out",
            str(tmp_path / "run"),
        )
    assert result.exit_code == 0, result.output
    windows = read_windows(tmp_path / "run")
    assert len(windows) >= 3
    increase, _ = counts_of("good").since(counts_of("good_1"))
    # the last window (30 s) holds exactly the counters' increase since the first scrape
    assert windows.sort_values("end_s")["mean_acceptance_length"].iloc[-1] == pytest.approx(
        increase.mean_acceptance_length
    )


def test_config_file_watch_table(tmp_path):
    good = counts_of("good")
    config = tmp_path / "doctor.toml"
    config.write_text(
        "[watch]\nmin_drafts = 20\nthreshold_tau = 0.05\n[watch.baseline_tau]\noverall "
        f"= {good.mean_acceptance_length + 0.5:.3f}\n"
    )
    with MetricsExporter(capture("good")) as exporter:
        result, out = invoke(exporter.url, "--once", "--config", str(config), "--out", str(tmp_path / "run"))
        assert result.exit_code == 1 and "acceptance-drop" in out  # the table's baseline is 0.5 above production
        # a flag beats the file: with a larger threshold the same drop does not alert
        result, out = invoke(
            exporter.url, "--once", "--config", str(config), "--threshold-tau", "1.0", "--out", str(tmp_path / "run2")
        )
        assert result.exit_code == 0, out
    config.write_text("[watch]\nwindw = '5m'\n")
    result, out = invoke(str(DATA / "vllm_server_good.log"), "--once", "--config", str(config))
    assert result.exit_code == 2 and "unknown key(s) windw" in out


@pytest.mark.parametrize(
    "name, extra, series",
    [
        ("sglang_metrics.txt", ["--class-label", "cls"], {("glm", "code"), ("glm", "chat"), ("glm", "all")}),
        ("llamacpp_metrics.txt", ["--model", "llama-server"], {("llama-server", "all")}),
        ("trtllm_prometheus.txt", [], {("nemotron-nano-3", "all")}),
    ],
)
def test_other_engines_through_watch(tmp_path, name, extra, series):
    with MetricsExporter((DATA / name).read_text()) as exporter:
        result, out = invoke(exporter.url, "--once", "--min-drafts", "1", *extra, "--out", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    windows = read_windows(tmp_path / "run")
    assert set(zip(windows["model"], windows["class"])) == series
    assert windows["mean_acceptance_length"].notna().any()


def test_sglang_log_is_shown_not_judged(tmp_path):
    # Lines in SGLang's report_decode_stats format (see test_telemetry_logs.py for the source).
    lines = [
        f"[2026-11-30 15:00:{10 * i:02d}] Decode batch, #running-req: "
        "4, #cached-token: 0, #token: 900, token usage: 0.01, "
        f"accept len: {value:.2f}, accept rate: 0.40, cuda graph: True, gen throughput (token/s): 50.00, #queue-req: 0"
        for i, value in enumerate([2.1, 2.3, 2.2, 2.4, 2.0])
    ]
    log = tmp_path / "sglang.log"
    log.write_text("\n".join(lines) + "\n")
    result, out = invoke(str(log), "--once", "--window", "1h", "--baseline", "5.0", "--out", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output  # averages carry no counts: no drop verdict, and it says so
    assert "engine reports averages only" in out
    row = read_windows(tmp_path / "run").iloc[0]
    assert row["engine_mean_acceptance_length"] == pytest.approx(2.2)
