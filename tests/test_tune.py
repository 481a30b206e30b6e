"""`tune`: the measuring, fitting and recommending logic against fake engines on 127.0.0.1 with known costs
(tests/fake_spec_engine.py), and the fit on exact synthetic requests. The real vLLM run is test_tune_vllm.py."""

from __future__ import annotations

import json
import math
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from dflash_doctor.app import RUNS_DIR_ENV
from dflash_doctor.cli import app
from dflash_doctor.stats.speedup import load_cost_profile
from dflash_doctor.models.kind_serving import EAGLE3, NGRAM
from dflash_doctor.tune.advice import batch_ranges, settings_per_server, recommend_grid
from dflash_doctor.tune.analysis import analyse, cell
from dflash_doctor.inputs.config import build_config
from dflash_doctor.inputs.workloads import load_workload
from dflash_doctor.serving.client import ServerEndpoint, resolve_model
from dflash_doctor.tune.experiment import redact
from dflash_doctor.tune.loads import CONCURRENCY, REQUEST_RATE, LoadLevel, arrival_offsets
from dflash_doctor.tune.measure import first_turns, run_load
from dflash_doctor.tune.prediction import fit_costs, predict

import fake_spec_engine as fake
from tune_fixtures import MAX_TOKENS, PROMPTS, expected_tau, write_sweep_run, write_workload

TESTS = Path(__file__).resolve().parent
TIMING_TOLERANCE = 0.35  # relative, for figures timed from the fake engine's sleeps


def _invoke(args: list[str]):
    return CliRunner().invoke(app, ["tune", *args])


def test_fit_recovers_the_step_costs_and_predicts_a_held_out_k_exactly():
    """Requests built from step(K) = t_decode + t_draft + slope K: the fit from K = 2, 4 returns those
    costs and predicts K = 8's speedup and tau with no error."""
    t_decode, t_draft, slope = 0.010, 0.003, 0.0015
    rows = []
    for k in (0, 2, 4, 8):
        for i, (cls, accept) in enumerate((("math", 3), ("chat", 1)) * 3):
            a, steps = min(k, accept), 30  # K = 0: 30 plain decode steps of one token each
            decode = steps * (t_decode + (t_draft + slope * k if k else 0.0))
            rows.append(
                {
                    "k": k,
                    "concurrency": 1,
                    "request_id": f"r{i}",
                    "class": cls,
                    "prompt_num_tokens": 5,
                    "num_output_tokens": 1 + steps * (a + 1),
                    "ttft_s": 0.05,
                    "e2e_s": 0.05 + decode,
                    "decode_s": decode,
                    "tpot_s": None,
                    "num_drafts": steps if k else None,
                    "num_draft_tokens": steps * k if k else None,
                    "num_accepted_tokens": steps * a if k else None,
                }
            )
    frame = pd.DataFrame(rows)
    throughput = {(k, 1): {"output_tokens_per_s": 1.0, "requests_per_s": 1.0} for k in (0, 2, 4, 8)}
    cells = analyse(frame, throughput, seed=0)
    fitted = fit_costs(cells, 1, (2, 4))
    assert fitted is not None
    assert fitted.t_decode_s == pytest.approx(t_decode)
    assert fitted.t_draft_s == pytest.approx(t_draft)
    assert fitted.verify_slope_s == pytest.approx(slope)
    taus = {
        scope: {k: (c["tau"], c["tau_ci"]) for k in (2, 4, 8) if (c := cell(cells, 1, k, scope))}
        for scope in ("overall", "math", "chat")
    }
    prediction = predict(cells, {1: fitted}, taus)
    held = [p for p in prediction if p["k"] == 8]
    assert {p["scope"] for p in held} == {"overall", "math", "chat"} and all(p["held_out"] for p in held)
    for p in prediction:
        assert p["speedup_relative_error"] == pytest.approx(0.0, abs=1e-9)
        assert p["predicted_pays"] == p["measured_pays"] is not None
    math8 = cell(cells, 1, 8, "math")
    assert math8["tau"] == pytest.approx(4.0)
    assert math8["rollback_per_token"] == pytest.approx(30 * 5 / (1 + 30 * 4))


