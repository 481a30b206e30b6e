"""Regression cases of the run's reliability: runs that cannot clobber each other, every finished request journaled
as it finishes, the lossless check's dtype rule, and refusals with a non-zero exit where there is
nothing to judge. Each test failed before its fix."""

from __future__ import annotations

import io
import json
import os
import xml.etree.ElementTree as ET
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from dflash_doctor.app import RUNS_DIR_ENV
from dflash_doctor.checks import CheckContext, run_checks
from dflash_doctor.checks.lossless import rounding_at
from dflash_doctor.cli import app
from dflash_doctor.engine.live import GenerationResult, plain_generate
from dflash_doctor.inputs.config import build_config
from dflash_doctor.inputs.workloads import load_workload
from dflash_doctor.models.pair import load_pair
from dflash_doctor.replay import probes
from dflash_doctor.replay.probes import lossless_probe
from dflash_doctor.replay.turns import Turn, first_turn_prompt
from dflash_doctor.rundir.run_record import Divergence, LosslessProbe, Probes, RunMeta, RunRecord
from dflash_doctor.rundir.writer import RunWriter, utc_now
from dflash_doctor.models.loading import save_dflash_draft
from dflash_doctor.report import render_reports
from dflash_doctor.report.terminal import print_check_results, print_class_summary
from dflash_doctor.rundir.load import load_run
from dflash_doctor.telemetry.watch_record import read_units, read_windows
from dflash_doctor.rundir import ownership
from dflash_doctor.rundir.ownership import LOCK_FILE, claim_run_dir, new_run_dir
from cli_helpers import assert_usage_error
from tiny_models import tiny_dflash, tiny_target, tiny_tokenizer, write_workload
from checks_fixtures import record
from fixture_runs import make_fixture_run, write_request
from telemetry_fixtures import DATA, MetricsExporter

pytestmark = pytest.mark.usefixtures("one_thread")

CONSOLE_SCRIPT = Path(sys.executable).with_name("dflash-doctor")
SUBPROCESS_TIMEOUT_S = 300


def pair_args(tiny_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--target",
        str(tiny_dir / "target"),
        "--draft",
        str(tiny_dir / "dflash"),
        "--workload",
        str(tiny_dir / "workload.jsonl"),
        "--max-new-tokens",
        "8",
        "--out",
        str(out),
        *extra,
    ]


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


# ----------------------------------------------------------------------------------------------------
# 1. A run directory is owned


