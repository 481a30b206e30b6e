"""A call trace of one `dflash-doctor check` on a tiny pair, as the budget of work one run may do: run.json is written
twice (when the run starts, so the folder is recognisable, and once at the end), the only Parquet read is
the report's token viewer reading tokens.parquet back, every prompt is encoded once, the deviation analysis
is computed once for every report format and the terminal, and every stage of docs/architecture.md's step
list runs once, in that order.

The counts come from ``sys.setprofile``: every Python call during the command is seen, so a second
read-back or re-encoding anywhere (a view, a check, a probe) shows up here.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
from typer.testing import CliRunner

from dflash_doctor import pipeline, report
from dflash_doctor.inputs import workloads
from dflash_doctor.models import pair
from dflash_doctor.replay import probes, stream, turns
from dflash_doctor.rundir import writer
from dflash_doctor.stats import deviations, metrics, speedup
from dflash_doctor.checks import base as checks_base
from dflash_doctor.cli import app
from cli_helpers import pair_args
from tiny_models import CLASSES

# The stages of one check, in docs/architecture.md's order: each is entered exactly once.
STAGES = {
    "load_workload": workloads.load_workload,
    "load_pair": pair.load_pair,
    "replay_teacher": stream.replay_teacher,
    "summarize": metrics.summarize,
    "build_sweep": speedup.build_sweep,
    "recommend": speedup.recommend,
    "lossless_probe": probes.lossless_probe,
    "layer_offset_probe": probes.layer_offset_probe,
    "run_checks": checks_base.run_checks,
    "render_reports": report.render_reports,
}
COUNTED = {
    "run.json writes": writer.write_run_json,
    "Parquet reads": pq.read_table,
    "prompt encodings": workloads.encode_request_turn,
    "chat template renders": workloads.encode_turn,
    "run_check": pipeline.run_check,
    "run_turns": turns.run_turns,
    "deviation analyses": deviations.analyze_run,
}


def _code(function) -> object:
    """The code object that runs when ``function`` is called (under decorators such as ``torch.inference_mode``)."""
    return inspect.unwrap(function).__code__


def trace_check(args: list[str]) -> tuple[Counter[str], list[str], object]:
    """Run `check` with a profiler counting calls of COUNTED and
    STAGES (by code object), and the first-entry order of STAGES."""
    names = {_code(f): name for name, f in {**COUNTED, **STAGES}.items()}
    counts: Counter[str] = Counter()
    order: list[str] = []
    entered: set[object] = set()  # a generator's frame gets a "call" event at every resume: count it once

    def profile(frame, event, _arg):
        if event == "call" and (name := names.get(frame.f_code)) is not None and frame not in entered:
            entered.add(frame)
            counts[name] += 1
            if name in STAGES and name not in order:
                order.append(name)

    sys.setprofile(profile)
    try:
        result = CliRunner().invoke(app, [str(a) for a in args])
    finally:
        sys.setprofile(None)
    return counts, order, result


def test_check_writes_run_json_twice_reads_one_table_back_and_encodes_each_prompt_once(tiny_dir, tmp_path):
    out = tmp_path / "check"
    counts, order, result = trace_check(["check", *pair_args(tiny_dir, tiny_dir / "dflash", "--k", "4", "--out", out)])
    assert result.exit_code in (0, 1), result.output  # 1: a check fails on random tiny weights; never a crash
    num_requests = 2 * len(CLASSES)  # the tiny_dir fixture (conftest.py): 2 single-turn requests per class
    assert counts["run_check"] == 1
    assert counts["run.json writes"] == 2
    assert counts["Parquet reads"] == 1  # tokens.parquet for the report's token viewer (never held in memory)
    assert counts["prompt encodings"] == num_requests
    assert counts["chat template renders"] == num_requests
    assert counts["deviation analyses"] == 1  # shared by report.html / .md / .json and the terminal
    assert {name: counts[name] for name in STAGES} == {name: 1 for name in STAGES}
    assert order == list(STAGES)
    assert Path(out / "report.html").is_file()


def test_check_prices_the_k_values_asked_for(tiny_dir, tmp_path):
    """`check --k 2,4` prices K 2 and 4 and recommends among them (4 is served); `--k 3` prices every K from 1
    to the draft's default beside the served 3, and the progress line names the K values it prices."""
    priced = {}
    for asked in ("2,4", "3"):
        out = tmp_path / asked.replace(",", "-")
        result = CliRunner().invoke(
            app, ["check", *map(str, pair_args(tiny_dir, tiny_dir / "dflash", "--k", asked, "--out", out))]
        )
        assert result.exit_code in (0, 1), result.output
        run = json.loads((out / "run.json").read_text())
        assert run["served_k"] == max(int(k) for k in asked.split(","))
        priced[asked] = [row["k"] for row in run["summary"]["sweep"]["overall"]]
        for per_scope in run["recommendation"].values():
            assert per_scope["k"] in (0, *priced[asked]) and f"K={max(priced[asked]) + 1}" not in per_scope["reason"], (
                per_scope
            )
    assert priced["2,4"] == [2, 4]
    assert priced["3"][0] == 1 and priced["3"] == list(range(1, priced["3"][-1] + 1)) and priced["3"][-1] >= 3
    assert pipeline.check_sweep_ks((), 6) == (1, 2, 3, 4, 5, 6) and pipeline.check_sweep_ks((9,), 6)[-1] == 9
    assert (
        pipeline.k_text([2, 4, 8]) == "2, 4, 8"
        and pipeline.k_text(range(1, 16)) == "1-15"
        and pipeline.k_text([3, 4]) == "3, 4"
    )