def test_a_verify_cost_falling_with_k_is_fitted_flat():
    """Noise can make step(4) < step(2); verifying more tokens never costs less, so the fit holds the slope at 0."""
    cells = [
        {"concurrency": 1, "k": 0, "scope": "overall", "tpot_s": 0.010},
        {"concurrency": 1, "k": 2, "scope": "overall", "step_s": 0.020},
        {"concurrency": 1, "k": 4, "scope": "overall", "step_s": 0.016},
    ]
    fitted = fit_costs(cells, 1, (2, 4))
    assert fitted is not None and fitted.verify_slope_s == 0.0
    assert fitted.step_s(8) == pytest.approx(0.018) and "taken as flat" in fitted.note


def test_a_k_whose_speedup_interval_reaches_below_1_is_not_recommended():
    def measured(k: int, speedup: float, low: float, high: float) -> dict:
        return {
            "concurrency": 1,
            "k": k,
            "scope": "overall",
            "tau": 2.0,
            "tau_ci": [1.8, 2.2],
            "speedup": speedup,
            "speedup_ci": [low, high],
        }

    coin_toss = recommend_grid([measured(2, 1.05, 0.90, 1.25), measured(4, 0.94, 0.79, 1.17)])["1"]["overall"]
    assert coin_toss["k"] == 0 and "K=2, ran at 1.05x [0.90, 1.25]" in coin_toss["reason"]
    shown = recommend_grid([measured(2, 1.20, 1.05, 1.35), measured(4, 1.30, 0.95, 1.60)])["1"]["overall"]
    assert shown["k"] == 2  # K=4 measured faster, but only K=2 is shown to pay


def test_a_launch_command_is_recorded_without_its_secrets():
    command = "HF_TOKEN=hf_abc vllm serve t --api-key sk-123 --port 8000 --hf-token=hf_x --speculative-config '{}'"
    assert (
        redact(command)
        == "HF_TOKEN=*** vllm serve t --api-key *** --port 8000 --hf-token=*** --speculative-config '{}'"
    )


def test_vllm_setting_per_batch_size_and_speculation_off():
    def picks(k_by_load: dict[int, int]) -> dict:
        return {str(load): {"overall": {"k": k}} for load, k in k_by_load.items()}

    assert batch_ranges({1: 4, 8: 2, 32: 0}) == [[1, 1, 4], [2, 8, 2], [9, 32, 0]]
    mixed = settings_per_server(picks({1: 4, 8: 0}))
    spec = json.loads(mixed["vllm"].split("'")[1])
    assert spec["num_speculative_tokens"] == 4 and spec["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 4],
        [2, 8, 0],
    ]
    assert '"num_speculative_tokens": 3' in settings_per_server(picks({1: 3, 4: 3}))["vllm"]
    one = settings_per_server(picks({1: 3}))
    assert json.loads(one["vllm"].split("'")[1]) == {"method": "dflash", "model": "DRAFT", "num_speculative_tokens": 3}
    assert one["sglang"].endswith("--speculative-num-draft-tokens 4") and "DFLASH" in one["sglang"]
    assert one["llama.cpp"] == "-md DRAFT.gguf --spec-type draft-dflash --spec-draft-n-max 3"
    assert settings_per_server(picks({1: 0, 4: 0}))["vllm"].startswith("speculation off")
    by_rate = settings_per_server({"2": {"overall": {"k": 4}}, "inf": {"overall": {"k": 2}}}, kind=REQUEST_RATE)["vllm"]
    assert by_rate.startswith("K differs by load (request rate 2/s: K=4, request rate inf (all at once): K=2)")
    assert "keys on batch size, not arrival rate" in by_rate and "--speculative-config" not in by_rate


def test_tune_settings_follow_the_draft_kinds_serving():
    """An n-gram speculator has no checkpoint: its vLLM config names no "model", and the engines that do not
    serve it say so instead of printing DFlash flags."""
    ngram = settings_per_server({"1": {"overall": {"k": 4}}, "8": {"overall": {"k": 2}}}, NGRAM)
    spec = json.loads(ngram["vllm"].split("'")[1])
    assert spec["method"] == "ngram" and "model" not in spec and spec["num_speculative_tokens"] == 4
    assert ngram["sglang"].startswith("not named for a ngram speculator here: serve it with vLLM")
    eagle3 = settings_per_server({"1": {"overall": {"k": 3}}}, EAGLE3)
    assert "--speculative-num-steps 3" in eagle3["sglang"] and "not named for a eagle3" in eagle3["llama.cpp"]


