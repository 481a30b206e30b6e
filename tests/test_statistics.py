"""One statistics module: the run summary, `compare` and the dashboard show the same tau and interval.

The regression this holds: ``compare`` counted every step as a draft (vLLM counts only steps that drafted), so for steps
(4 drafted, 2 accepted), (4, 3), (0, 0) the summary said tau 3.5 and compare 2.67; and there were three
bootstrap implementations giving three intervals for one run.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from dflash_doctor.app import data
from dflash_doctor.report.comparison import compare_runs
from dflash_doctor.stats.metrics import summarize
from dflash_doctor.rundir.load import load_run
from dflash_doctor.rundir.tables import REQUESTS_SCHEMA, STEPS_SCHEMA
from dflash_doctor.rundir.run_record import RunMeta, RunRecord
from dflash_doctor.rundir.writer import RunWriter, utc_now
from fixture_runs import make_fixture_run


def _write_run(run_dir, steps: list[tuple[str, str, int, int]]):
    """A run directory from (request id, class, num_drafted, num_accepted) steps at K = 4."""
    step_rows = [
        {
            "request_id": rid,
            "class": cls,
            "step": i,
            "position": i,
            "k": 4,
            "num_drafted": drafted,
            "num_accepted": accepted,
            "bonus_token": 1,
            "draft_time_s": 0.0,
            "verify_time_s": 0.0,
        }
        for i, (rid, cls, drafted, accepted) in enumerate(steps)
    ]
    request_rows = []
    for rid in dict.fromkeys(r["request_id"] for r in step_rows):
        mine = [r for r in step_rows if r["request_id"] == rid]
        request_rows.append(
            {
                "request_id": rid,
                "class": mine[0]["class"],
                "subclass": "",
                "turn": 0,
                "prompt_num_tokens": 3,
                "output_token_ids": [1] * sum(r["num_accepted"] + 1 for r in mine),
                "output_text": "x",
                "num_output_tokens": sum(r["num_accepted"] + 1 for r in mine),
                "num_steps": len(mine),
                "num_drafts": sum(r["num_drafted"] > 0 for r in mine),
                "num_draft_tokens": sum(r["num_drafted"] for r in mine),
                "num_accepted_tokens": sum(r["num_accepted"] for r in mine),
                "tau": None,
                "stop_reason": "max_new_tokens",
                "wall_time_s": 0.0,
            }
        )
    meta = RunRecord(meta=RunMeta(command="replay", created_at=utc_now()), config={"k": [4], "seed": 0}).to_json()
    with RunWriter(run_dir, meta) as writer:
        writer.add("requests", request_rows)
        writer.add("steps", step_rows)
        writer.flush()
        record = RunRecord.from_json(meta)
        record.summary = summarize(
            pd.DataFrame(step_rows, columns=list(STEPS_SCHEMA.names)),
            pd.DataFrame(request_rows, columns=list(REQUESTS_SCHEMA.names)),
        )
        writer.meta = record.to_json()
    return run_dir


def test_compare_counts_only_steps_that_drafted_as_drafts(tmp_path):
    run_dir = _write_run(tmp_path / "run", [("a", "chat", 4, 2), ("a", "chat", 4, 3), ("a", "chat", 0, 0)])
    summary_tau = load_run(run_dir).meta["summary"]["overall"]["mean_acceptance_length"]
    assert summary_tau == pytest.approx(3.5)
    overall = next(r for r in compare_runs(run_dir, run_dir).rows if r.cls == "overall" and r.slot is None)
    assert overall.base == pytest.approx(3.5) and overall.new == pytest.approx(3.5)


def test_summary_compare_and_dashboard_show_the_same_tau_and_interval(tmp_path):
    run_dir = make_fixture_run(tmp_path / "run", seed=3)
    run = load_run(run_dir)
    summary = run.meta["summary"]
    scopes = {"overall": summary["overall"], **summary["by_class"]}
    compared = {r.cls: r for r in compare_runs(run_dir, run_dir).rows if r.slot is None}
    dashboard = data.class_table(run.record.summary, run.requests, seed=3).set_index("class")
    assert set(compared) == set(scopes) == set(dashboard.index)
    for scope, metrics in scopes.items():
        tau = metrics["mean_acceptance_length"]
        lo, hi = metrics["mean_acceptance_length_ci"]
        assert lo < tau < hi and not math.isnan(lo)
        assert (compared[scope].base, *compared[scope].base_ci) == pytest.approx((tau, lo, hi), rel=0, abs=0)
        assert (compared[scope].new, *compared[scope].new_ci) == pytest.approx((tau, lo, hi), rel=0, abs=0)
        row = dashboard.loc[scope]
        assert (row["tau"], row["tau_lo"], row["tau_hi"]) == pytest.approx((tau, lo, hi), rel=0, abs=0)
    # per-position rates too: compare's r_i and interval are the summary's
    rate_rows = [r for r in compare_runs(run_dir, run_dir).rows if r.cls == "overall" and r.slot is not None]
    assert [r.base for r in rate_rows] == pytest.approx(summary["overall"]["acceptance_rate_per_pos"])
    assert [list(r.base_ci) for r in rate_rows] == summary["overall"]["acceptance_rate_per_pos_ci"]
