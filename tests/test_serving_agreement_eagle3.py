"""Engine agreement for EAGLE-3 heads: a stand-in server that IS the embedded live loop running the head under a
known serving setup is reproduced step by step under that setup, and the engine-agreement check names it.

The setups are the eagle3 kind's own, as the registry declares them (``DraftKind.serving_setups``): the
comparison never asks which kind it replays. The real server is test_vllm_real.py."""

from __future__ import annotations

import pytest
import torch

from dflash_doctor.checks import CheckContext, get_check
from dflash_doctor.engine.eagle3_model import NormSwitches
from dflash_doctor.engine.live import speculative_generate
from dflash_doctor.models.draft_kinds import get_draft_kind
from dflash_doctor.rundir.run_record import Probes
from dflash_doctor.models.serving_setups import CONFIGURED
from dflash_doctor.serving.agreement import compare_turn, summarize_agreement
from checks_fixtures import record
from eagle3_heads import fitted_head
from server_turns import LocalStops, engine_turn
from tiny_models import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 8
AUX_IDS = [1, 3, 6]  # vLLM's default for 8 layers is [2, 4, 5]: a server falling back to it reads other states
K, MAX_NEW = 4, 40
PROMPTS = [
    [5, 17, 42, 8, 9],
    [60, 61, 3, 22, 40, 41],
    [11, 12, 13, 70, 71],
    [30, 31, 90, 8],
    [44, 45, 46, 47, 6, 7],
    [81, 19, 20, 55],
    [23, 24, 25, 26, 27],
    [64, 9, 10, 88, 89, 33],
]


@pytest.fixture(scope="module")
def pair():
    """The tiny target and a head fitted on its greedy choices over the prompts' own continuations, with the
    eagle3 kind's setups built for them (norm_before_residual written True: flipping it reads False)."""
    target = tiny_target(layers=LAYERS)
    with torch.no_grad():
        texts = [
            p
            + target.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                suppress_tokens=None,
            )[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    head = fitted_head(
        target, texts, AUX_IDS, draft_vocab=72, steps=150, lr=0.02, norms=NormSwitches(norm_before_residual=True)
    )
    kind = get_draft_kind("eagle3")
    assert kind.engine_agreement and kind.serving_setups is not None
    built = kind.serving_setups(head, target)
    return target, [setup for setup, _ in built], {setup.name: p for setup, p in built if p is not None}


def test_the_eagle3_setups_are_declared_with_a_cause_and_a_fix(pair):
    _, setups, proposers = pair
    names = [s.name for s in setups]
    assert names == [
        CONFIGURED,
        "aux layer ids - 1",
        "aux layer ids + 1",
        "vLLM's default aux layer ids",
        "norm_before_residual = False",
    ]
    assert all(s.cause and s.fix for s in setups if s.name != CONFIGURED)
    assert set(proposers) == set(names)  # ids 0..7 stay inside the 8 layers
    assert proposers["aux layer ids + 1"][0].needs.hidden_state_indices == (2, 4, 7)
    assert proposers["vLLM's default aux layer ids"][0].needs.hidden_state_indices == (2, 4, 5)
    flipped = proposers["norm_before_residual = False"][0].model
    assert (
        not flipped.config.norms.norm_before_residual and flipped.fc is proposers[CONFIGURED][0].model.fc
    )  # a view, weights shared


@pytest.mark.parametrize(
    "served", [CONFIGURED, "aux layer ids + 1", "vLLM's default aux layer ids", "norm_before_residual = False"]
)
def test_a_stand_in_eagle3_server_is_reproduced_step_by_step_and_its_setup_named(pair, served):
    target, setups, proposers = pair
    served_proposer, served_target = proposers[served]
    turns, comparisons = [], []
    for index, prompt in enumerate(PROMPTS):
        live = speculative_generate(
            served_target, served_proposer, torch.tensor(prompt), k=K, max_new_tokens=MAX_NEW, stop_ids=frozenset()
        )
        turn = engine_turn(f"r{index}", prompt, live, K)
        assert all(s.position >= 1 for s in turn.steps)  # a chain drafts every step: vLLM's arrays place them all
        turns.append(turn)
        comparisons.append(compare_turn(LocalStops(frozenset()), setups, proposers, turn, prompt, K, MAX_NEW, 0.0))
    summary = summarize_agreement(comparisons, turns, engine_k=K, block_size=None, setups=setups)
    assert summary.outputs.num_identical == len(PROMPTS)
    stats = summary.per_step[served]
    assert stats.share == 1.0 and stats.embedded_accepted > 0, summary.per_step
    result = get_check("engine-agreement")().run(CheckContext(record=record(probes=Probes(engine_agreement=summary))))
    if served == CONFIGURED:
        assert result.status == "pass", (result.summary, summary.per_step)
        assert summary.tau.overall.embedded_tau == pytest.approx(summary.tau.overall.engine_tau)
    else:
        assert stats.num_telling >= 10 and stats.num_siding == stats.num_telling, stats
        assert summary.per_step[CONFIGURED].share < stats.share
        named = next(f for f in result.findings if f.severity == "fail")
        setup = next(s for s in setups if s.name == served)
        assert result.status == "fail" and f"with {served}:" in named.message and named.fix == setup.fix, (
            result.summary,
            summary.per_step,
        )