@pytest.fixture
def fake_servers():
    costs = fake.FakeCosts()
    servers = {k: fake.start(k, costs) for k in (0, 2, 4, 8)}
    yield {k: f"http://127.0.0.1:{s.server_address[1]}" for k, s in servers.items()}, costs
    for server in servers.values():
        server.shutdown()


def test_tune_measures_fake_engines_fits_their_costs_and_recommends(tmp_path, fake_servers, monkeypatch):
    urls, costs = fake_servers
    out = tmp_path / "run"
    result = _invoke(
        [
            "--engine",
            ",".join(f"{k}={u}" for k, u in urls.items()),
            "--k",
            "0,2,4,8",
            "--concurrency",
            "1,2",
            "--workload",
            str(write_workload(tmp_path)),
            "--max-new-tokens",
            str(MAX_TOKENS),
            "--sweep",
            str(write_sweep_run(tmp_path, [2, 4, 8])),
            "--out",
            str(out),
        ]
    )
    assert result.exit_code == 0, result.output
    tune = json.loads((out / "tune.json").read_text())
    for name in (
        "requests.parquet",
        "report.md",
        "report.html",
        "cost-profile-c1.json",
        "cost-profile-c2.json",
        "workload.jsonl",
    ):
        assert (out / name).is_file(), name
    requests = pd.read_parquet(out / "requests.parquet")
    assert len(requests) == (4 + 1) * 2 * len(PROMPTS)  # the baseline is measured again after the grid
    assert set(requests[requests["repeat"] == 1]["k"]) == {0}
    assert set(tune["baseline_drift"]) == {"1", "2"} and all(
        abs(d) < TIMING_TOLERANCE for d in tune["baseline_drift"].values()
    )

    cells = tune["cells"]
    for k in (2, 4, 8):
        for scope in ("overall", "math", "chat"):
            measured = cell(cells, 1, k, scope)
            assert measured["tau"] == pytest.approx(expected_tau(scope, k))  # the engine's own counts, exact
        math = cell(cells, 1, k, "math")
        steps = [fake.per_step_accepted(t, k, MAX_TOKENS) for c, t in PROMPTS.values() if c == "math"]
        wasted = sum(k * len(s) - sum(s) for s in steps)
        assert math["rollback_per_token"] == pytest.approx(wasted / (2 * MAX_TOKENS))
    # timings: TPOT at K = 0 is the decode step, the step time at K its cost. Sleeps overshoot, more so on a
    # busy machine; TIMING_TOLERANCE is below the errors these lines are for (per step instead of per token:
    # x tau, 2-4 here; a step time from the wrong K or without the draft: x1.3 and more)
    assert cell(cells, 1, 0)["tpot_s"] == pytest.approx(costs.decode_s, rel=TIMING_TOLERANCE)
    assert cell(cells, 1, 8)["step_s"] == pytest.approx(costs.step_s(8), rel=TIMING_TOLERANCE)
    expected_math4 = expected_tau("math", 4) * costs.decode_s / costs.step_s(4)
    assert cell(cells, 1, 4, "math")["speedup"] == pytest.approx(expected_math4, rel=TIMING_TOLERANCE)

    fitted = tune["fits"]["1"]
    assert fitted["fit_ks"] == [2, 4]
    held = [p for p in tune["prediction"] if p["held_out"] and p["concurrency"] == 1]
    assert {p["scope"] for p in held} == {"overall", "math", "chat"} and {p["k"] for p in held} == {8}
    for p in held:
        assert abs(p["speedup_relative_error"]) < TIMING_TOLERANCE, p

    picks = tune["recommendation"]["1"]
    # step(K) = 40 ms + 3 ms K against a 20 ms decode step: math (tau 3 at K=2, 4 from K=3) pays best at K=4
    # (1.54x; K=2 1.30x, K=8 1.25x); chat (tau 2) never pays (0.87x at K=2)
    assert picks["math"]["k"] == 4
    assert picks["chat"]["k"] == 0 and picks["chat"]["reason"].startswith("Speculation off")
    profile = load_cost_profile(out / "cost-profile-c1.json")
    assert profile.speedup(4.0, 8) == pytest.approx(
        4.0 * fitted["t_decode_s"] / (fitted["t_decode_s"] + fitted["t_draft_s"] + 8 * fitted["verify_slope_s"])
    )
    report = (out / "report.md").read_text()
    assert "held out" in report and "vllm: " in report and "--speculative-config" in report
    assert (out / "report.html").read_text().count('class="plotly-graph-div"') == 3

    dashboard = _dashboard_tune_page(monkeypatch, tmp_path)
    assert len(list(dashboard.get("plotly_chart"))) == 3
    assert any(
        "--speculative-config" in str(block.value) for block in dashboard.code
    )  # engine settings shown as code, never as Markdown


