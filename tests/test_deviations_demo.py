"""Deviation analysis on the real demo pair: a chat-template change shows up as template-token rejections.

The template-mismatch scenario serves SmolLM2 with another system prompt ("answer in as few words as
possible"), so turn boundaries move: the target ends some answers early with ``<|im_end|>`` where the draft -
trained on the default prompt - goes on, and the draft sometimes proposes it where the target goes on. The
healthy run never rejects at a special token. One pair load serves both runs (the scenario only swaps the chat
template); six requests, 48 new tokens (about 8 CPU-minutes on the demo pair, both runs).
"""

from __future__ import annotations

import pytest

from dflash_doctor.replay import scenarios
from dflash_doctor.stats import deviations
from dflash_doctor.inputs.config import build_config
from dflash_doctor.models.pair import load_pair
from dflash_doctor.rundir.run_record import RunMeta, RunRecord
from dflash_doctor.replay.stream import replay_teacher
from dflash_doctor.rundir.load import load_run
from dflash_doctor.rundir.writer import RunWriter
from dflash_doctor.inputs.workloads import load_workload

pytestmark = pytest.mark.integration

NUM_REQUESTS = 6  # two per class
MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def demo_pair_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    config = build_config(max_requests=NUM_REQUESTS, max_new_tokens=MAX_NEW_TOKENS, seed=0)
    pair = load_pair(config)
    runs = {}
    for name in ("healthy", "template-mismatch"):  # healthy first: the scenario only swaps the pair's chat template
        requests = load_workload(config.workload, max_requests=config.max_requests, seed=config.seed)
        if name != "healthy":
            pair, requests, _ = scenarios.get_scenario(name).apply(pair, requests, config)
        record = RunRecord(meta=RunMeta(command="check"), config=config.as_dict())
        with RunWriter(root / name, record.to_json()) as writer:
            replay_teacher(
                pair,
                requests,
                ks=(pair.default_k,),
                max_new_tokens=MAX_NEW_TOKENS,
                temperature=0.0,
                seed=config.seed,
                exact_blocks=False,
                writer=writer,
            )
        runs[name] = load_run(root / name)
    return runs


def _special_first_rejections(run) -> list[tuple[str, str]]:
    """(target text, drafted text) of every first rejection with a special token on either side."""
    tables = deviations.run_tables(run)
    decided = tables.decided
    rows = decided[
        decided["first_rejection"] & ((decided["category"] == "special") | (decided["draft_category"] == "special"))
    ]
    return [
        (tables.text(target), tables.text(draft)) for target, draft in zip(rows["target_token"], rows["draft_token"])
    ]


def test_template_mismatch_brings_template_token_rejections_the_healthy_run_never_has(demo_pair_runs):
    special = _special_first_rejections(demo_pair_runs["template-mismatch"])
    assert special and all("<|im_end|>" in pair for pair in special), special
    assert _special_first_rejections(demo_pair_runs["healthy"]) == []


def test_compare_lists_special_tokens_among_the_patterns_that_grew(demo_pair_runs):
    """Listed with every grown pattern (no top-N cut): with the 3-layer demo draft the template tokens cost less
    than the word-level losses the new system prompt also brings, so they are no longer among the top three."""
    base, new = (deviations.run_tables(demo_pair_runs[name]) for name in ("healthy", "template-mismatch"))
    grown = deviations.grown_patterns(base, new, top_n=len(deviations.CATEGORIES))
    assert any(row["pattern"] == "special" and row["lost_per_draft_base"] == 0 for row in grown)


def test_recorded_columns_come_from_the_real_tokenizer(demo_pair_runs):
    tokens = demo_pair_runs["healthy"].tokens
    for column in ("target_category", "draft_category"):
        assert tokens[column].notna().all() and set(tokens[column]) <= set(deviations.CATEGORIES)
    margin = tokens["target_top1_margin"]
    assert ((margin >= 0) & (margin <= 1)).all()
