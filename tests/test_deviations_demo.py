"""Deviation analysis on the real demo pair: a chat-template change shows up as special-token rejections.

The template-mismatch scenario serves SmolLM2 with another system prompt ("answer in as few words as
possible"), so the target ends its answers early with ``<|im_end|>``, a token the draft - trained on
the default prompt - does not expect there. The healthy run's answers run to the token budget instead.
One engine load serves both runs (the scenario only swaps the chat template); few requests, short budget.
"""

from __future__ import annotations

import dataclasses

import pytest

from dflash_doctor import deviations, runner, scenarios
from dflash_doctor.config import build_config
from dflash_doctor.schema import load_run

pytestmark = pytest.mark.integration

NUM_REQUESTS = 6  # two per class
MAX_NEW_TOKENS = 48
TOP_PAIRS = 3  # "a top pattern": among a class's three costliest first-rejection pairs


@pytest.fixture(scope="module")
def demo_pair_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    config = build_config(max_requests=NUM_REQUESTS, max_new_tokens=MAX_NEW_TOKENS, seed=0)
    engine = runner.load_engine(config)
    config = dataclasses.replace(config, k=(runner.default_k(engine),))
    runs = {}
    for name in ("healthy", "template-mismatch"):  # healthy first: the scenario only swaps the engine's chat template
        requests = runner.select_requests(config)
        if name != "healthy":
            requests, config = scenarios.get_scenario(name).apply(engine, requests, config)
        meta = runner.start_meta(config, engine, "check")
        runner.teacher_replay(engine, requests, config, root / name, meta)
        runs[name] = load_run(root / name)
    return runs


def _special_pairs(run, top: int) -> list[dict]:
    """First-rejection pairs among each class's ``top`` costliest with a special token on either side."""
    analysis = deviations.analyze_run(run)
    return [pair for summary in analysis["by_class"].values() for pair in summary["top_pairs"][:top]
            if "special" in (pair["category"], pair["draft_category"])]


def test_template_mismatch_makes_template_tokens_a_top_rejection_pattern(demo_pair_runs):
    special = _special_pairs(demo_pair_runs["template-mismatch"], TOP_PAIRS)
    assert special and all("<|im_end|>" in (p["target_text"], p["draft_text"]) for p in special)
    assert _special_pairs(demo_pair_runs["healthy"], deviations.DEFAULT_TOP_N) == []


def test_compare_lists_special_tokens_among_the_patterns_that_grew(demo_pair_runs):
    base, new = (deviations.run_tables(demo_pair_runs[name]) for name in ("healthy", "template-mismatch"))
    grown = deviations.grown_patterns(base, new)
    assert any(row["pattern"] == "special" and row["lost_per_draft_base"] == 0 for row in grown)
    healthy = base.decided
    assert not (healthy["first_rejection"] & ((healthy["category"] == "special") | (healthy["draft_category"] == "special"))).any()


def test_recorded_columns_come_from_the_real_tokenizer(demo_pair_runs):
    tokens = demo_pair_runs["healthy"].tokens
    for column in ("target_category", "draft_category"):
        assert tokens[column].notna().all() and set(tokens[column]) <= set(deviations.CATEGORIES)
    margin = tokens["target_top1_margin"]
    assert ((margin >= 0) & (margin <= 1)).all()
