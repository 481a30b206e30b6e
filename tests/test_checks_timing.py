"""timing: step timings that break the cost model's physics beyond their noise are named, and the advice withheld."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dflash_doctor.checks import CheckContext, make_check
from dflash_doctor.rundir.run_record import RunMeta, RunRecord, Summary
from dflash_doctor.stats.speedup import build_sweep, load_cost_profile
from dflash_doctor.stats.step_costs import DECODE, CostSamples, fitted_costs, physics_violations

STEPS = pd.DataFrame(
    [
        {
            "request_id": f"r{i}",
            "class": "chat",
            "step": j,
            "position": 0,
            "k": 4,
            "num_drafted": 4,
            "num_accepted": (i + j) % 5,
        }
        for i in range(6)
        for j in range(10)
    ]
)


def _record(seconds: dict, *, retimed_violations: bool) -> RunRecord:
    samples = CostSamples({key: tuple(v) for key, v in seconds.items()}, device="cpu", flat_draft=True)
    if retimed_violations:
        samples = CostSamples(
            samples.seconds,
            device="cpu",
            flat_draft=True,
            retimed=(("verify", 4),),
            violations=tuple(physics_violations(samples)),
        )
    priced = build_sweep({4: STEPS}, fitted_costs(samples), {4: "exact"}, cost_samples=samples, n_boot=50)
    return RunRecord(meta=RunMeta(command="check"), summary=Summary(sweep=priced.sweep))


def _quiet(rng: np.random.Generator) -> dict:
    return {
        DECODE: 0.010 * rng.lognormal(0, 0.01, 12),
        ("verify", 4): 0.012 * rng.lognormal(0, 0.01, 12),
        ("draft", 4): 0.002 * rng.lognormal(0, 0.01, 12),
    }


def _broken() -> dict:
    tight = np.array([1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0])
    return {DECODE: 0.321 * tight, ("verify", 4): 0.199 * tight, ("draft", 4): 0.01 * tight}


def test_timing_pass_when_the_medians_obey_the_physics():
    result = make_check("timing").run(
        CheckContext(record=_record(_quiet(np.random.default_rng(0)), retimed_violations=True))
    )
    assert result.status == "pass" and result.metrics["violations"] == []
    assert result.metrics["half_widths"]["decode"] <= 0.05


def test_timing_warn_names_a_verify_cheaper_than_a_decode_after_the_retiming():
    result = make_check("timing").run(CheckContext(record=_record(_broken(), retimed_violations=True)))
    assert (
        result.status == "warn" and "changed while they were taken" in result.summary and "withheld" in result.summary
    )
    (finding,) = result.findings
    assert "a verify of 5 tokens" in finding.evidence and "verify@4" in finding.evidence
    assert "--timing-budget" in finding.fix


def test_timing_warns_once_for_the_kernels_own_order_and_lists_every_break():
    """Breaks the re-timing reproduced are this machine's kernels: one warning (not one per pair) saying the costs
    of those Ks are pooled, every break in its evidence; nothing is withheld, so fail_on_violation does not fail."""
    seconds = {key: tuple(v) for key, v in _broken().items()}
    effects = ("a verify of 5 tokens timed 199 ms, below a decode step at 321 ms", "another break")
    samples = CostSamples(seconds, device="cpu", flat_draft=True, shape_effects=effects, shape_effect_ks=(4,))
    priced = build_sweep({4: STEPS}, fitted_costs(samples), {4: "exact"}, cost_samples=samples, n_boot=50)
    record = RunRecord(meta=RunMeta(command="check"), summary=Summary(sweep=priced.sweep))
    result = make_check("timing", {"fail_on_violation": True}).run(CheckContext(record=record))
    (finding,) = result.findings
    assert (
        result.status == "warn" and "2 breaks" in finding.message and "the costs of K 4 are pooled" in finding.message
    )
    assert all(effect in finding.evidence for effect in effects)


def test_timing_fail_when_the_config_asks_a_broken_timing_to_fail():
    result = make_check("timing", {"fail_on_violation": True}).run(
        CheckContext(record=_record(_broken(), retimed_violations=True))
    )
    assert result.status == "fail"


def test_timing_skip_for_a_cost_profile(tmp_path):
    path = tmp_path / "costs.toml"
    path.write_text('t_decode_s = 0.01\nt_draft_s = 0.001\nt_verify_s = 0.012\ndevice = "H200"\n', encoding="utf-8")
    priced = build_sweep({4: STEPS}, load_cost_profile(path), {4: "exact"}, n_boot=20)
    record = RunRecord(meta=RunMeta(command="check"), summary=Summary(sweep=priced.sweep))
    result = make_check("timing").run(CheckContext(record=record))
    assert result.status == "skip" and "H200" in result.summary
