"""engine-agreement on hand-made comparison figures: agreement, an unexplained gap, an explained one."""

from __future__ import annotations

import dataclasses

import pytest

from dflash_doctor.checks import CheckContext, get_check, run_checks
from dflash_doctor.models.draft_kinds import get_draft_kind
from dflash_doctor.rundir.engine_agreement import (
    DecidingMargins,
    EngineAgreement,
    OutputAgreement,
    OutputDifference,
    PromptAgreement,
    SetupRecord,
    SetupSteps,
    TauByScope,
    TauComparison,
    TurnAgreement,
)
from dflash_doctor.rundir.run_record import Probes
from checks_fixtures import record


def _figures(
    engine_tau=1.74,
    embedded_tau=1.73,
    ci=(-0.04, 0.03),
    shares=None,
    prompts_same=8,
    outputs_same=8,
    engine_k=15,
    serving_checklist="",
):
    shares = shares or {"as configured": 0.97}
    tau = TauComparison(
        num_turns=8,
        engine_tau=engine_tau,
        engine_tau_ci=[engine_tau - 0.1, engine_tau + 0.1],
        embedded_tau=embedded_tau,
        embedded_tau_ci=[embedded_tau - 0.1, embedded_tau + 0.1],
        difference=embedded_tau - engine_tau,
        difference_ci=list(ci),
    )
    return EngineAgreement(
        num_turns=8,
        num_compared=8,
        engine_k=engine_k,
        draft_block_size=16,
        prompts=PromptAgreement(
            num_compared=8, num_identical=prompts_same, differing=["r1"] if prompts_same < 8 else []
        ),
        outputs=OutputAgreement(
            num_compared=8,
            num_identical=outputs_same,
            differences=[] if outputs_same == 8 else [OutputDifference("r2", 40, 7, 8, 0.003)],
        ),
        tau=TauByScope(overall=tau, by_class={}),
        per_step={
            name: SetupSteps(
                num_steps=200,
                num_agreeing=round(200 * share),
                share=share,
                num_telling=40,
                num_siding=round(40 * (share - 0.3) / 0.7),
                embedded_accepted=300,
                engine_accepted=300,
            )
            for name, share in shares.items()
        },
        turns=[],
        deciding_margins=DecidingMargins(
            setup="as configured",
            num_agreeing=100,
            median_agreeing=1.5,
            num_disagreeing=6,
            median_disagreeing=0.004,
            disagreeing=[0.004],
        ),
        setups=[
            SetupRecord("as configured"),
            SetupRecord(
                "target_layer_ids + 1",
                layer_offset=1,
                cause="the server feeds the draft the target layers one above",
                fix="serve the ids",
            ),
            SetupRecord(
                "in-block attention causal",
                flip_causal=True,
                cause="the server runs the block causal",
                fix="set dflash_config.causal",
            ),
        ],
        serving_checklist=serving_checklist,
    )


def _run(figures):
    return get_check("engine-agreement")().run(CheckContext(record=record(probes=Probes(engine_agreement=figures))))


def test_engine_agreement_pass_when_tau_and_steps_agree():
    result = _run(_figures(outputs_same=7))  # one output parted at a near-tie: info only
    assert result.status == "pass", result.summary
    assert "agree" in result.summary and "97%" in result.summary


def test_engine_agreement_fail_names_the_layer_offset_the_server_matches():
    figures = _figures(
        engine_tau=1.05,
        embedded_tau=1.73,
        ci=(0.6, 0.75),
        shares={"as configured": 0.35, "target_layer_ids + 1": 0.96, "in-block attention causal": 0.4},
    )
    result = _run(figures)
    assert result.status == "fail"
    finding = next(f for f in result.findings if f.severity == "fail")
    assert (
        "target_layer_ids + 1" in finding.message
        and "sided with target_layer_ids + 1 38 times" in finding.evidence
        and finding.fix
    )


@pytest.mark.parametrize(
    "kind, named",
    [
        ("dflash", "mask id"),
        ("eagle3", "eagle_aux_hidden_state_layer_ids"),
        ("mtp", "before or after the final norm"),
        ("ngram", "prompt_lookup_min"),
        (None, "served draft's config"),
    ],
)
def test_engine_agreement_fail_without_a_matching_setup_lists_what_to_inspect_for_the_draft_kind(kind, named):
    """The fix lists the kind's own serving settings (a run from before the kinds carried one: a general list)."""
    figures = _figures(
        engine_tau=1.2,
        embedded_tau=1.73,
        ci=(0.4, 0.6),
        shares={"as configured": 0.5, "target_layer_ids + 1": 0.55, "in-block attention causal": 0.6},
        serving_checklist="" if kind is None else get_draft_kind(kind).serving_checklist,
    )
    result = _run(figures)
    assert result.status == "fail" and "accepts less" in result.summary
    fix = result.findings[-1].fix
    assert named in fix and fix.startswith("the draft is fine and the serving setup is not: check ")
    assert ("mask id" in fix) == (kind == "dflash")


def test_engine_agreement_fail_on_k_above_the_block_and_on_a_different_prompt_rendering():
    result = _run(_figures(engine_k=16, prompts_same=6))
    messages = " | ".join(f.message for f in result.findings if f.severity == "fail")
    assert "K = 16" in messages and "2 of 8 prompts" in messages


def test_engine_agreement_warn_when_tau_agrees_but_steps_do_not():
    result = _run(_figures(shares={"as configured": 0.6}))
    assert result.status == "warn" and "60%" in result.summary


def test_engine_agreement_skips_without_an_engine_run():
    for ctx in (CheckContext(), CheckContext(record=record())):
        result = run_checks(ctx, only=["engine-agreement"])[0]
        assert result.status == "skip"
        assert (
            result.summary
            == "skipped: needs `check --engine URL` with a local target and draft to replay the same prompts"
        )


def _histogram_only(figures, engine_drafts):
    """An engine without step order (llama.cpp): no anchor can be compared, only tau over the same text."""
    steps = SetupSteps(
        num_steps=0, num_agreeing=0, share=None, num_telling=0, num_siding=0, embedded_accepted=0, engine_accepted=0
    )
    turns = [
        TurnAgreement(
            f"r{i}",
            "chat",
            engine_drafts=engine_drafts // 4,
            engine_accepted=0,
            embedded_drafts=0,
            embedded_accepted=0,
            outputs_match=True,
            steps_compared=0,
            steps_agreeing=0,
        )
        for i in range(4)
    ]
    return dataclasses.replace(figures, per_step={"as configured": steps}, turns=turns)


def test_engine_agreement_without_step_order_judges_tau_alone():
    agreeing = _run(_histogram_only(_figures(), engine_drafts=200))
    assert (
        agreeing.status == "pass"
        and "no step order (200 steps as a histogram): compared on tau alone" in agreeing.summary
    )
    gap = _run(_histogram_only(_figures(engine_tau=1.2, embedded_tau=1.73, ci=(0.4, 0.6)), engine_drafts=200))
    assert gap.status == "fail" and "accepts less" in gap.summary
    assert "reproduces the engine's steps" not in gap.findings[-1].evidence  # no per-step replay was possible
    assert _run(_histogram_only(_figures(), engine_drafts=12)).status == "skip"
