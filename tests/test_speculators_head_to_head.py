"""`check --draft A --draft B`: the head-to-head table and verdict agree with each speculator's own check."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from cli_helpers import assert_usage_error, invoke, pair_args
from dashboard_app import open_app
from dflash_doctor.engine.batched import generate_greedy_batch
from dflash_doctor.replay import stream
from dflash_doctor.report.head_to_head import table_rows, verdicts
from dflash_doctor.report.sanitize import for_markdown_text
from dflash_doctor.rundir.run_record import StepCosts
from dflash_doctor.stats.head_to_head import read_head_to_head

NGRAM = "ngram:prompt_lookup_min=1,prompt_lookup_max=3"
PROFILE = {
    "t_decode_s": 0.010,
    "t_verify_s": {"1": 0.011, "4": 0.013, "8": 0.016},
    "t_draft_s": {"1": 0.001, "8": 0.004},
}


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("h2h")
    profile = root / "costs.json"
    profile.write_text(json.dumps(PROFILE))
    extra = ("--cost-profile", str(profile), "--k", "1-4")
    generated: list[int] = []  # prompts per batched greedy call of the head-to-head

    def counting(model, prompts, **kwargs):
        generated.append(len(prompts))
        return generate_greedy_batch(model, prompts, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stream, "generate_greedy_batch", counting)
        both = invoke(
            "check", *pair_args(tiny_dir, tiny_dir / "ar", "--draft", NGRAM, *extra, "--out", root / "both", "--json")
        )
    assert both.exit_code in (0, 1), both.output
    data = json.loads(both.stdout[both.stdout.index("{") :])
    # the target's answers are generated once, by the first speculator's replay, and reused by the second
    assert sum(generated) == len(pd.read_parquet(root / "both" / "ar" / "requests.parquet"))
    single = {}
    for name, draft in (("ar", tiny_dir / "ar"), ("ngram", NGRAM)):
        result = invoke("check", *pair_args(tiny_dir, draft, *extra, "--out", root / name))
        assert result.exit_code in (0, 1), result.output
        single[name] = root / name
    return root, data, single


def test_table_agrees_with_each_speculators_own_check(runs):
    root, data, single = runs
    table = data["head_to_head"]
    assert [s["name"] for s in table["speculators"]] == ["ar", "ngram"]
    assert json.loads((root / "both" / "head_to_head.json").read_text()) == table
    assert "Verdict" in (root / "both" / "head_to_head.md").read_text()
    costs = StepCosts(
        t_decode_s=PROFILE["t_decode_s"],
        t_verify_s={int(k): v for k, v in PROFILE["t_verify_s"].items()},
        t_draft_s={int(k): v for k, v in PROFILE["t_draft_s"].items()},
    )
    for name, folder in single.items():
        own = json.loads((folder / "run.json").read_text())
        steps = pd.read_parquet(folder / "steps.parquet")
        assert steps.equals(pd.read_parquet(root / "both" / name / "steps.parquet"))  # the same replay
        for scope, result in table["scopes"].items():
            row = next(r for r in result["rows"] if r["speculator"] == name)
            sweep = own["summary"]["sweep"]["overall" if scope == "overall" else "by_class"]
            sweep_rows = sweep if scope == "overall" else sweep[scope]
            at_best = next(r for r in sweep_rows if r["k"] == row["best_k"])
            assert row["tau"] == pytest.approx(at_best["mean_acceptance_length"])
            assert row["tau_ci"] == pytest.approx(at_best["mean_acceptance_length_ci"])
            metrics = own["summary"]["overall"] if scope == "overall" else own["summary"]["by_class"][scope]
            assert row["acceptance_rate_per_pos"] == pytest.approx(metrics["acceptance_rate_per_pos"], nan_ok=True)
            # the largest K's speedup, priced independently from the check's own steps: every step costs the draft
            # at K plus the verify of what it really drafted, a plain decode step when it drafted nothing
            scoped = steps if scope == "overall" else steps[steps["class"] == scope]
            k_max = int(steps["k"].max())
            emitted = (scoped["num_accepted"] + 1).sum()
            seconds = sum(
                costs.draft_s(k_max) + (costs.verify_s(n) if n else costs.t_decode_s) for n in scoped["num_drafted"]
            )
            assert row["speedup_by_k"][str(k_max)] == pytest.approx(emitted * costs.t_decode_s / seconds)
            assert row["speedup"] == pytest.approx(next(r for r in sweep_rows if r["k"] == row["best_k"])["speedup"])
            best = max(sorted(row["speedup_by_k"], key=int), key=lambda k: row["speedup_by_k"][k])
            assert int(best) == row["best_k"]
            assert row["speedup_ci"][0] <= row["speedup"] + 1e-9 <= row["speedup_ci"][1] + 2e-9


def test_verdict_names_the_faster_speculator(runs):
    _, data, _ = runs
    for scope, result in data["head_to_head"]["scopes"].items():
        rows = {r["speculator"]: r for r in result["rows"]}
        verdict = result["verdict"]
        fastest = max(rows, key=lambda name: rows[name]["speedup"])
        if rows[fastest]["speedup"] < 1:
            assert verdict["winner"] is None and "plain decoding" in verdict["text"]
            continue
        other = next(name for name in rows if name != fastest)
        assert verdict["winner"] == fastest and verdict["runner_up"] == other
        assert fastest in verdict["text"]
        if verdict["ratio"] is None:  # too few conversations or drafted steps to name a winner on
            assert not verdict["decisive"] and "too few requests" in verdict["text"]
            continue
        assert verdict["ratio"] == pytest.approx(rows[fastest]["speedup"] / rows[other]["speedup"])
        assert verdict["decisive"] == (verdict["ratio_ci"][0] > 1 and rows[fastest]["speedup_ci"][0] >= 1)
        assert verdict["text"].startswith(("overall: deploy", f"for {scope}: deploy")) == verdict["decisive"]


def test_the_dashboard_page_shows_the_same_table_verdict_and_curves(runs, monkeypatch):
    """The Head-to-head page (Streamlit's AppTest) on the runs folder: the verdicts, the table the terminal and the
    reports print (same cells), and one curve per speculator for the scope picked."""
    root, data, _ = runs
    table = json.loads((root / "both" / "head_to_head.json").read_text())  # --json holds the same, its keys sorted
    assert table == data["head_to_head"]
    typed = read_head_to_head(root / "both")
    page = open_app(monkeypatch, root, page="head_to_head")
    shown = page.dataframe[0].value
    assert shown.values.tolist() == table_rows(typed)
    markdown = " ".join(str(m.value) for m in page.markdown)
    assert all(for_markdown_text(text) in markdown for text in verdicts(typed))
    chart = json.loads(page.get("plotly_chart")[0].proto.spec)
    assert sorted(trace["name"] for trace in chart["data"]) == sorted(s.name for s in typed.speculators)


def test_several_drafts_refuse_a_scenario(tiny_dir):
    result = invoke("check", *pair_args(tiny_dir, tiny_dir / "ar", "--draft", "ngram", "--scenario", "layer-offset"))
    assert_usage_error(result, "--scenario")


def test_every_speculator_is_priced_with_the_verify_times_of_the_widest_timing():
    """A block drafter of 8 slots times verification up to K = 7 and n-gram lookup up to 8: the shared target
    times come from the wider one, so the lookup's K = 8 is priced (it raised "K=8 was asked" before)."""
    from dflash_doctor.stats.head_to_head import _shared_costs

    block = StepCosts(t_decode_s=0.01, t_verify_s={1: 0.011, 4: 0.012, 7: 0.014}, t_draft_s={1: 0.002, 7: 0.003})
    lookup = StepCosts(t_decode_s=0.02, t_verify_s={1: 0.021, 4: 0.022, 8: 0.025}, t_draft_s={1: 0.0001, 8: 0.0001})
    shared = _shared_costs([block, lookup])
    assert [c.t_verify_s for c in shared] == [lookup.t_verify_s] * 2 and [c.t_decode_s for c in shared] == [0.02] * 2
    assert [c.t_draft_s for c in shared] == [block.t_draft_s, lookup.t_draft_s]
    assert shared[1].speedup(2.0, 8) == pytest.approx(2.0 * 0.02 / (0.0001 + 0.025))
