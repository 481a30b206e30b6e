"""The demo draft's published figures are what a fresh run on the CPU gives.

The README's default-check excerpt, docs/benchmarks.md's demo-pair paragraph and scenario table, and the
draft card's CPU table all quote the
teacher-forced acceptance of `sweep --workload demo --k 15` (24 requests, 36 turns, 128 new tokens, float32
target). Those figures are deterministic on the CPU (fixed greedy text, seeded bootstrap), so a retrained
draft whose documents were not re-measured, or a change in the engine that moves acceptance, fails here
instead of leaving the README quoting another draft. Step costs and speedups are not checked: they are
measured on the machine and move from run to run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.models.loading import DEMO_DRAFT_DIR
from dflash_doctor.rundir.load import load_run
from tiny_models import torch_threads

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
CLASSES = ("overall", "chat", "code", "math")


@pytest.fixture(scope="module")
def demo_summary(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("demo-figures") / "run"
    with torch_threads(2):
        result = CliRunner().invoke(app, ["sweep", "--workload", "demo", "--k", "15", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = load_run(out).meta["summary"]
    return {"overall": summary["overall"], **summary["by_class"]}


def _tau(metrics: dict) -> str:
    low, high = metrics["mean_acceptance_length_ci"]
    return f"{metrics['mean_acceptance_length']:.2f} [{low:.2f}, {high:.2f}]"


def test_readme_check_excerpt_quotes_a_fresh_run(demo_summary):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for name in CLASSES:
        metrics = demo_summary[name]
        row = re.search(rf"│ {name}\s+│ (\d+)\s+│ ([\d.]+) │ (\[[\d., ]+\]) │ ([\d., ]+?)\s+│", readme)
        assert row is not None, f"README's acceptance table has no {name} row"
        low, high = metrics["mean_acceptance_length_ci"]
        positions = ", ".join(f"{p:.2f}" for p in metrics["acceptance_rate_per_pos"][:5])
        assert (row[2], row[3], row[4]) == (
            f"{metrics['mean_acceptance_length']:.2f}",
            f"[{low:.2f}, {high:.2f}]",
            positions,
        ), name


def test_benchmarks_demo_paragraph_scenarios_and_card_quote_a_fresh_run(demo_summary):
    benchmarks = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    taus = {name: f"{demo_summary[name]['mean_acceptance_length']:.2f}" for name in CLASSES}
    sentence = f"tau {taus['overall']} overall, chat {taus['chat']}, code {taus['code']}, math {taus['math']}"
    assert sentence in " ".join(benchmarks.split()), f"docs/benchmarks.md's demo-pair paragraph should say: {sentence}"
    dflash_scenarios = benchmarks.split("### Failure scenarios on the demo pair")[1].split("\n#")[
        0
    ]  # the DFlash draft's table
    scenario_rows = re.findall(r"^\| `[a-z-]+` \| `[a-z-]+` \| (.+) \|$", dflash_scenarios, flags=re.MULTILINE)
    assert len(scenario_rows) == 5, scenario_rows
    for row in scenario_rows:  # "before" is the healthy pair, this run
        assert [cell.split(" -> ")[0] for cell in row.split(" | ")] == [taus[name] for name in CLASSES], row

    card = (DEMO_DRAFT_DIR / "README.md").read_text(encoding="utf-8")
    for name in CLASSES:
        row = re.search(rf"^\| {name} \| \d+ \| ([\d.]+ \[[\d., ]+\]) \|", card, flags=re.MULTILINE)
        assert row is not None and row[1] == _tau(demo_summary[name]), (name, row and row[1], _tau(demo_summary[name]))
