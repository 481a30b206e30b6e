"""A server that answers something impossible: `check --engine` and `tune` refuse it in one sentence (exit 2),
never write it, never crash on it; and what a server measurement keeps when it is cut short.

Each mode of tests/hostile_server.py makes one field of a vLLM answer wrong (a negative, huge, fractional
or non-finite count, unequal per-step arrays, more accepted than drafted, a `usage` of the wrong type...).
Both commands read a server's figures through one function (serving.responses.read_measurement), so each
mode is tried against both. A fuzz test feeds that function seeded random mutations of a good answer.
"""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from dflash_doctor.serving.responses import MAX_COUNT, MalformedResponse, MissingMetrics, read_measurement
from cli_helpers import assert_usage_error, invoke
from hostile_server import HOSTILE, K, answer, hostile_server
from local_servers import free_port
from tune_fixtures import write_sweep_run

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
REFUSED = ("which no engine can report", "but it must be")


def _workload(folder: Path, n: int = 2) -> Path:
    path = folder / "workload.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"r{i}", "class": "chat", "prompt": f"say {i}"}) + "\n" for i in range(n))
    )
    return path


def _check(url: str, tmp_path: Path, *extra: str):
    return invoke(
        "check",
        "--engine",
        url,
        "--workload",
        _workload(tmp_path),
        "--max-new-tokens",
        "16",
        "--out",
        tmp_path / "run",
        *extra,
    )


def _tune(url: str, tmp_path: Path):
    return invoke(
        "tune",
        "--engine",
        f"0={url},2={url}",
        "--k",
        "0,2",
        "--workload",
        _workload(tmp_path),
        "--max-new-tokens",
        "16",
        "--start-timeout",
        "10",
        "--sweep",
        write_sweep_run(tmp_path, [2]),
        "--out",
        tmp_path / "tune",
    )


@pytest.mark.parametrize("mode", HOSTILE)
@pytest.mark.parametrize("command", ["check", "tune"])
def test_an_impossible_answer_is_refused_in_one_sentence(tmp_path, mode, command):
    with hostile_server(mode) as url:
        result = (_check if command == "check" else _tune)(url, tmp_path)
    assert_usage_error(result, f"--engine {url}")
    assert any(fragment in result.output for fragment in REFUSED), result.output
    if command == "check":  # nothing impossible reached the run directory
        requests = pd.read_parquet(tmp_path / "run" / "requests.parquet")
        assert requests.empty, requests


def test_a_good_server_is_measured_and_its_tau_is_possible(tmp_path):
    with hostile_server("good") as url:
        result = _check(url, tmp_path)
    assert result.exit_code in (0, 1), result.output  # 1: a check's finding, not a refusal
    requests = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert len(requests) == 2 and requests["tau"].between(1, K + 1).all()


def test_a_baseline_server_whose_answers_carry_drafts_is_flagged(tmp_path):
    """The K=0 server of the grid answers with speculative figures (it drafts): tune.json says so, from the
    responses alone (this server's /metrics has no counters)."""
    with hostile_server("good") as url:
        result = _tune(url, tmp_path)
    assert result.exit_code == 0, result.output
    servers = json.loads((tmp_path / "tune" / "tune.json").read_text())["servers"]
    assert "the K=0 server drafted tokens" in (servers[0]["warning"] or "")


# ----------------------------------------------------------------------------------------------------
# Fuzz: every mutation of a good answer is either read as possible figures or refused as MalformedResponse

HOSTILE_VALUES = [
    -1,
    -(10**30),
    10**30,
    MAX_COUNT + 1,
    2.5,
    float("nan"),
    float("inf"),
    float("-inf"),
    "7",
    "",
    [],
    {},
    None,
    True,
    [-1],
    [10**30],
    [1.5],
    ["1"],
    [0] * 40,
    [K + 1] * 3,
    [0],
    0,
    1,
    3,
    100,
]
SPEC_FIELDS = [
    "num_spec_tokens",
    "num_spec_steps",
    "num_draft_tokens",
    "num_accepted_draft_tokens",
    "acceptance_histogram",
    "per_step_accepted",
    "per_step_drafted",
]
FUZZ_CASES = 600


def _mutated(rng: random.Random) -> dict:
    spec, usage = answer("good", rng.choice([2, 9, 16]))
    body = {
        "choices": [{"index": 0, "text": "x", "token_ids": [1, 2]}],
        "usage": usage,
        "metrics": {"speculative_decoding": spec},
    }
    for _ in range(rng.randint(1, 3)):
        where = rng.random()
        value = rng.choice(HOSTILE_VALUES)
        if where < 0.75:
            spec[rng.choice(SPEC_FIELDS)] = value
        elif where < 0.9:
            body["usage"] = (
                value if rng.random() < 0.3 else {**usage, rng.choice(["prompt_tokens", "completion_tokens"]): value}
            )
        else:
            body["metrics"] = value if rng.random() < 0.5 else {"speculative_decoding": value}
    return body