def _dashboard_tune_page(monkeypatch, runs_dir: Path) -> AppTest:
    """The dashboard's Tune page on ``runs_dir`` (Streamlit's AppTest: no browser, no server)."""
    monkeypatch.setenv(RUNS_DIR_ENV, str(runs_dir))
    at = AppTest.from_file(str(TESTS.parent / "app" / "main.py"), default_timeout=60)
    at.run()
    at.switch_page("views/tune.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_tune_reads_overall_acceptance_from_metrics_counters_without_per_request_figures(tmp_path):
    """A server started without per-request metrics: overall tau, rollback and step time come from its
    /metrics deltas over each run (exact); classes have timings but no tau."""
    servers = {k: fake.start(k, per_request=False) for k in (0, 4)}
    try:
        engine = ",".join(f"{k}=http://127.0.0.1:{s.server_address[1]}" for k, s in servers.items())
        out = tmp_path / "run"
        result = _invoke(
            [
                "--engine",
                engine,
                "--k",
                "0,4",
                "--workload",
                str(write_workload(tmp_path)),
                "--max-new-tokens",
                str(MAX_TOKENS),
                "--sweep",
                str(write_sweep_run(tmp_path, [4])),
                "--out",
                str(out),
            ]
        )
    finally:
        for server in servers.values():
            server.shutdown()
    assert result.exit_code == 0, result.output
    tune = json.loads((out / "tune.json").read_text())
    overall = cell(tune["cells"], 1, 4)
    assert (
        overall["tau"] == pytest.approx(expected_tau("overall", 4))
        and overall["acceptance_from"] == "/metrics counter deltas"
    )
    assert cell(tune["cells"], 1, 4, "math").get("tau") is None
    assert tune["servers"][1]["acceptance_from"].startswith("/metrics counter deltas")


def _port_closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_tune_launches_each_k_and_stops_its_process_group(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = f"{sys.executable} {TESTS / 'fake_spec_engine.py'} --port {port} --k"
    out = tmp_path / "run"
    result = _invoke(
        [
            "--launch",
            command + " {k}",
            "--launch-baseline",
            command + " 0",
            "--engine",
            f"http://127.0.0.1:{port}",
            "--k",
            "0,2",
            "--workload",
            str(write_workload(tmp_path)),
            "--max-new-tokens",
            "8",
            "--start-timeout",
            "60",
            "--sweep",
            str(write_sweep_run(tmp_path, [2])),
            "--out",
            str(out),
        ]
    )
    assert result.exit_code == 0, result.output
    tune = json.loads((out / "tune.json").read_text())
    assert [(s["launched"], s["repeat"]) for s in tune["servers"]] == [
        (command + " 0", 0),
        (command + " 2", 0),
        (command + " 0", 1),
    ]
    assert tune["servers"][1]["engine_num_spec_tokens"] == [2]
    assert "verification taken as flat" in tune["fits"]["1"]["note"]
    assert tune["held_out_error"] is None and "no held-out K" in (out / "report.md").read_text()
    assert _port_closed(port)  # the last launched server's process group was stopped


@pytest.mark.parametrize(
    "args, says",
    [
        (["--launch", "serve --k 4", "--engine", "http://127.0.0.1:1"], "has no {k} placeholder"),
        (["--launch", "serve {k}", "--engine", "http://127.0.0.1:1", "--k", "0,2"], "--launch-baseline is missing"),
        (["--engine", "0=http://127.0.0.1:1", "--k", "0,2"], "names no server for K [2]"),
        (["--engine", "http://127.0.0.1:1", "--k", "0,2"], "one running server per K"),
        (["--engine", "0=http://127.0.0.1:1", "--k", "0,x"], "is not an integer, a list like 2,4,8"),
        (
            ["--engine", "0=http://127.0.0.1:1", "--k", "8-4"],
            "--k '8-4' is not an integer, a list like 2,4,8 or a range like 1-15",
        ),
        (
            ["--engine", "0=http://127.0.0.1:1,2=http://127.0.0.1:1", "--k", "0,2", "--fit-k", "4"],
            "names K that --k 0,2 does not measure",
        ),
        (
            ["--engine", "0=http://127.0.0.1:1", "--k", "0", "--concurrency", "0"],
            "--concurrency '0' must hold integers >= 1",
        ),
        (
            ["--engine", "0=http://127.0.0.1:1", "--k", "0", "--concurrency", "2", "--request-rate", "2"],
            "two ways to load the server; give one",
        ),
        (
            ["--engine", "0=http://127.0.0.1:1", "--k", "0", "--request-rate", "2,0"],
            "--request-rate '2,0' must be requests per second above 0",
        ),
        (
            ["--engine", "0=http://127.0.0.1:1", "--k", "0", "--request-rate", "-1"],
            "--request-rate '-1' must be requests per second above 0",
        ),
        (
            ["--engine", "0=http://127.0.0.1:1", "--k", "0", "--request-rate", "fast"],
            "--request-rate 'fast' must be requests per second above 0",
        ),
        (
            ["--engine", "0=http://127.0.0.1:1", "--k", "0", "--request-rate", "2", "--burstiness", "0"],
            "--burstiness 0.0 must be above 0",
        ),
        (
            ["--engine", "0=http://127.0.0.1:1", "--k", "0", "--concurrency", "2", "--burstiness", "0.5"],
            "give --request-rate too, or drop --burstiness",
        ),
        (
            ["--engine", "0=http://127.0.0.1:1", "--k", "0", "--max-concurrency", "2"],
            "give --request-rate too, or drop --max-concurrency",
        ),
        (
            ["--engine", "0=http://127.0.0.1:1", "--k", "0", "--request-rate", "2", "--max-concurrency", "0"],
            "--max-concurrency 0 must be 1 or more",
        ),
    ],
)
def test_bad_tune_input_is_one_sentence_and_exit_2(args, says):
    result = _invoke(args)
    assert result.exit_code == 2
    assert says in result.output and "Traceback" not in result.output


def _gaps(offsets: list[float]) -> np.ndarray:
    return np.diff([0.0, *offsets])


def test_the_arrival_schedule_is_seeded_with_mean_gap_1_over_rate_and_burstiness_sets_its_spread():
    """vLLM's schedule: gamma gaps of shape = burstiness and mean 1 / rate (coefficient of variation
    1 / sqrt(burstiness): 1 for Poisson), the same offsets for the same seed; rate inf sends all at 0."""
    poisson = arrival_offsets(4000, 4.0, 1.0, seed=3)
    assert poisson == arrival_offsets(4000, 4.0, 1.0, seed=3) and poisson != arrival_offsets(4000, 4.0, 1.0, seed=4)
    assert all(b > a for a, b in zip(poisson, poisson[1:]))
    for seed in range(5):
        gaps = _gaps(arrival_offsets(4000, 4.0, 1.0, seed=seed))
        assert gaps.mean() == pytest.approx(0.25, rel=1e-9)  # scaled so the last arrival is at n / rate
        assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)
        assert (gaps < 0.25).mean() == pytest.approx(1 - math.exp(-1), abs=0.03)  # exponential: P(gap < mean) = 1 - 1/e
    for burstiness in (0.25, 4.0):
        gaps = _gaps(arrival_offsets(4000, 4.0, burstiness, seed=0))
        assert gaps.mean() == pytest.approx(0.25, rel=1e-9)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    assert arrival_offsets(5, math.inf, 1.0, seed=0) == [0.0] * 5
    assert LoadLevel(CONCURRENCY, 3).arrival_offsets(5, seed=0) == [0.0] * 5


def test_an_open_loop_sends_each_request_at_its_offset_while_earlier_ones_are_in_flight(tmp_path):
    """The fake engine records when each request arrives: at a request rate they arrive at the schedule's
    offsets although each takes ~0.5 s and the next is due ~0.12 s later; at concurrency 1, and at the rate
    capped by max_concurrency 1, each waits for the previous answer."""
    prompts = [f"chat: item {i}" for i in range(8)]
    workload = tmp_path / "w.jsonl"
    workload.write_text(
        "".join(json.dumps({"id": f"r{i}", "class": "chat", "prompt": p}) + "\n" for i, p in enumerate(prompts))
    )
    requests = first_turns(load_workload(str(workload)))
    config = build_config(max_new_tokens=MAX_TOKENS, seed=7)
    arrivals: list[tuple[str, float]] = []
    server = fake.start(0, arrivals=arrivals)
    try:
        endpoint = resolve_model(ServerEndpoint.from_url(f"http://127.0.0.1:{server.server_address[1]}"))
        rate = LoadLevel(REQUEST_RATE, 8.0)
        open_run = run_load(endpoint, requests, config, k=0, load=rate)
        open_arrivals = dict(arrivals)
        arrivals.clear()
        closed_run = run_load(endpoint, requests, config, k=0, load=LoadLevel(CONCURRENCY, 1))
        closed_arrivals = dict(arrivals)
        arrivals.clear()
        run_load(endpoint, requests, config, k=0, load=LoadLevel(REQUEST_RATE, 8.0, max_concurrency=1))
        capped_arrivals = dict(arrivals)
    finally:
        server.shutdown()
    offsets = dict(zip(prompts, rate.arrival_offsets(len(prompts), seed=7)))
    first = min(offsets, key=offsets.__getitem__)
    for prompt, offset in offsets.items():
        # 0.15 s: thread wake-ups on a busy shared machine; waiting for earlier answers would put the last ~3 s late
        assert open_arrivals[prompt] - open_arrivals[first] == pytest.approx(offset - offsets[first], abs=0.15), prompt
    e2e = min(r.e2e_s for r in open_run.requests)
    assert (
        e2e > 0.4 and max(open_arrivals.values()) - min(open_arrivals.values()) < 2 * e2e
    )  # eight ~0.5 s requests overlapped
    for waited in (closed_arrivals, capped_arrivals):  # --max-concurrency 1: a due arrival waits for the slot
        by_start = sorted(waited.values())
        assert all(later - earlier >= 0.9 * e2e for earlier, later in zip(by_start, by_start[1:]))
    assert open_run.wall_s < closed_run.wall_s / 2


def test_tune_at_two_request_rates_names_the_rates_everywhere(tmp_path, fake_servers, monkeypatch):
    urls, _ = fake_servers
    out = tmp_path / "run"
    result = _invoke(
        [
            "--engine",
            ",".join(f"{k}={urls[k]}" for k in (0, 2, 4)),
            "--k",
            "0,2,4",
            "--request-rate",
            "inf,4",
            "--workload",
            str(write_workload(tmp_path)),
            "--max-new-tokens",
            str(MAX_TOKENS),
            "--sweep",
            str(write_sweep_run(tmp_path, [2, 4])),
            "--out",
            str(out),
        ]
    )
    assert result.exit_code == 0, result.output
    tune = json.loads((out / "tune.json").read_text())
    assert tune["grid"]["loads"] == [4.0, "inf"] and tune["grid"]["burstiness"] == 1.0
    assert all("concurrency" not in c for c in tune["cells"]) and {c["request_rate"] for c in tune["cells"]} == {
        4.0,
        "inf",
    }
    requests = pd.read_parquet(out / "requests.parquet")
    assert set(requests["request_rate"]) == {4.0, math.inf} and "concurrency" not in requests
    for rate in (4.0, "inf"):
        assert cell(tune["cells"], rate, 2, "math")["tau"] == pytest.approx(
            expected_tau("math", 2)
        )  # the engine's counts, at any timing
    assert set(tune["recommendation"]) == set(tune["fits"]) == set(tune["baseline_drift"]) == {"4", "inf"}
    assert tune["cost_profiles"] == {"4": "cost-profile-r4.json", "inf": "cost-profile-rinf.json"}
    assert "at request rate 4/s from K 2, 4" in json.loads((out / "cost-profile-r4.json").read_text())["notes"]
    report = (out / "report.md").read_text()
    assert (
        "request rate 4, inf per second (open loop: gamma arrivals of burstiness 1.00, 1 = Poisson; "
        "no cap on requests in flight)" in report
    )
    assert "- request rate 4/s, overall: " in report and "- request rate inf (all at once), overall: " in report
    assert "concurrency" not in report.replace("--concurrency", "")
    dashboard = _dashboard_tune_page(monkeypatch, tmp_path)
    assert len(list(dashboard.get("plotly_chart"))) == 3
    assert any("request rate 4, inf per second" in str(c.value) for c in dashboard.caption)


def test_tune_sends_the_api_key_to_servers_started_with_one_and_says_how_when_it_is_missing(tmp_path):
    """Servers started with --api-key (vLLM guards /v1 and /metrics with it): the key reaches the health poll,
    the model lookup, every streamed request and the /metrics scrapes; without it tune stops at once, in one
    sentence naming the flag, instead of waiting out --start-timeout."""
    key = "sk-tune-test-5e1d"
    servers = {k: fake.start(k, per_request=False, api_key=key) for k in (0, 4)}
    try:
        engine = ",".join(f"{k}=http://127.0.0.1:{s.server_address[1]}" for k, s in servers.items())
        args = [
            "--engine",
            engine,
            "--k",
            "0,4",
            "--workload",
            str(write_workload(tmp_path)),
            "--max-new-tokens",
            str(MAX_TOKENS),
            "--sweep",
            str(write_sweep_run(tmp_path, [4])),
            "--start-timeout",
            "60",
        ]
        started = time.monotonic()
        refused = _invoke([*args, "--out", str(tmp_path / "refused")])
        refused_after = time.monotonic() - started
        keyed = _invoke([*args, "--out", str(tmp_path / "run"), "--engine-api-key", key])
    finally:
        for server in servers.values():
            server.shutdown()
    assert refused.exit_code == 2, refused.output
    assert "HTTP 401" in refused.output and "--engine-api-key" in refused.output and "Traceback" not in refused.output
    assert keyed.exit_code == 0, keyed.output
    tune = json.loads((tmp_path / "run" / "tune.json").read_text())
    assert cell(tune["cells"], 1, 4)["tau"] == pytest.approx(expected_tau("overall", 4))  # /metrics read with the key
    assert key not in (tmp_path / "run" / "tune.json").read_text()
    assert refused_after < 30, refused_after  # refused at the first health poll, not after --start-timeout


def test_a_baseline_server_that_drafts_is_warned_about_in_every_view(tmp_path, fake_servers, monkeypatch):
    """K = 0 pointed at a speculating server (a launch-baseline left with its draft): its speedups are
    meaningless, and the warning reaches the terminal, report.md, report.html and the dashboard page."""
    urls, _ = fake_servers
    out = tmp_path / "run"
    result = _invoke(
        [
            "--engine",
            f"0={urls[4]},4={urls[4]}",
            "--k",
            "0,4",
            "--workload",
            str(write_workload(tmp_path)),
            "--max-new-tokens",
            str(MAX_TOKENS),
            "--sweep",
            str(write_sweep_run(tmp_path, [4])),
            "--out",
            str(out),
        ]
    )
    assert result.exit_code == 0, result.output
    says = "K=0: the K=0 server drafted tokens"
    assert says in " ".join(result.output.split())
    assert says in (out / "report.md").read_text() and says in (out / "report.html").read_text()
    dashboard = _dashboard_tune_page(monkeypatch, tmp_path)
    assert any(says in str(w.value) for w in dashboard.warning)