def assert_refused_while_a_killed_process_held(run_dir: Path, command: list[str]) -> None:
    """``dflash-doctor COMMAND`` on ``run_dir`` while another live process holds it: exit 2 in one sentence
    naming that process, nothing written. The holder is then killed (kill -9), leaving its lock stale."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom dflash_doctor.rundir.ownership import claim_run_dir\n"
            "claim_run_dir(sys.argv[1]); print('claimed', flush=True); time.sleep(600)",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
        second = subprocess.run(
            [str(CONSOLE_SCRIPT), *command], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
        )
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
        assert f"being written by another dflash-doctor process (pid {holder.pid})" in " ".join(second.stderr.split())
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # the refused process wrote nothing
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)


def test_a_second_process_writing_the_same_out_is_refused_and_a_stale_lock_is_taken_over(tiny_dir, tmp_path):
    run_dir = tmp_path / "shared"
    assert_refused_while_a_killed_process_held(run_dir, ["replay", *pair_args(tiny_dir, run_dir)])
    # the holder was killed: its lock is stale and the next run takes the folder over
    result = subprocess.run(
        [str(CONSOLE_SCRIPT), "replay", *pair_args(tiny_dir, run_dir)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    run = load_run(run_dir)
    assert run.complete and len(run.requests) == 6
    assert not (run_dir / LOCK_FILE).exists()  # given back when the writer closed


def test_an_earlier_run_in_out_is_kept_unless_overwrite_is_given(tiny_dir, tmp_path):
    run_dir = tmp_path / "run"
    first = invoke("replay", *pair_args(tiny_dir, run_dir))
    assert first.exit_code == 0, first.output
    before = (run_dir / "run.json").read_bytes()
    again = invoke("replay", *pair_args(tiny_dir, run_dir, "--max-requests", "1"))
    assert_usage_error(again, f"--out {run_dir} already holds files", "--overwrite")
    assert (run_dir / "run.json").read_bytes() == before and len(load_run(run_dir).requests) == 6
    replaced = invoke("replay", *pair_args(tiny_dir, run_dir, "--max-requests", "1", "--overwrite"))
    assert replaced.exit_code == 0, replaced.output
    assert len(load_run(run_dir).requests) == 1


def test_a_refused_claim_leaves_no_empty_folder_and_a_file_is_not_a_folder(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="already holds files"):
        claim_run_dir(tmp_path / "taken")
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine" and not (tmp_path / "taken" / LOCK_FILE).exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(Exception, match="is a file, not a folder"):
        claim_run_dir(tmp_path / "file")


def test_commands_started_in_the_same_second_without_out_get_folders_of_their_own(tmp_path, monkeypatch):
    """No --out: each command makes its own runs/<command>-<second> folder, the later ones suffixed, so a script
    running checks in parallel neither refuses one of them nor lets two write one folder."""

    class FrozenClock(ownership._dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 12, 4, 10, 5, 7)

    monkeypatch.setattr(ownership._dt, "datetime", FrozenClock)
    made = [new_run_dir("check", tmp_path / "runs") for _ in range(3)]
    assert [p.name for p in made] == ["check-20261204-100507", "check-20261204-100507-2", "check-20261204-100507-3"]
    assert all(p.is_dir() and not any(p.iterdir()) for p in made)
    for folder in made:  # each one is a fresh folder its command can claim
        assert claim_run_dir(folder) is False


def test_a_watch_refused_before_it_starts_leaves_no_folder_behind(tmp_path, monkeypatch):
    """The default folder is made once the baseline and the sources proved good."""
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "server.log"
    log.write_text("plain application log, no spec decode\n")
    assert_usage_error(invoke("watch", log, "--once", "--baseline", tmp_path / "missing-run"), "missing-run")
    assert_usage_error(invoke("watch", tmp_path / "missing.log", "--once"), "missing.log")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_live_watch_owns_its_out_and_the_next_watch_continues_what_it_left(tmp_path):
    """A live watch holds --out for its life: a second watch on it exits 2 in one sentence. Killed (kill -9),
    its lock is stale: the next watch on the folder takes it over and continues the watch, every window the
    killed one journaled kept; --overwrite starts a new watch there; a folder holding anything else is refused."""
    run_dir, metrics = tmp_path / "watch", (DATA / "vllm_metrics_good.txt").read_text()
    with MetricsExporter((DATA / "vllm_metrics_good_1.txt").read_text()) as exporter:
        fresh = invoke("watch", exporter.url, "--once", "--out", tmp_path / "fresh")
        assert fresh.exit_code == 0, fresh.output
        windows_per_once = len(read_windows(tmp_path / "fresh"))
        live = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dflash_doctor",
                "watch",
                exporter.url,
                "--interval",
                "0.3",
                "--window",
                "30s",
                "--min-drafts",
                "1",
                "--out",
                str(run_dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 120
            while (
                not (run_dir / "run.json").is_file() or len(read_windows(run_dir)) < 2
            ) and time.monotonic() < deadline:
                if exporter.scrapes >= 2:
                    exporter.text = metrics  # more requests arrive: the next windows have drafts
                time.sleep(0.2)
            assert live.poll() is None and len(read_windows(run_dir)) >= 2
            second = subprocess.run(
                [str(CONSOLE_SCRIPT), "watch", exporter.url, "--once", "--out", str(run_dir)],
                capture_output=True,
                text=True,
                timeout=SUBPROCESS_TIMEOUT_S,
            )
            assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
            assert f"being written by another dflash-doctor process (pid {live.pid})" in " ".join(second.stderr.split())
        finally:
            live.send_signal(signal.SIGKILL)
            live.wait(timeout=30)
        assert (run_dir / "journal").is_dir() and (
            run_dir / LOCK_FILE
        ).is_file()  # killed mid-watch: nothing consolidated
        windows, units = len(read_windows(run_dir)), len(read_units(run_dir))
        continued = invoke("watch", exporter.url, "--once", "--out", run_dir)
        assert continued.exit_code == 0, continued.output
        assert len(read_windows(run_dir)) == windows + windows_per_once and len(read_units(run_dir)) > units
        assert not (run_dir / "journal").exists() and not (run_dir / LOCK_FILE).exists()
        overall = load_run(run_dir).record.summary.overall
        assert (
            overall is not None and overall.num_drafts == read_units(run_dir)["num_drafts"].sum()
        )  # pools the earlier units too
        replaced = invoke("watch", exporter.url, "--once", "--out", run_dir, "--overwrite")
        assert replaced.exit_code == 0, replaced.output
        assert len(read_windows(run_dir)) == windows_per_once
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "todo.txt").write_text("mine")
        assert_usage_error(
            invoke("watch", exporter.url, "--once", "--out", tmp_path / "notes"), "already holds files", "--overwrite"
        )
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["todo.txt"]


def test_train_draft_owns_its_out_resumes_its_own_and_keeps_a_foreign_folder_unless_overwrite(tiny_dir, tmp_path):
    def train(out: Path, *extra: str) -> list[str]:
        return [
            "train-draft",
            "--target",
            str(tiny_dir / "target"),
            "--workload",
            str(tiny_dir / "workload.jsonl"),
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--anchors-per-sequence",
            "2",
            "--max-new-tokens",
            "4",
            "--eval-requests",
            "0",
            "--block-size",
            "4",
            "--num-layers",
            "1",
            "--device",
            "cpu",
            "--out",
            str(out),
            *extra,
        ]

    def resumed_from_step(out: Path) -> int:
        return json.loads((out / "training_log.json").read_text())["resumed_from_step"]

    out = tmp_path / "draft"
    assert_refused_while_a_killed_process_held(out, train(out))
    first = invoke(*train(out))  # the holder's lock is stale: taken over
    assert first.exit_code == 0, first.output
    assert not (out / LOCK_FILE).exists() and resumed_from_step(out) == 0
    again = invoke(*train(out))  # its own earlier training: resumed (finished: the outputs rewritten), not refused
    assert again.exit_code == 0, again.output
    assert resumed_from_step(out) == 2
    (out / "checkpoint").replace(out / "checkpoint.old")  # a run killed between the two renames of a checkpoint write
    afresh = invoke(*train(out, "--overwrite"))
    assert afresh.exit_code == 0, afresh.output
    assert resumed_from_step(out) == 0
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    assert_usage_error(invoke(*train(tmp_path / "notes")), "already holds files", "--overwrite")
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["todo.txt"]


# ----------------------------------------------------------------------------------------------------
# 2. Every finished request reaches the journal as it finishes, whatever the batching

KILLED_ON_SECOND_BATCH = """
import os, signal, sys
from dflash_doctor.cli import main
from dflash_doctor.replay import stream