def test_fuzzed_answers_are_read_as_possible_figures_or_refused():
    rng = random.Random(49)
    outcomes = {"read": 0, "refused": 0, "missing": 0}
    for _ in range(FUZZ_CASES):
        body = _mutated(rng)
        try:
            m = read_measurement(body)
        except MalformedResponse:
            outcomes["refused"] += 1
            continue
        except MissingMetrics:
            outcomes["missing"] += 1
            continue
        outcomes["read"] += 1
        counts = [
            m.num_drafts,
            m.num_draft_tokens,
            m.num_accepted_tokens,
            m.num_spec_tokens,
            m.num_generated_tokens,
            *(m.per_step_accepted or ()),
            *(m.per_step_drafted or ()),
            *(m.acceptance_histogram or ()),
        ]
        assert all(type(c) is int and 0 <= c <= MAX_COUNT for c in counts if c is not None), (body, m)
        assert m.num_draft_tokens is None or m.num_accepted_tokens <= m.num_draft_tokens, (body, m)
        if m.tau is not None:
            assert math.isfinite(m.tau) and 1.0 <= m.tau <= 1 + (m.num_spec_tokens or MAX_COUNT), (body, m)
        if m.per_step_accepted is not None and m.per_step_drafted is not None:
            assert len(m.per_step_accepted) == len(m.per_step_drafted), (body, m)
            assert all(a <= d for a, d in zip(m.per_step_accepted, m.per_step_drafted)), (body, m)
    assert min(outcomes.values()) > 0, outcomes  # the mutations reach every outcome


# ----------------------------------------------------------------------------------------------------
# --engine-timeout bounds a whole request, a dripping answer included


def test_engine_timeout_cuts_a_dripping_answer(tmp_path):
    with hostile_server("drip") as url:
        result = _check(url, tmp_path, "--engine-timeout", "2", "--max-requests", "1")
    assert_usage_error(result, "still sending after the 2 s deadline")


# ----------------------------------------------------------------------------------------------------
# Credentials in --engine never reach a file or stdout


def test_a_password_in_the_engine_url_is_used_but_never_written(tmp_path):
    secret = "PW-PLANTED-4977"
    log = tmp_path / "server.log"
    with hostile_server("good", log) as url:
        result = invoke(
            "check",
            "--engine",
            url.replace("http://", f"http://alice:{secret}@"),
            "--workload",
            _workload(tmp_path),
            "--max-new-tokens",
            "16",
            "--out",
            tmp_path / "run",
            "--json",
        )
    assert result.exit_code in (0, 1), result.output
    sent = [json.loads(line)["authorization"] for line in log.read_text().splitlines()]
    assert sent and all(a and a.startswith("Basic ") for a in sent)  # the credentials were sent, as basic auth
    assert secret not in result.output
    files = [path for path in (tmp_path / "run").rglob("*") if path.is_file()]
    assert {"run.json", "report.json", "report.html"} <= {path.name for path in files}
    assert [path.name for path in files if secret.encode() in path.read_bytes()] == []


# ----------------------------------------------------------------------------------------------------
# check --engine keeps every answered request however it is stopped


def _rows_kept(run: Path) -> int:
    from dflash_doctor.rundir.load import load_run

    return len(load_run(run).requests)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_a_stopped_server_measurement_keeps_every_answered_request(tmp_path, signum):
    port, log, out = free_port(), tmp_path / "answered.log", tmp_path / "run"
    server = subprocess.Popen(
        [sys.executable, str(TESTS / "hostile_server.py"), "--port", str(port), "--mode", "slow", "--log", str(log)]
    )
    check = None
    try:
        check = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dflash_doctor",
                "check",
                "--engine",
                f"http://127.0.0.1:{port}",
                "--workload",
                str(_workload(tmp_path, 8)),
                "--max-requests",
                "8",
                "--max-new-tokens",
                "16",
                "--engine-concurrency",
                "1",
                "--out",
                str(out),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 120
        while not log.is_file() or len(log.read_text().splitlines()) < 3:
            assert check.poll() is None, check.communicate()
            assert time.monotonic() < deadline, "the server never answered three requests"
            time.sleep(0.05)
        time.sleep(0.4)  # between two answers (each takes 1 s): the last one's rows are journaled by now
        check.send_signal(signum)
        answered = len(log.read_text().splitlines())  # the request in flight may be answered later, to no one
        check.communicate(timeout=60)
    finally:
        if check is not None and check.poll() is None:
            check.kill()
        server.kill()
        server.wait()
    assert check.returncode == (-signum if signum == signal.SIGKILL else 128 + signum)
    assert answered >= 3 and _rows_kept(out) == answered
    report = invoke("report", out)
    assert report.exit_code == 0, report.output
    assert f"{answered} finished request(s) recorded" in (out / "report.md").read_text()
