"""watch's exporter: verdict gauges from real captured vLLM counts, stale series removed, and the watch's own health.

Verdicts are judged by the real Judge on counts read from the captured vLLM metric texts; the
exposition is the text prometheus_client would serve (``generate_latest``), and one test scrapes it
over HTTP from the address given.
"""

from __future__ import annotations

import re
import urllib.request

import pytest

from dflash_doctor.errors import UsageError
from dflash_doctor.telemetry.counts import SeriesKey, SpecCounts
from dflash_doctor.telemetry.server_metrics import read_exposition
from dflash_doctor.telemetry.exporter import VerdictExporter, VerdictGauges
from dflash_doctor.telemetry.exposition import parse_exposition
from dflash_doctor.telemetry.verdict import Baseline, Judge, Thresholds, WindowVerdict
from dflash_doctor.telemetry.watcher import Window
from telemetry_fixtures import DATA, free_port

# the exporter extra (pip install -e ".[exporter]"); without it this module is skipped with the reason
generate_latest = pytest.importorskip(
    "prometheus_client",
    reason='prometheus-client is the exporter extra: pip install -e ".[exporter]" (scripts/setup-dev.sh installs it)',
).generate_latest

MODEL = SeriesKey("smollm2-dflash")
OTHER = SeriesKey("other-model", "code")
SERIES = 'class="all",model="smollm2-dflash"'


def counts_of(name: str) -> SpecCounts:
    text = (DATA / f"vllm_metrics_{name}.txt").read_text()
    return read_exposition(parse_exposition(text), server_kind="vllm", default_model="x").counts[MODEL]


def judged(key: SeriesKey, counts: SpecCounts, baseline_tau: float = 3.0) -> WindowVerdict:
    judge = Judge(Baseline.fixed({"overall": baseline_tau}), Thresholds(min_drafts=1), server_kind="vllm")
    return judge.judge(Window(key, 0, 10, counts, [counts]))


def scrape(gauges: VerdictGauges) -> str:
    return generate_latest(gauges.registry).decode()


def value(text: str, name: str, labels: str = SERIES) -> float | None:
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.MULTILINE)
    return None if match is None else float(match.group(1))


def test_gauges_carry_the_verdict_with_prometheus_names():
    gauges = VerdictGauges()
    broken = counts_of("broken")
    verdict = judged(MODEL, broken)
    gauges.publish([verdict], {"http://vllm:8000/metrics": True}, 1_700_000_000.0)
    text = scrape(gauges)
    assert value(text, "dflash_doctor_mean_acceptance_length") == pytest.approx(broken.mean_acceptance_length)
    lower, upper = verdict.mean_acceptance_length_ci
    assert value(text, "dflash_doctor_mean_acceptance_length_lower") == pytest.approx(lower)
    assert value(text, "dflash_doctor_mean_acceptance_length_upper") == pytest.approx(upper)
    assert value(text, "dflash_doctor_window_drafts") == broken.num_drafts
    assert value(text, "dflash_doctor_alert", 'class="all",kind="acceptance-drop",model="smollm2-dflash"') == 1.0
    assert value(text, "dflash_doctor_alert", 'class="all",kind="k-changed",model="smollm2-dflash"') == 0.0
    assert value(text, "dflash_doctor_source_up", 'source="http://vllm:8000/metrics"') == 1.0
    assert re.search(r"^dflash_doctor_last_evaluation_timestamp_seconds 1\.7e\+09$", text, re.MULTILINE)
    assert re.search(r'^dflash_doctor_build_info\{version="[^"]+"\} 1\.0$', text, re.MULTILINE)
    assert "_lo{" not in text and "_hi{" not in text


def test_a_value_that_becomes_unknown_is_removed_not_kept():
    gauges = VerdictGauges()
    gauges.publish([judged(MODEL, counts_of("good"))], {}, 1.0)
    assert value(scrape(gauges), "dflash_doctor_mean_acceptance_length") is not None
    idle = judged(MODEL, SpecCounts(num_generated_tokens=0.0))  # a window without drafts has no tau
    assert idle.mean_acceptance_length is None
    gauges.publish([idle], {}, 2.0)
    text = scrape(gauges)
    assert value(text, "dflash_doctor_mean_acceptance_length") is None
    assert value(text, "dflash_doctor_mean_acceptance_length_lower") is None
    assert value(text, "dflash_doctor_alert", 'class="all",kind="acceptance-drop",model="smollm2-dflash"') == 0.0


def test_a_series_no_longer_judged_vanishes_from_every_gauge():
    gauges = VerdictGauges()
    gauges.publish([judged(MODEL, counts_of("broken")), judged(OTHER, counts_of("good"))], {"a": True}, 1.0)
    assert value(scrape(gauges), "dflash_doctor_mean_acceptance_length", 'class="code",model="other-model"') is not None
    gauges.publish([judged(MODEL, counts_of("broken"))], {"a": False}, 2.0)
    text = scrape(gauges)
    assert 'model="other-model"' not in text
    assert value(text, "dflash_doctor_mean_acceptance_length") is not None
    assert value(text, "dflash_doctor_source_up", 'source="a"') == 0.0


def test_exporter_serves_on_the_address_given():
    port = free_port()
    exporter = VerdictExporter(port, "127.0.0.1")
    exporter.publish([judged(MODEL, counts_of("good"))], {}, 5.0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert value(text, "dflash_doctor_mean_acceptance_length") == pytest.approx(
        counts_of("good").mean_acceptance_length
    )
    with pytest.raises(UsageError, match="--exporter-address"):
        VerdictExporter(port, "127.0.0.1")  # taken by the first
