"""acceptance: thresholds, per-position collapse, a class left behind, suspiciously perfect acceptance."""

from __future__ import annotations

from dflash_doctor.checks import CheckContext, run_checks
from checks_fixtures import metrics, record


def _metrics(tau, conditional=(0.9, 0.8, 0.7), rate=0.6, drafts=200):
    return metrics(
        num_drafts=drafts,
        mean_acceptance_length=tau,
        mean_acceptance_length_ci=[tau - 0.1, tau + 0.1],
        conditional_acceptance_rate_per_pos=list(conditional),
        draft_acceptance_rate=rate,
    )


def _check(overall, by_class=None, params=None):
    ctx = CheckContext(record=record(overall=overall, by_class=by_class))
    return run_checks(ctx, only=["acceptance"], params={"acceptance": params or {}})[0]


def test_acceptance_pass_healthy_run():
    result = _check(_metrics(4.5), {"math": _metrics(5.0), "code": _metrics(4.2)})
    assert result.status == "pass"
    assert result.summary == "tau 4.50 overall; every class above 2.0"


def test_acceptance_warn_low_tau_class_collapse_and_gap():
    result = _check(
        _metrics(3.5),
        {"math": _metrics(5.0), "code": _metrics(4.8), "chat": _metrics(1.8, conditional=(0.5, 0.2, 0.1))},
    )
    assert result.status == "warn"
    messages = [f.message for f in result.findings]
    assert "class chat: mean acceptance length 1.80 is below 2.0" in messages
    assert "class chat: acceptance collapses at draft slot 2 (conditional rate 0.20)" in messages
    assert "class chat is far below the other classes: tau 1.80 vs median 4.90" in messages


def test_acceptance_fail_below_hard_threshold_and_params_apply():
    result = _check(_metrics(1.2))
    assert result.status == "fail" and "1.20 is below 1.3" in result.summary
    assert _check(_metrics(1.2), params={"tau_fail_below": 1.1, "tau_warn_below": 1.15}).status == "pass"


def test_acceptance_fail_suspiciously_perfect():
    result = _check(
        _metrics(16.0, conditional=(1.0,) * 3, rate=1.0), {"math": _metrics(16.0, conditional=(1.0,) * 3, rate=1.0)}
    )
    assert result.status == "fail"
    assert "suspiciously perfect" in result.summary


def test_acceptance_skip_when_too_few_drafts():
    result = _check(_metrics(1.0, drafts=3))
    assert result.status == "skip" and "at least 20 drafts" in result.summary