stream.GREEDY_BATCH_SIZE = 2  # six requests: three batches of greedy continuations
generate = stream.generate_greedy_batch
calls = []

def generate_then_die(*args, **kwargs):
    calls.append(None)
    if len(calls) == 2:  # the second batch starts: whatever finished before must be in the journal
        os.kill(os.getpid(), signal.SIGKILL)
    return generate(*args, **kwargs)

stream.generate_greedy_batch = generate_then_die
sys.argv = ["dflash-doctor", *sys.argv[1:]]
main()
"""


def test_check_killed_during_the_greedy_continuations_keeps_the_requests_of_finished_batches(tiny_dir, tmp_path):
    run_dir = tmp_path / "killed"
    result = subprocess.run(
        [sys.executable, "-c", KILLED_ON_SECOND_BATCH, "check", *pair_args(tiny_dir, run_dir)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == -signal.SIGKILL, result.stderr
    run = load_run(run_dir)
    assert not run.complete
    assert len(run.requests) == 2, "the first batch's two requests were journaled before the second batch generated"
    assert set(run.steps["request_id"]) == set(run.requests["request_id"])


# ----------------------------------------------------------------------------------------------------
# 3. The lossless check's dtype rule


def test_rounding_at_is_the_spacing_torch_gives_the_dtype():
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        values = torch.tensor([0.3, 1.0, 15.2, 215.0, -7.5], dtype=torch_dtype)
        spacing = (torch.nextafter(values.abs(), torch.full_like(values, float("inf"))) - values.abs()).float()
        assert [rounding_at(dtype, float(v)) for v in values.float()] == spacing.tolist()


@pytest.mark.parametrize(
    "dtype, margin, top1, status",
    [
        (
            "bfloat16",
            0.062,
            15.0,
            "warn",
        ),  # the reported case: one bf16 step at a logit of 15 (a fixed 0.05 called it a loss)
        ("bfloat16", 0.062, 0.5, "fail"),  # the same margin at a small logit is 32 steps: a real preference
        ("float16", 0.062, 15.0, "fail"),  # float16 keeps 11 bits: 0.0078 steps at 15
        ("float32", 0.001, 15.0, "fail"),  # float32 is exact enough: every divergence is a loss, as before
        ("bfloat16", 0.01, None, "fail"),  # a record without the top logit cannot be judged a near-tie
    ],
)
def test_lossless_judges_a_margin_against_the_dtype_rounding_at_its_logit(dtype, margin, top1, status):
    divergence = Divergence(
        request_id="r",
        position=3,
        speculative_token=1,
        plain_token=2,
        speculative_text="a",
        plain_text="b",
        top2_margin=margin,
        top1_logit=top1,
    )
    probe = LosslessProbe(num_requests=2, num_identical=1, dtype=dtype, divergences=[divergence])
    result = run_checks(CheckContext(record=record(probes=Probes(lossless=probe))), only=["lossless"])[0]
    assert result.status == status
    if top1 is not None and dtype != "float32":
        assert f"where {dtype} rounds in steps of {rounding_at(dtype, top1):.4f}" in result.findings[0].evidence


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    """The tiny pair loaded in bfloat16 on CPU (its logits are in the hundreds: bf16 steps of 1 or 2 there)."""
    root = tmp_path_factory.mktemp("bf16")
    target = tiny_target()
    with torch.no_grad():
        target.lm_head.weight.mul_(60.0)
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    save_dflash_draft(tiny_dflash(target, block_size=6), root / "dflash")
    workload = write_workload(root / "workload.jsonl", per_class=1)
    pairs = {
        dtype: load_pair(
            build_config(target=str(root / "target"), draft=str(root / "dflash"), workload=str(workload), dtype=dtype)
        )
        for dtype in ("bfloat16", "float32")
    }
    return pairs, load_workload(str(workload))[0]


def flipped_at_the_parting_token(pair, request, monkeypatch, pick) -> tuple[str, dict]:
    """The lossless probe and check on one real turn of ``pair`` whose speculative output takes the target's
    runner-up at the position ``pick(margins, roundings)`` chooses (what a rounding flip, or a broken engine, does)."""
    prompt = first_turn_prompt(pair, request)
    plain = plain_generate(pair.target, torch.tensor(prompt), max_new_tokens=16, stop_ids=pair.stop_ids).output_ids
    pair.target.reset()
    logits = pair.target.forward(torch.tensor(prompt + plain), taps=()).logits[
        len(prompt) - 1 : len(prompt) - 1 + len(plain)
    ]
    pair.target.reset()
    top = logits.float().topk(2)
    margins = (top.values[:, 0] - top.values[:, 1]).tolist()
    dtype = str(pair.target.model.dtype).removeprefix("torch.")
    roundings = [rounding_at("bfloat16", v) for v in top.values[:, 0].tolist()]
    position = pick(margins, roundings)
    flipped = plain[:position] + [int(top.indices[position, 1])]
    monkeypatch.setattr(
        probes,
        "speculative_generate",
        lambda *a, **kw: GenerationResult(output_ids=list(flipped), stop_reason="max_new_tokens", wall_time_s=0.0),
    )
    turn = Turn(
        request, 0, prompt, 16, GenerationResult(output_ids=plain, stop_reason="max_new_tokens", wall_time_s=0.0)
    )
    probe = lossless_probe(pair, [turn], k=4, dtype=dtype)
    assert [d.position for d in probe.divergences] == [position]
    result = run_checks(CheckContext(record=record(probes=Probes(lossless=probe))), only=["lossless"])[0]
    return result.status, {"margin": margins[position], "rounding": roundings[position]}


def test_a_bf16_divergence_at_a_near_tie_warns_and_a_clear_one_fails_on_a_real_cpu_model(bf16_pair, monkeypatch):
    pairs, request = bf16_pair
    pair = pairs["bfloat16"]
    nearest = lambda margins, roundings: min(range(len(margins)), key=lambda i: margins[i] / roundings[i])  # noqa: E731
    clearest = lambda margins, roundings: max(range(len(margins)), key=lambda i: margins[i] / roundings[i])  # noqa: E731
    status, found = flipped_at_the_parting_token(pair, request, monkeypatch, nearest)
    assert found["margin"] <= 2 * found["rounding"], (
        found
    )  # the fixture's output has a near-tie (a margin of one bf16 step)
    assert status == "warn", found
    status, found = flipped_at_the_parting_token(pair, request, monkeypatch, clearest)
    assert found["margin"] > 2 * found["rounding"] and status == "fail", found
    status, _ = flipped_at_the_parting_token(pairs["float32"], request, monkeypatch, nearest)
    assert status == "fail"  # float32: unchanged, any divergence is a loss


# ----------------------------------------------------------------------------------------------------
# 4. compare with an empty side


def test_compare_with_a_run_that_finished_no_request_exits_2_instead_of_passing(tmp_path):
    full, empty = tmp_path / "full", tmp_path / "empty"
    with RunWriter(full, RunRecord(meta=RunMeta(command="replay", created_at=utc_now())).to_json()) as writer:
        for name in ("a", "b"):
            write_request(writer, name)
    RunWriter(empty, RunRecord(meta=RunMeta(command="replay", created_at=utc_now())).to_json()).close()
    assert invoke("compare", full, full).exit_code == 0
    assert_usage_error(invoke("compare", full, empty), f"NEW ({empty}) has no drafted steps", "nothing was compared")
    assert_usage_error(invoke("compare", empty, full), f"BASE ({empty}) has no drafted steps")
    assert_usage_error(invoke("compare", empty, empty), "BASE", "and NEW", "have no drafted steps")
    assert not (empty / "compare.md").exists()


# ----------------------------------------------------------------------------------------------------
# 5. watch --once on a source with no engine series


@pytest.mark.parametrize(
    "text", ["", "<html><body>It works!</body></html>\n", "process_cpu_seconds_total 3.2\nup 1\n", "\x00\x01garbage{{"]
)
def test_watch_once_on_metrics_without_engine_series_exits_2(tmp_path, text):
    with MetricsExporter(text) as exporter:
        result = invoke("watch", exporter.url, "--once", "--out", tmp_path / "run")
    assert_usage_error(result, "no speculative-decoding series in http://127.0.0.1", "/metrics URL or log file")


@pytest.mark.parametrize(
    "content", [bytes(range(256)) * 8, b"", "plain application log, no spec decode\n".encode() * 20]
)
def test_watch_once_on_a_log_without_engine_lines_exits_2(tmp_path, content):
    log = tmp_path / "server.log"
    log.write_bytes(content)
    assert_usage_error(
        invoke("watch", log, "--once", "--out", tmp_path / "run"), f"no speculative-decoding series in {log}"
    )


# ----------------------------------------------------------------------------------------------------
# 9. Text from users is inert in every output format

HOSTILE = "evil\x1b]0;pwned\x07\x1b[2J[bold red]x[/]|`<b>b</b>\x00\x9b\ufffe"
TRACKER = "![seen](http://tracker.example/p.png) [click](javascript:alert(1))"  # Markdown that would fetch or link
RAW_CONTROLS = ("\x1b", "\x07", "\x00", "\x9b", "\ufffe")


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory) -> Path:
    """A fixture run whose class names, request ids and check texts carry terminal escapes, Rich markup,
    Markdown/HTML and XML-invalid characters."""
    run_dir = make_fixture_run(tmp_path_factory.mktemp("hostile") / "run", classes=(HOSTILE, "math"), num_requests=6)
    meta = json.loads((run_dir / "run.json").read_text())
    for check in meta["checks"]:
        check["summary"] = f"summary {HOSTILE} {TRACKER}"
        for finding in check["findings"]:
            finding.update(message=f"message {HOSTILE}", evidence=f"evidence {HOSTILE}", fix=f"fix {HOSTILE}")
    (run_dir / "run.json").write_text(json.dumps(meta))
    return run_dir


def test_every_report_format_carries_user_text_inertly(hostile_run, tmp_path):
    written = render_reports(load_run(hostile_run), formats=("html", "md", "json", "junit"), out_dir=tmp_path)
    by_suffix = {path.suffix: path.read_text(encoding="utf-8") for path in written}
    for suffix, text in by_suffix.items():
        assert not any(c in text for c in RAW_CONTROLS), suffix
    assert "evil\\x1b]0;pwned\\x07" in by_suffix[".md"] and "&lt;b&gt;" in by_suffix[".md"]
    assert (
        "](" not in by_suffix[".md"] and "![seen]\\(http://tracker.example/p.png)" in by_suffix[".md"]
    )  # no image, no link
    assert "<b>b</b>" not in by_suffix[".html"]
    payload = json.loads(by_suffix[".json"])  # JSON escapes control characters itself: the value comes back exact
    assert {check["summary"] for check in payload["checks"]} == {f"summary {HOSTILE} {TRACKER}"}
    root = ET.fromstring(by_suffix[".xml"])  # every CI parses it: no XML-invalid character
    failure = root.find(".//failure")
    assert (
        failure is not None
        and f"summary evil\\x1b]0;pwned\\x07\\x1b[2J[bold red]x[/]|`<b>b</b>\\x00\\x9b\\ufffe {TRACKER}"
        == failure.get("message")
    )


def test_the_terminal_views_show_control_sequences_as_text(hostile_run):
    run = load_run(hostile_run)
    buffer = io.StringIO()
    console = Console(file=buffer, width=400, force_terminal=True, color_system=None)
    print_class_summary(run.record, 8, console)
    print_check_results(run.record.checks, console)
    shown = buffer.getvalue()
    assert not any(c in shown for c in RAW_CONTROLS)
    assert "evil\\x1b]0;pwned\\x07\\x1b[2J[bold red]x[/]" in shown  # the markup is text, not a style
    compared = invoke("compare", hostile_run, hostile_run, "--out", hostile_run.parent / "compare")
    assert compared.exit_code == 0, compared.output
    assert (
        not any(c in compared.output for c in RAW_CONTROLS) and "\\x1b" in compared.output
    )  # the cell wraps: shown as text


def test_the_dashboard_shows_user_text_without_markup(hostile_run, monkeypatch):
    monkeypatch.setenv(RUNS_DIR_ENV, str(hostile_run.parent))
    dashboard = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "app" / "main.py"), default_timeout=120)
    dashboard.session_state["run_path"] = str(hostile_run)
    dashboard.run()
    assert not dashboard.exception, [e.value for e in dashboard.exception]
    markdown = [
        str(e.value) for kind in ("markdown", "caption", "error", "warning", "info") for e in dashboard.get(kind)
    ]
    labels = [str(e.label) for e in dashboard.get("expander")]
    hostile = [text for text in markdown + labels if "evil" in text]
    assert hostile, "the check texts are shown"
    for text in hostile:
        assert not any(c in text for c in RAW_CONTROLS), text
        assert "\\[bold red\\]" in text and "<b>" not in text, text  # escaped Markdown: shown, not rendered
