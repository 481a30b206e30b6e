"""SGLang's ``spec_accept_length`` / ``spec_accept_rate`` are averages since the server started (docs/engines.md,
telemetry): a window's value is the change of average x verify calls over the change of verify calls, not the gauge.

The exposition is the captured SGLang text (tests/data/telemetry/sglang_metrics.txt: 1500 verify calls,
accept length 3.04, rate 0.68) and the same text after 500 more calls at a higher acceptance.
"""

from __future__ import annotations

import pytest

from dflash_doctor.telemetry.counts import SeriesKey
from dflash_doctor.telemetry.sources import MetricsEndpoint
from dflash_doctor.telemetry.watcher import Watcher
from telemetry_fixtures import DATA, MetricsExporter

GLM = SeriesKey("glm")
FIRST = (DATA / "sglang_metrics.txt").read_text()


def later(calls_code: float, calls_chat: float, accept_length: float, accept_rate: float) -> str:
    """The capture with other counter and gauge values (same names, labels and layout)."""
    text = FIRST.replace(
        'cls="code",engine_type="unified",model_name="glm"} 1000.0',
        f'cls="code",engine_type="unified",model_name="glm"}} {calls_code}',
    )
    text = text.replace(
        'cls="chat",engine_type="unified",model_name="glm"} 500.0',
        f'cls="chat",engine_type="unified",model_name="glm"}} {calls_chat}',
    )
    text = text.replace("} 3.04", f"}} {accept_length}").replace("} 0.68", f"}} {accept_rate}")
    assert text.count(f"}} {accept_length}") == 2 and f"}} {calls_code}" in text
    return text


def engine_values(texts: list[str], *, count_since_start: bool = False) -> dict[str, float]:
    with MetricsExporter(texts[0]) as exporter:
        watcher = Watcher(
            [MetricsEndpoint(exporter.url, server_kind="sglang")], window_s=1e9, count_since_start=count_since_start
        )
        for i, text in enumerate(texts):
            exporter.text = text
            watcher.poll(now=100.0 + i)
    (window,) = [w for w in watcher.current_windows() if w.key == GLM]
    return window.reported


def test_window_value_is_the_change_of_the_since_start_average():
    reported = engine_values([FIRST, later(1400.0, 600.0, 3.2, 0.70)])
    assert reported["mean_acceptance_length"] == pytest.approx((3.2 * 2000 - 3.04 * 1500) / 500)  # 3.68, not 3.2
    assert reported["draft_acceptance_rate"] == pytest.approx((0.70 * 2000 - 0.68 * 1500) / 500)
    assert "average_weight" not in reported


def test_counted_since_start_the_gauge_is_the_value():
    reported = engine_values([FIRST], count_since_start=True)
    assert reported["mean_acceptance_length"] == pytest.approx(3.04)


def test_after_a_restart_the_gauge_covers_the_time_since_it():
    reported = engine_values([FIRST, later(80.0, 20.0, 2.5, 0.5)])  # counters went down: restarted, averages start over
    assert reported["mean_acceptance_length"] == pytest.approx(2.5)


def test_without_new_verify_calls_there_is_no_window_value():
    reported = engine_values([FIRST, FIRST])
    assert "mean_acceptance_length" not in reported
