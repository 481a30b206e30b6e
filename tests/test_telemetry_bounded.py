"""A live watch keeps only the units its next window can need: memory and each poll's scan stay flat.

A synthetic cumulative counter source (vLLM's counter shape, K = 4) polled many times; every unit still
reaches the run directory, and the window values are those of a watcher that forgets nothing.
"""

from __future__ import annotations

from dflash_doctor.telemetry.counts import SeriesKey, SpecCounts
from dflash_doctor.telemetry.observation import Observation
from dflash_doctor.telemetry.record import read_units
from dflash_doctor.telemetry.session import WatchSession
from dflash_doctor.telemetry.settings import WatchSettings
from dflash_doctor.telemetry.watcher import Watcher

KEY = SeriesKey("qwen3-8b")


class GrowingCounters:
    """A /metrics source whose counters grow by 100 drafts (tau 2.5) per poll."""

    name = "synthetic"
    engine = "vllm"

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.polls = 0

    def poll(self) -> list[Observation]:
        self.polls += 1
        n = 100.0 * self.polls
        counts = SpecCounts(num_drafts=n, num_draft_tokens=4 * n, num_accepted_tokens=1.5 * n,
                            num_accepted_tokens_per_pos=(0.7 * n, 0.4 * n, 0.3 * n, 0.1 * n), num_generated_tokens=2.5 * n)
        return [Observation(KEY, counts, cumulative=True)]


def test_forgetting_old_units_leaves_the_windows_unchanged():
    keeping, forgetting = Watcher([GrowingCounters()], window_s=30.0), Watcher([GrowingCounters()], window_s=30.0)
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
    source = GrowingCounters()
    session = WatchSession([source], WatchSettings(window_s=1e-6, interval_s=1e-6), run_dir=tmp_path / "run", config={})
    session.start()
    for _ in range(60):
        (verdict,) = session.step()
        assert verdict.mean_acceptance_length == 2.5
        assert len(session.watcher.units) == 1
    assert len(read_units(tmp_path / "run")) == 60
