"""A watch's run directory: readable by every view (load_run, report, compare), the Production page, canary compare."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pandas as pd

import pytest
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from dflash_doctor.report import watch_figures
from dflash_doctor.app import RUNS_DIR_ENV
from dflash_doctor.cli import app
from dflash_doctor.report.comparison import compare_runs
from dflash_doctor.rundir.load import load_run
from dflash_doctor.telemetry.counts import SeriesKey
from dflash_doctor.telemetry.watch_record import WatchRecord, read_units, read_windows
from dflash_doctor.telemetry.verdict import Baseline, Judge, Thresholds
from dflash_doctor.telemetry.watcher import Unit, Window
from telemetry_fixtures import WATCH_K, unit_counts, write_watch

MAIN = Path(__file__).resolve().parents[1] / "app" / "main.py"


def test_watch_run_loads_everywhere(tmp_path):
    run_dir = write_watch(tmp_path / "watch", [0.6, 0.35, 0.2, 0.1], baseline_tau=3.0)
    run = load_run(run_dir)
    assert run.meta["source"]["kind"] == "telemetry" and run.record.source.kind == "telemetry"
    assert run.steps.empty and run.requests.empty  # production has no per-step rows
    overall = run.meta["summary"]["overall"]
    assert overall["mean_acceptance_length"] == pytest.approx(1 + 0.6 + 0.35 + 0.2 + 0.1, abs=0.01)
    assert set(run.meta["summary"]["by_class"]) == {"code", "chat"}
    windows = read_windows(run_dir)
    assert len(windows) == 16 and set(windows["alerts"].map(tuple)) == {("acceptance-drop",)}  # 2.25 vs baseline 3.0
    assert len(read_units(run_dir)) == 16
    assert len(run.meta["source"]["details"]["alerts"]) == 16
    result = CliRunner().invoke(app, ["report", str(run_dir), "--format", "md,json"])
    assert result.exit_code == 0, result.output


def test_canary_compare_flags_a_worse_canary_and_passes_an_equal_one(tmp_path):
    base = write_watch(tmp_path / "base", [0.6, 0.35, 0.2, 0.1])
    same = write_watch(tmp_path / "same", [0.6, 0.35, 0.2, 0.1])
    worse = write_watch(tmp_path / "worse", [0.3, 0.1, 0.05, 0.0])
    assert not compare_runs(base, same).has_regression
    comparison = compare_runs(base, worse)
    assert comparison.has_regression
    assert {row.cls for row in comparison.regressions if row.slot is None} == {"chat", "code", "overall"}
    result = CliRunner().invoke(app, ["compare", str(base), str(worse), "--out", str(tmp_path / "cmp")])
    assert result.exit_code == 1, result.output


def test_canary_with_few_scrape_intervals_uses_count_intervals(tmp_path):
    base = write_watch(tmp_path / "base", [0.6, 0.35, 0.2, 0.1], num_units=2)
    worse = write_watch(tmp_path / "worse", [0.3, 0.1, 0.05, 0.0], num_units=2)
    comparison = compare_runs(base, worse)
    assert comparison.has_regression
    assert any("fewer than" in note for note in comparison.notes)
    tau_row = next(r for r in comparison.rows if r.cls == "overall" and r.slot is None)
    assert tau_row.base_ci[1] - tau_row.base_ci[0] > 0  # never the zero-width interval of a 2-unit bootstrap


def test_production_page_shows_series_and_alerts(monkeypatch, tmp_path):
    run_dir = write_watch(tmp_path / "runs" / "watch", [0.6, 0.35, 0.2, 0.1], baseline_tau=3.0)
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path / "runs"))
    at = AppTest.from_file(str(MAIN), default_timeout=60)
    at.session_state["run_path"] = str(run_dir)
    at.run()
    at.switch_page("views/production.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert "16 alert(s)" in at.error[0].value
    shown = at.dataframe[0].value
    assert set(shown["class"]) == {"code", "chat"}
    assert shown["mean_acceptance_length"].iloc[0] == pytest.approx(
        read_windows(run_dir).sort_values("end_s")["mean_acceptance_length"].iloc[-1]
    )
    assert any("num_speculative_tokens" in code.value for code in at.code)


def open_production(monkeypatch, runs_dir: Path, run_dir: Path | None = None) -> AppTest:
    monkeypatch.setenv(RUNS_DIR_ENV, str(runs_dir))
    at = AppTest.from_file(str(MAIN), default_timeout=60)
    if run_dir is not None:
        at.session_state["run_path"] = str(run_dir)
    at.run()
    at.switch_page("views/production.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_production_page_is_a_fragment_that_reruns_on_a_timer_and_reads_the_run_again(monkeypatch, tmp_path):
    """The page says it refreshes: its content is a fragment Streamlit reruns on a timer (AppTest runs no
    timers, so the fragment's registration is recorded), and each run reads the run directory again, so
    a watch that wrote more windows since shows them."""
    import streamlit

    registered = []
    real_fragment = streamlit.fragment

    def recording_fragment(*args, **kwargs):
        registered.append(kwargs.get("run_every"))
        return real_fragment(*args, **kwargs)

    monkeypatch.setattr(streamlit, "fragment", recording_fragment)
    run_dir = write_watch(tmp_path / "runs" / "watch", [0.6, 0.35, 0.2, 0.1], baseline_tau=3.0, num_units=2)
    at = open_production(monkeypatch, tmp_path / "runs", run_dir)
    (every_s,) = registered  # one timed fragment, and it holds the page (below)
    assert every_s > 0 and f"refreshes every {every_s} s" in at.caption[-1].value
    assert "4 alert(s)" in at.error[0].value
    write_watch(run_dir, [0.6, 0.35, 0.2, 0.1], baseline_tau=3.0, num_units=5)  # the watch went on
    at.run()
    assert "10 alert(s)" in at.error[0].value


def test_uploading_a_zipped_watch_run_keeps_its_windows_for_the_production_page(monkeypatch, tmp_path):
    run_dir = write_watch(tmp_path / "watch", [0.6, 0.35, 0.2, 0.1], baseline_tau=3.0)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for file in run_dir.iterdir():
            archive.write(file, f"watch/{file.name}")
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path / "no-runs"))
    at = AppTest.from_file(str(MAIN), default_timeout=60)
    at.run()
    at.get("file_uploader")[0].set_value(("watch.zip", buffer.getvalue(), "application/zip")).run()
    uploaded = Path(at.session_state["run_path"])
    assert uploaded != run_dir
    pd.testing.assert_frame_equal(read_windows(uploaded), read_windows(run_dir))
    pd.testing.assert_frame_equal(read_units(uploaded), read_units(run_dir))
    at.switch_page("views/production.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert "16 alert(s)" in at.error[0].value and set(at.dataframe[0].value["class"]) == {"code", "chat"}


def test_production_page_on_a_check_run_says_what_it_needs(monkeypatch, tmp_path):
    from fixture_runs import make_fixture_run

    run_dir = make_fixture_run(tmp_path / "runs" / "check", seed=0, num_requests=3)
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path / "runs"))
    at = AppTest.from_file(str(MAIN), default_timeout=60)
    at.session_state["run_path"] = str(run_dir)
    at.run()
    at.switch_page("views/production.py").run()
    assert not at.exception
    assert "dflash-doctor watch" in at.info[0].value


def test_canary_between_two_label_values_of_one_watch(tmp_path):
    record = WatchRecord(
        tmp_path / "w", {}, {"sources": ["x"], "window_s": 60.0, "interval_s": 60.0, "baseline": None, "thresholds": {}}
    )
    for i in range(8):
        stable = unit_counts(200, [0.6, 0.35, 0.2, 0.1])
        canary = unit_counts(200, [0.3, 0.1, 0.05, 0.0])
        record.update(
            [],
            [
                Unit(SeriesKey("m", "stable"), 60.0 * i, stable, {}, "x"),
                Unit(SeriesKey("m", "canary"), 60.0 * i, canary, {}, "x"),
            ],
            [],
            [],
        )
    comparison = compare_runs(f"{tmp_path / 'w'}#stable", f"{tmp_path / 'w'}#canary")
    assert comparison.has_regression and {r.cls for r in comparison.rows} == {"overall"}
    assert not compare_runs(f"{tmp_path / 'w'}#canary", f"{tmp_path / 'w'}#stable").has_regression  # an improvement
    result = CliRunner().invoke(app, ["compare", f"{tmp_path / 'w'}#stable", f"{tmp_path / 'w'}#nope"])
    assert result.exit_code == 2 and "no series of class 'nope'" in result.output


def test_baseline_from_a_check_run_prices_and_truncates(tmp_path):
    from fixture_runs import FIXTURE_K_MAX, make_fixture_run

    run_dir = make_fixture_run(tmp_path / "check", seed=0, num_requests=18)
    baseline = Baseline.from_run(run_dir)
    summary = load_run(run_dir).meta["summary"]
    assert baseline.costs is not None  # the sweep's step costs price production windows
    assert baseline.for_class("code").tau == pytest.approx(summary["by_class"]["code"]["mean_acceptance_length"])
    assert baseline.for_class("all").tau == pytest.approx(summary["overall"]["mean_acceptance_length"])
    # production serves K=4 of the baseline's K=8: the baseline is truncated from its per-position rates
    judge = Judge(baseline, Thresholds(min_drafts=10), server_kind="vllm")
    served = unit_counts(400, [0.3, 0.1, 0.05, 0.0])
    verdict = judge.judge(Window(SeriesKey("m", "code"), 0, 60, served, [served]))
    rates = summary["by_class"]["code"]["acceptance_rate_per_pos"]
    assert len(rates) == FIXTURE_K_MAX
    assert verdict.baseline_tau == pytest.approx(1 + sum(rates[:WATCH_K]))
    assert {a.kind for a in verdict.alerts} >= {"acceptance-drop"}
    assert verdict.speedup is not None


def test_timeline_figures_mark_alerts_and_explain_empty(tmp_path):
    run_dir = write_watch(tmp_path / "watch", [0.6, 0.35, 0.2, 0.1], baseline_tau=3.0, classes=("code",))
    fig = watch_figures.tau_timeline_figure(read_windows(run_dir))
    names = [trace.name for trace in fig.data]
    assert "m [code]" in names and "m [code] baseline" in names and "m [code] alert" in names
    alert_trace = next(t for t in fig.data if t.name == "m [code] alert")
    assert len(alert_trace.x) == 8
    empty = watch_figures.tau_timeline_figure(read_windows(tmp_path / "nothing"))
    assert "No window with drafts" in empty.layout.annotations[0].text
    assert "No step costs" in watch_figures.speedup_timeline_figure(read_windows(run_dir)).layout.annotations[0].text
