"""A live watch keeps only the units its next window can need, appends to its run directory instead of
rewriting it, and drops what is older than its retention: memory, disk and each poll's cost stay flat.

A synthetic cumulative counter source (vLLM's counter shape, K = 4) polled many times; every unit still
reaches the run directory, and the window values are those of a watcher that forgets nothing. The soak
test runs a simulated day of 30-second polls (benchmarks/watch_soak.py prints the same figures).
"""

from __future__ import annotations

import gc
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_doctor.rundir.load import load_run
from dflash_doctor.telemetry import watch_record
from dflash_doctor.telemetry.watch_record import read_units, read_windows
from dflash_doctor.telemetry.session import WatchSession
from dflash_doctor.telemetry.settings import WatchSettings
from dflash_doctor.telemetry.watcher import Watcher
from telemetry_fixtures import SyntheticCounters, directory_bytes

RATES = (0.7, 0.4, 0.3, 0.1)  # tau 2.5 in every window


def test_forgetting_old_units_leaves_the_windows_unchanged():
    keeping, forgetting = (
        Watcher([SyntheticCounters(RATES)], window_s=30.0),
        Watcher([SyntheticCounters(RATES)], window_s=30.0),
    )
    for i in range(200):
        now = 1000.0 + 10.0 * i
        keeping.poll(now)
        forgetting.poll(now)
        (window,) = forgetting.current_windows(now)
        assert window.counts == keeping.current_windows(now)[0].counts
        forgetting.forget_units_before(window.start_s)
        assert len(forgetting.units) <= 3  # 30 s of 10 s polls
    assert len(keeping.units) == 199


def test_live_session_records_every_unit_but_keeps_only_the_window(tmp_path):
    source = SyntheticCounters(RATES)
    session = WatchSession([source], WatchSettings(window_s=1e-6, interval_s=1e-6), run_dir=tmp_path / "run", config={})
    session.start()
    for _ in range(60):
        (verdict,) = session.step()
        assert verdict.mean_acceptance_length == 2.5
        assert len(session.watcher.units) == 1
    assert len(read_units(tmp_path / "run")) == 60


OTHER_THREADS_HEAP_BYTES = 64 * 1024


def test_a_day_of_30_second_polls_keeps_memory_and_disk_flat(tmp_path):
    """2880 polls on a simulated clock with a one-hour retention: the Python heap and the run directory
    after 24 h are within 1.25x of what they were after 3 h (past the first retention periods and the
    filling of the summary's bounded sample); a watch that rewrote or kept everything grows 4x and more.

    The heap gets 64 KiB beside the ratio: tracemalloc counts the whole process, and in a pytest-xdist worker
    that has run other tests first, allocations that are not the watch's (threads and caches those tests left)
    land in it too: one full run measured 127 KB -> 161 KB, where the test alone stays within 1.25x."""
    run_dir = tmp_path / "watch"
    session = WatchSession(
        [SyntheticCounters(RATES)],
        WatchSettings(window_s=300.0, interval_s=30.0, retain_s=3600.0),
        run_dir=run_dir,
        config={},
    )
    clock = 1_800_000_000.0
    session.start(clock)
    marks: dict[int, tuple[int, int]] = {}
    tracemalloc.start()
    try:
        for poll in range(1, 2881):
            clock += 30.0
            session.step(clock)
            if poll in (360, 2880):
                gc.collect()  # what is live, not the cyclic garbage the collector has not reached yet
                marks[poll] = (tracemalloc.get_traced_memory()[0], directory_bytes(run_dir))
    finally:
        tracemalloc.stop()
    (heap_start, disk_start), (heap_end, disk_end) = marks[360], marks[2880]
    assert heap_end < 1.25 * heap_start + OTHER_THREADS_HEAP_BYTES, (heap_start, heap_end)
    assert disk_end / disk_start < 1.25, (disk_start, disk_end)
    session.close(clock)
    assert not (run_dir / "journal").exists()
    windows, units = read_windows(run_dir), read_units(run_dir)
    assert windows["end_s"].min() > clock - 3600.0 and len(units) == 120  # the last hour, every 30 s
    overall = load_run(run_dir).record.summary.overall
    assert overall is not None and overall.num_drafts == 100 * 2880  # the summary still pools the whole day
    assert overall.mean_acceptance_length == 2.5


