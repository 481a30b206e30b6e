"""watch through a real Prometheus (Debian's `prometheus`): it scrapes a small exporter serving captured
real vLLM metric text, and watch reads the window's samples through its HTTP API.

Why not ``rate(X[W]) * W``: Prometheus extrapolates each series to the window edges but caps that at the
point where the series would reach zero, so series that were near zero at the window start (higher
draft positions, a fresh server) get another factor and tau drifts (1.598 instead of 1.590 on these
captures). watch differences the raw samples with PromQL's reset rule instead: exact.
"""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.telemetry.counts import SeriesKey
from dflash_doctor.telemetry.server_metrics import read_exposition
from dflash_doctor.telemetry.exposition import parse_exposition
from dflash_doctor.telemetry.watch_record import read_windows
from dflash_doctor.telemetry.sources import PrometheusServer as PrometheusSource
from telemetry_fixtures import DATA, AuthGateway, MetricsExporter, PrometheusServer

MODEL = SeriesKey("smollm2-dflash")


def capture(name: str) -> str:
    return (DATA / f"vllm_metrics_{name}.txt").read_text()


def counts(name: str):
    return read_exposition(parse_exposition(capture(name)), server_kind="vllm", default_model="x").counts[MODEL]


def test_window_gives_the_tau_of_the_counter_increase(tmp_path):
    window_counts, reset = counts("good").since(counts("good_1"))
    assert not reset
    with (
        MetricsExporter(capture("good_1")) as exporter,
        PrometheusServer([f"127.0.0.1:{exporter.port}"], tmp_path) as prometheus,
    ):
        prometheus.wait_for_samples("count_over_time(vllm:spec_decode_num_drafts_total[1m])", 3)
        exporter.text = capture("good")  # more requests were served
        prometheus.wait_for_samples("count_over_time(vllm:spec_decode_num_drafts_total[1m])", 6)
        source = PrometheusSource(prometheus.url, window_s=60)
        (observation,) = [o for o in source.poll() if o.counts.num_drafts]
        assert source.server_kind == "vllm"  # detected through the API
        # exactly the counts the exporter's counters grew by (no extrapolation)
        assert observation.counts.mean_acceptance_length == pytest.approx(
            window_counts.mean_acceptance_length, rel=1e-6
        )
        assert observation.counts.k == 15
        assert observation.counts.acceptance_rate_per_pos == pytest.approx(
            window_counts.acceptance_rate_per_pos, rel=1e-6
        )

        result = CliRunner().invoke(
            app,
            [
                "watch",
                "--prometheus",
                prometheus.url,
                "--window",
                "60s",
                "--once",
                "--min-drafts",
                "1",
                "--out",
                str(tmp_path / "run"),
            ],
        )
    assert result.exit_code == 0, result.output
    assert f"{window_counts.mean_acceptance_length:.2f}" in re.sub(r"\s+", " ", result.output)
    assert read_windows(tmp_path / "run")["mean_acceptance_length"].iloc[0] == pytest.approx(
        window_counts.mean_acceptance_length, rel=1e-6
    )


def test_counter_reset_is_handled_by_prometheus(tmp_path):
    # good -> broken (restart: counters go down) -> broken grows; rate() must never go negative.
    with (
        MetricsExporter(capture("good")) as exporter,
        PrometheusServer([f"127.0.0.1:{exporter.port}"], tmp_path) as prometheus,
    ):
        prometheus.wait_for_samples("count_over_time(vllm:spec_decode_num_drafts_total[1m])", 3)
        exporter.text = capture("broken")
        prometheus.wait_for_samples("count_over_time(vllm:spec_decode_num_drafts_total[1m])", 6)
        source = PrometheusSource(prometheus.url, window_s=60, server_kind="vllm")
        (observation,) = [o for o in source.poll() if o.counts.num_drafts]
    assert observation.counts.num_drafts > 0
    assert all(v >= 0 for v in observation.counts.num_accepted_tokens_per_pos)


def test_unreachable_prometheus_is_a_clear_exit_2(tmp_path):
    from telemetry_fixtures import free_port

    port = free_port()
    result = CliRunner().invoke(
        app, ["watch", "--prometheus", f"http://127.0.0.1:{port}", "--once", "--out", str(tmp_path / "run")]
    )
    assert (
        result.exit_code == 2
        and f"no answer from http://127.0.0.1:{port}/api/v1/query (Connection refused)" in result.output
    )


def test_a_managed_prometheus_gets_its_headers_from_the_environment_and_no_file_holds_them(tmp_path, monkeypatch):
    token = "glc_doctor_test_token_5b1e"
    monkeypatch.setenv("PROM_TOKEN", token)
    required = {"Authorization": f"Bearer {token}", "X-Scope-OrgID": "tenant-1"}
    window_counts, _ = counts("good").since(counts("good_1"))
    with (
        MetricsExporter(capture("good_1")) as exporter,
        PrometheusServer([f"127.0.0.1:{exporter.port}"], tmp_path) as prometheus,
    ):
        prometheus.wait_for_samples("count_over_time(vllm:spec_decode_num_drafts_total[1m])", 3)
        exporter.text = capture("good")
        prometheus.wait_for_samples("count_over_time(vllm:spec_decode_num_drafts_total[1m])", 6)
        with AuthGateway(prometheus.url, required) as gateway:
            watch = ["watch", "--prometheus", gateway.url, "--window", "60s", "--once", "--min-drafts", "1"]
            refused = CliRunner().invoke(app, [*watch, "--out", str(tmp_path / "refused")])
            result = CliRunner().invoke(
                app,
                [
                    *watch,
                    "--prometheus-header",
                    "Authorization=Bearer $PROM_TOKEN",
                    "--prometheus-header",
                    "X-Scope-OrgID=tenant-1",
                    "--out",
                    str(tmp_path / "run"),
                ],
            )
    assert refused.exit_code == 2 and "HTTP 401" in refused.output and "--prometheus-header" in refused.output
    assert result.exit_code == 0, result.output
    assert read_windows(tmp_path / "run")["mean_acceptance_length"].iloc[0] == pytest.approx(
        window_counts.mean_acceptance_length, rel=1e-6
    )
    holding = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
    assert holding == [], f"the token was written to {holding}"
