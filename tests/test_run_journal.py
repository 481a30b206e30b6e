"""A run directory stays readable while it is written and after the writer is killed.

RunWriter appends every finished request to a journal (Arrow IPC streams) and only writes the Parquet
tables at close; load_run reads the journal of a run that has not closed. The last test kills a real
`dflash-doctor replay` process with SIGKILL mid-run and opens what it left with `report`, `compare`
and the dashboard.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from dflash_doctor.app import RUNS_DIR_ENV
from dflash_doctor.cli import app
from dflash_doctor.models.loading import save_dflash_draft
from dflash_doctor.rundir.load import load_run
from dflash_doctor.rundir.run_record import RunMeta, RunRecord
from dflash_doctor.rundir.writer import JOURNAL_DIR, RunWriter, journal_path, utc_now
from cli_helpers import drafted_inside_the_answer
from fixture_runs import request_rows, write_request
from tiny_models import CLASSES, tiny_dflash, tiny_target, tiny_tokenizer

CONSOLE_SCRIPT = Path(sys.executable).with_name("dflash-doctor")
MAIN = Path(__file__).resolve().parents[1] / "app" / "main.py"
REQUESTS_BEFORE_KILL = 4
REPLAY_TIMEOUT_S = 300


def test_a_run_is_readable_while_it_is_written_and_identical_once_closed(tmp_path):
    run_dir = tmp_path / "run"
    writer = RunWriter(
        run_dir, RunRecord(meta=RunMeta(command="replay", created_at=utc_now()), config={"seed": 0}).to_json()
    )
    assert load_run(run_dir).requests.empty and not load_run(run_dir).complete  # run.json from the start
    write_request(writer, "a")
    write_request(writer, "b", num_steps=4)

    live = load_run(run_dir)
    assert not live.complete
    assert list(live.requests["request_id"]) == ["a", "b"]
    assert len(live.steps) == 7 and len(live.tokens) == 14
    assert live.meta["summary"]["overall"]["num_drafts"] == 7  # computed from the finished requests
    assert live.meta["summary"]["overall"]["mean_acceptance_length"] == pytest.approx(2.0)

    writer.close()
    done = load_run(run_dir)
    assert done.complete and not (run_dir / JOURNAL_DIR).exists()
    assert all((run_dir / f"{name}.parquet").is_file() for name in ("requests", "steps", "tokens"))
    for name in ("requests", "steps", "tokens"):
        assert getattr(done, name).equals(getattr(live, name)), name


def test_rows_of_a_request_cut_short_by_a_kill_are_left_out(tmp_path):
    """A kill can land between a request's steps and its requests row, or inside a record batch."""
    run_dir = tmp_path / "run"
    writer = RunWriter(run_dir, RunRecord(meta=RunMeta(command="replay", created_at=utc_now())).to_json())
    write_request(writer, "a")
    rows = request_rows("b", 2)
    writer.add("steps", rows["steps"])
    writer.add("tokens", rows["tokens"])
    writer.flush()  # b's steps and tokens are in the journal, its requests row is not: b did not finish
    write_request(writer, "c")
    path = journal_path(run_dir, "requests")
    path.write_bytes(path.read_bytes()[:-7])  # c's requests row torn mid-batch, as a kill leaves it

    run = load_run(run_dir)
    assert list(run.requests["request_id"]) == ["a"]
    assert set(run.steps["request_id"]) == {"a"} and set(run.tokens["request_id"]) == {"a"}
    assert run.meta["summary"]["overall"]["num_requests"] == 1


def test_a_reused_folder_starts_empty(tmp_path):
    run_dir = tmp_path / "run"
    with RunWriter(run_dir, RunRecord(meta=RunMeta(command="replay", created_at=utc_now())).to_json()) as writer:
        write_request(writer, "old")
    with RunWriter(run_dir, RunRecord(meta=RunMeta(command="replay", created_at=utc_now())).to_json()):
        pass
    assert load_run(run_dir).requests.empty


# ----------------------------------------------------------------------------------------------------
# A real replay, killed hard


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> Path:
    """A tiny saved target + DFlash draft, and a workload far too long to finish before the kill."""
    root = tmp_path_factory.mktemp("tiny_pair")
    target = tiny_target()
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    save_dflash_draft(tiny_dflash(target, block_size=6), root / "dflash")
    lines = [
        json.dumps(
            {"id": f"{cls}-{i}", "class": cls, "messages": [{"role": "user", "content": f"w{i % 50} w{i % 7} w3 w9"}]}
        )
        for i in range(2000)
        for cls in CLASSES
    ]
    (root / "workload.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def test_a_replay_killed_with_sigkill_keeps_every_finished_request_for_every_view(tiny_pair, tmp_path, monkeypatch):
    run_dir = tmp_path / "runs" / "killed"
    command = [
        str(CONSOLE_SCRIPT),
        "replay",
        "--target",
        str(tiny_pair / "target"),
        "--draft",
        str(tiny_pair / "dflash"),
        "--workload",
        str(tiny_pair / "workload.jsonl"),
        "--max-new-tokens",
        "40",
        "--k",
        "5",
        "--out",
        str(run_dir),
    ]
    log = tmp_path / "replay.log"
    process = subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        deadline = time.monotonic() + REPLAY_TIMEOUT_S
        seen = 0
        while seen < REQUESTS_BEFORE_KILL:
            assert process.poll() is None and time.monotonic() < deadline, f"replay ended or stalled: {log.read_text()}"
            time.sleep(0.2)
            if (run_dir / "run.json").is_file():
                live = load_run(run_dir)  # read while the replay is writing
                assert not live.complete
                seen = len(live.requests)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()

    run = load_run(run_dir)
    assert not run.complete and len(run.requests) >= REQUESTS_BEFORE_KILL
    assert not (run_dir / "requests.parquet").exists()  # nothing was consolidated: the journal is all there is
    finished = set(run.requests["request_id"])
    assert set(run.steps["request_id"]) == finished and set(run.tokens["request_id"]) == finished
    assert run.steps.groupby("request_id").size().to_dict() == dict(
        zip(run.requests["request_id"], run.requests["num_steps"])
    )
    assert len(run.tokens) == drafted_inside_the_answer(run.steps, run.meta["config"]["max_new_tokens"])
    assert run.meta["summary"]["overall"]["num_requests"] == len(run.requests)

    runner = CliRunner()
    report = runner.invoke(app, ["report", str(run_dir), "--format", "md,json,html"])
    assert report.exit_code == 0, report.output
    assert "Incomplete run" in (run_dir / "report.md").read_text()
    assert 'id="incomplete"' in (run_dir / "report.html").read_text()
    payload = json.loads((run_dir / "report.json").read_text())
    assert payload["complete"] is False and payload["summary"]["overall"]["num_requests"] == len(run.requests)

    compared = runner.invoke(app, ["compare", str(run_dir), str(run_dir), "--out", str(tmp_path / "compare")])
    assert compared.exit_code == 0, compared.output
    assert "NEW is an incomplete run" in compared.output

    monkeypatch.setenv(RUNS_DIR_ENV, str(run_dir.parent))
    dashboard = AppTest.from_file(str(MAIN), default_timeout=120)
    dashboard.session_state["run_path"] = str(run_dir)
    dashboard.run()
    assert not dashboard.exception, [e.value for e in dashboard.exception]
    assert any("Incomplete run" in str(w.value) for w in dashboard.warning)
    dashboard.switch_page("views/rejection.py").run()
    assert not dashboard.exception, [e.value for e in dashboard.exception]