def test_a_watch_still_going_is_read_from_its_journal(tmp_path):
    session = WatchSession(
        [SyntheticCounters(RATES)], WatchSettings(window_s=60.0, interval_s=30.0), run_dir=tmp_path / "run", config={}
    )
    session.start(1000.0)
    for i in range(1, 6):
        session.step(1000.0 + 30.0 * i)
    assert (tmp_path / "run" / "journal" / "windows.arrows").is_file() and not (
        tmp_path / "run" / "windows.parquet"
    ).exists()
    assert len(read_windows(tmp_path / "run")) == 5 and len(read_units(tmp_path / "run")) == 5
    assert load_run(tmp_path / "run").complete is False  # every view can open it meanwhile
    session.close()
    assert len(read_windows(tmp_path / "run")) == 5 and load_run(tmp_path / "run").complete is True


def _watch_hours(run_dir, hours: float, clock: float) -> float:
    """A watch with a one-hour retention polling every 30 s for ``hours`` on a simulated clock, then closed."""
    session = WatchSession(
        [SyntheticCounters(RATES)],
        WatchSettings(window_s=300.0, interval_s=30.0, retain_s=3600.0),
        run_dir=run_dir,
        config={},
    )
    session.start(clock)
    for _ in range(int(hours * 120)):
        clock += 30.0
        session.step(clock)
    session.close(clock)
    return clock


def test_a_watch_restarted_on_its_retained_folder_still_pools_the_whole_watch(tmp_path):
    """Two hours, a restart on the same folder, one more hour: the summary is the one of a three-hour watch
    that never stopped, though the folder holds only the last hour of units."""
    clock = _watch_hours(tmp_path / "restarted", 2.0, 1_800_000_000.0)
    expired = load_run(tmp_path / "restarted").record.source.details["expired"]
    assert expired["series"][0]["num_units"] + len(read_units(tmp_path / "restarted")) == 240
    _watch_hours(tmp_path / "restarted", 1.0, clock + 30.0)
    _watch_hours(tmp_path / "straight", 3.0, 1_800_000_000.0)
    restarted, straight = (load_run(tmp_path / name).record.summary.overall for name in ("restarted", "straight"))
    assert restarted is not None and straight is not None
    assert restarted.num_drafts == straight.num_drafts == 100 * 360 and len(read_units(tmp_path / "restarted")) == 120
    assert restarted.num_accepted_tokens_per_pos == straight.num_accepted_tokens_per_pos
    assert restarted.mean_acceptance_length == straight.mean_acceptance_length == 2.5


def test_units_already_in_the_expired_totals_are_not_counted_twice(tmp_path):
    """A watch killed after run.json took the expiring units' totals but before the Parquet file was cut
    leaves those units in the folder too; the watch that continues it counts them once."""
    run_dir = tmp_path / "watch"
    _watch_hours(run_dir, 2.0, 1_800_000_000.0)
    through_s = load_run(run_dir).record.source.details["expired"]["through_s"]
    units = pq.read_table(run_dir / "units.parquet")
    stale = units.slice(0, 10).set_column(0, "end_s", pa.array([through_s - 30.0 * i for i in range(10)]))
    pq.write_table(pa.concat_tables([stale, units]), run_dir / "units.parquet")
    session = WatchSession(
        [SyntheticCounters(RATES)],
        WatchSettings(window_s=300.0, interval_s=30.0, retain_s=3600.0),
        run_dir=run_dir,
        config={},
    )
    session.start(through_s + 3600.0)
    session.close(through_s + 3600.0)
    overall = load_run(run_dir).record.summary.overall
    assert overall is not None and overall.num_drafts == 100 * 240


def test_a_cut_that_drops_nothing_leaves_the_expired_totals_alone(tmp_path, monkeypatch):
    """The first hourly cut of a two-hour retention finds no unit that old: run.json is written once per
    poll as ever (not once more for the cut), and says nothing has expired yet."""
    writes = []
    real_write = watch_record.write_run_json
    monkeypatch.setattr(
        watch_record, "write_run_json", lambda run_dir, data: (writes.append(1), real_write(run_dir, data))
    )
    session = WatchSession(
        [SyntheticCounters(RATES)],
        WatchSettings(window_s=300.0, interval_s=30.0, retain_s=7200.0),
        run_dir=tmp_path / "run",
        config={},
    )
    session.start(1_800_000_000.0)
    writes.clear()
    for poll in range(1, 131):  # the first cut comes an hour after the first poll
        session.step(1_800_000_000.0 + 30.0 * poll)
    assert pq.read_table(tmp_path / "run" / "units.parquet").num_rows > 0  # the cut was made
    assert len(writes) == 130
    assert load_run(tmp_path / "run").record.source.details["expired"] == {"through_s": None, "series": []}
    session.close(1_800_000_000.0 + 30.0 * 130)
