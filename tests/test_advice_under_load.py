"""The same small check twice on one machine, once with CPU-burning processes beside it: the two runs give the
same advice, or one of them says it is uncertain; never opposite confident advice (speculate vs off).

This is the failure the step-cost intervals exist for: one busy spell used to move a median enough to flip a
class from "speculation off" to "K=4, 2.3x". The burners take every core the machine has, so the second timing
sees the preemption a busy shared runner gives.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pandas as pd

from cli_helpers import invoke, pair_args


def _burn(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        sum(i * i for i in range(10_000))


def _check(tiny_dir, out) -> dict:
    result = invoke(
        "check",
        *pair_args(
            tiny_dir,
            tiny_dir / "dflash",
            "--k",
            "1-5",
            "--max-requests",
            "6",
            "--timing-budget",
            "4",
            "--out",
            out,
            "--only",
            "timing",
        ),
    )
    assert result.exit_code in (0, 1), result.output
    return json.loads((out / "run.json").read_text())


def test_a_busy_machine_never_turns_confident_advice_into_its_opposite(tiny_dir, tmp_path):
    quiet = _check(tiny_dir, tmp_path / "quiet")
    burners = [
        multiprocessing.get_context("spawn").Process(target=_burn, args=(time.monotonic() + 120,), daemon=True)
        for _ in range(os.cpu_count() or 2)
    ]
    for burner in burners:
        burner.start()
    try:
        busy = _check(tiny_dir, tmp_path / "busy")
    finally:
        for burner in burners:
            burner.kill()
    assert quiet["recommendation"].keys() == busy["recommendation"].keys()
    for scope, first in quiet["recommendation"].items():
        second = busy["recommendation"][scope]
        if first["confidence"] == second["confidence"] == "clear":
            assert (first["k"] > 0) == (second["k"] > 0), (scope, first, second)
        for run in (first, second):
            assert run["confidence"] in ("clear", "uncertain", "unreliable")
            if run["confidence"] == "unreliable":
                assert run["k"] == 0 and run["reason"].startswith("No advice")
    for run, folder in ((quiet, tmp_path / "quiet"), (busy, tmp_path / "busy")):
        samples = pd.read_parquet(folder / "costs.parquet")
        assert set(samples["kind"]) == {"decode", "verify", "draft"}
        repeats = samples.groupby(["kind", "k"]).size()
        assert repeats.min() >= 6
        assert run["summary"]["sweep"]["costs"]["spread"]["repeats"]["decode"] == int(repeats.loc[("decode", 0)])
        assert all(
            row["speedup_ci"][0] <= row["speedup"] <= row["speedup_ci"][1] for row in run["summary"]["sweep"]["overall"]
        )
