"""Production alarms beside the Judge: acceptance collapse (tau ~1) and per-position decay toward the block's end.

Hand-written counts for the shapes that must and must not alarm, and the captured real vLLM windows
(``broken``: target layers shifted, tau 1.13 - a drop, but not a collapse by its interval).
"""

from __future__ import annotations

from dflash_doctor.telemetry.alarms import apply_alarms
from dflash_doctor.telemetry.counts import SeriesKey, SpecCounts
from dflash_doctor.telemetry.server_metrics import read_exposition
from dflash_doctor.telemetry.exposition import parse_exposition
from dflash_doctor.telemetry.verdict import Baseline, BaselineEntry, Judge, Thresholds, WindowVerdict
from dflash_doctor.telemetry.watcher import Window
from telemetry_fixtures import DATA

MODEL = SeriesKey("qwen3-8b")
BASE_RATES = (0.6, 0.5, 0.4, 0.3)  # a check run's per-position rates, K = 4, tau 2.8


def judged(
    per_pos: tuple[float, ...], drafts: float = 1000.0, baseline_rates: tuple[float, ...] | None = BASE_RATES
) -> WindowVerdict:
    counts = SpecCounts(
        num_drafts=drafts,
        num_draft_tokens=4 * drafts,
        num_accepted_tokens=sum(per_pos),
        num_accepted_tokens_per_pos=per_pos,
        num_generated_tokens=drafts + sum(per_pos),
    )
    entry = BaselineEntry(tau=1.0 + sum(BASE_RATES), tau_ci=(2.7, 2.9), rates=baseline_rates)
    judge = Judge(Baseline({"overall": entry}, "check run"), Thresholds(min_drafts=50), server_kind="vllm")
    return apply_alarms(judge.judge(Window(MODEL, 0.0, 300.0, counts, [counts])), judge)


def kinds(verdict: WindowVerdict) -> list[str]:
    return sorted(a.kind for a in verdict.alerts)


def test_collapse_to_tau_one_alarms_with_the_fallback_advice():
    verdict = judged((20.0, 5.0, 1.0, 0.0))  # tau 1.026 over 1000 drafts
    assert "collapse" in kinds(verdict) and verdict.status == "alert"
    (collapse,) = [a for a in verdict.alerts if a.kind == "collapse"]
    assert "tau 1.03" in collapse.message
    assert any("num_speculative_tokens_per_batch_size" in line for line in collapse.advice)


def test_too_few_drafts_near_tau_one_is_not_a_collapse():
    verdict = judged((3.0, 1.0, 0.0, 0.0), drafts=60)  # tau 1.07, but 60 drafts: the interval reaches 1.14
    assert verdict.mean_acceptance_length < 1.1 and verdict.mean_acceptance_length_ci[1] > 1.1
    assert "collapse" not in kinds(verdict)


def test_a_real_drop_is_not_a_collapse():
    counts = read_exposition(
        parse_exposition((DATA / "vllm_metrics_broken.txt").read_text()), server_kind="vllm", default_model="x"
    ).counts[SeriesKey("smollm2-dflash")]
    judge = Judge(Baseline.fixed({"overall": 1.56}), Thresholds(min_drafts=50), server_kind="vllm")
    verdict = apply_alarms(judge.judge(Window(SeriesKey("smollm2-dflash"), 0.0, 300.0, counts, [counts])), judge)
    assert kinds(verdict) == ["acceptance-drop"]


def test_tail_decay_while_position_zero_holds_alarms_on_the_decayed_positions():
    verdict = judged((600.0, 480.0, 100.0, 20.0))
    assert kinds(verdict) == ["acceptance-drop", "position-decay"]
    (decay,) = [a for a in verdict.alerts if a.kind == "position-decay"]
    assert "position(s) 2, 3 accept under 0.5x" in decay.message
    assert "r_2 0.100 vs 0.400" in decay.message


def test_no_decay_alarm_when_the_whole_block_dropped_or_all_is_well_or_no_baseline_rates():
    assert "position-decay" not in kinds(judged((300.0, 150.0, 100.0, 20.0)))  # position 0 dropped too
    assert kinds(judged((610.0, 490.0, 410.0, 290.0))) == []
    assert "position-decay" not in kinds(judged((600.0, 480.0, 100.0, 20.0), baseline_rates=None))


def test_windows_without_a_verdict_get_no_alarm():
    verdict = judged((1.0, 0.0, 0.0, 0.0), drafts=20)  # under min_drafts
    assert verdict.status == "too-few-drafts" and verdict.alerts == []
