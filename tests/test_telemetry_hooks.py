"""`watch --on-alert` / `--on-alert-webhook`: the operator's command and webhook fire once per alert episode.

Verdicts come from the real Judge on counts read from captured real vLLM metric text (``broken`` = the
same server with the draft's target layers shifted, a real acceptance drop). The hook is a real
subprocess that appends its environment to a file; the webhook a real HTTP server in a thread.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.telemetry.counts import SeriesKey, SpecCounts
from dflash_doctor.telemetry.server_metrics import read_exposition
from dflash_doctor.telemetry.exposition import parse_exposition
from dflash_doctor.telemetry.hooks import AlertHooks
from dflash_doctor.telemetry.verdict import Baseline, Judge, Thresholds, WindowVerdict
from dflash_doctor.telemetry.watcher import Window
from local_servers import QuietHandler, ThreadedServer
from telemetry_fixtures import DATA, MetricsExporter

MODEL = SeriesKey("smollm2-dflash")
HOOK_SCRIPT = """import json, os, sys
with open(sys.argv[1], "a") as out:
    out.write(json.dumps({k: v for k, v in os.environ.items() if k.startswith("DFLASH_DOCTOR_")}) + "\\n")
"""


def capture(name: str) -> str:
    return (DATA / f"vllm_metrics_{name}.txt").read_text()


def counts_of(name: str) -> SpecCounts:
    return read_exposition(parse_exposition(capture(name)), server_kind="vllm", default_model="x").counts[MODEL]


def hook_command(tmp_path: Path) -> tuple[str, Path]:
    script, record = tmp_path / "hook.py", tmp_path / "fired.jsonl"
    script.write_text(HOOK_SCRIPT)
    return f"{sys.executable} {script} {record}", record


def episode_sequence() -> list[WindowVerdict]:
    """drop, drop, idle, drop (one episode: idle carries no verdict), ok, drop (a second episode)."""
    good = counts_of("good")
    judge = Judge(
        Baseline.fixed({"overall": good.mean_acceptance_length}), Thresholds(min_drafts=1), server_kind="vllm"
    )
    windows = ["broken", "broken", None, "broken", "good", "broken"]
    verdicts = []
    for i, name in enumerate(windows):
        counts = counts_of(name) if name else SpecCounts(num_generated_tokens=0.0)
        verdicts.append(judge.judge(Window(MODEL, 10.0 * i, 10.0 * (i + 1), counts, [counts])))
    assert [v.status for v in verdicts] == ["alert", "alert", "idle", "alert", "ok", "alert"]
    return verdicts


def test_command_fires_once_per_episode_with_the_alert_in_its_environment(tmp_path):
    command, record = hook_command(tmp_path)
    hooks = AlertHooks(command, run_dir=tmp_path / "run")
    started = [event for verdict in episode_sequence() for event in hooks.handle([verdict], "vllm")]
    finished = hooks.close()
    assert [e.message.split(" (pid")[0] for e in started] == ["started for acceptance-drop on smollm2-dflash [all]"] * 2
    assert [e.message for e in finished] == ["for acceptance-drop on smollm2-dflash [all] exited with status 0"] * 2
    fired = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(fired) == 2
    env = {k: v for k, v in fired[0].items() if k not in os.environ}  # what the hook set, not what it inherited
    assert env["DFLASH_DOCTOR_ALERT"] == "acceptance-drop" and env["DFLASH_DOCTOR_MODEL"] == "smollm2-dflash"
    assert env["DFLASH_DOCTOR_ENGINE"] == "vllm" and env["DFLASH_DOCTOR_K"] == "15"
    assert "num_speculative_tokens_per_batch_size" in env["DFLASH_DOCTOR_ADVICE"]  # the exact vLLM change
    assert float(env["DFLASH_DOCTOR_TAU"]) < float(env["DFLASH_DOCTOR_BASELINE_TAU"])
    as_json = json.loads(env.pop("DFLASH_DOCTOR_ALERT_JSON"))
    assert as_json == env


def test_dry_run_runs_nothing_and_says_what_it_would_run(tmp_path):
    command, record = hook_command(tmp_path)
    hooks = AlertHooks(command, dry_run=True, run_dir=tmp_path)
    events = [event for verdict in episode_sequence() for event in hooks.handle([verdict], "vllm")]
    hooks.close()
    assert not record.exists()
    assert len(events) == 2
    assert all(
        e.message.startswith(
            "dry run, would run for acceptance-drop on smollm2-dflash [all]: DFLASH_DOCTOR_ALERT=acceptance-drop"
        )
        for e in events
    )


def test_webhook_receives_one_post_per_episode(tmp_path):
    received: list[dict] = []

    class Handler(QuietHandler):
        def do_POST(self):  # noqa: N802 (http.server API)
            received.append(self.read_json())
            self.reply(204)

    with ThreadedServer(Handler) as server:
        hooks = AlertHooks(webhook=f"{server.base_url}/alert", run_dir=tmp_path)
        events = [event for verdict in episode_sequence() for event in hooks.handle([verdict], "vllm")]
    assert [e.message for e in events] == ["posted acceptance-drop on smollm2-dflash [all] (HTTP 204)"] * 2
    assert len(received) == 2 and received[0]["DFLASH_DOCTOR_ALERT"] == "acceptance-drop"


def test_watch_once_runs_the_hook_and_checks_its_flags(tmp_path):
    command, record = hook_command(tmp_path)
    runner = CliRunner()
    baseline = f"{counts_of('good').mean_acceptance_length:.4f}"
    with MetricsExporter(capture("broken")) as exporter:
        result = runner.invoke(
            app,
            [
                "watch",
                exporter.url,
                "--once",
                "--baseline",
                baseline,
                "--min-drafts",
                "20",
                "--on-alert",
                command,
                "--out",
                str(tmp_path / "run"),
            ],
        )
    assert result.exit_code == 1, result.output
    assert "alert-hook:" in result.output and "exited with status 0" in result.output
    (fired,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert fired["DFLASH_DOCTOR_RUN_DIR"] == str(tmp_path / "run")
    bad = runner.invoke(
        app, ["watch", str(DATA / "vllm_server_good.log"), "--once", "--on-alert-webhook", "ftp://alerts"]
    )
    assert bad.exit_code == 2 and "--on-alert-webhook 'ftp://alerts' is not an http(s) URL" in bad.output
