"""engine-agreement: does the user's server accept what the draft can, on the same prompts and outputs?

"vLLM says tau 1.3, the paper says 6: is the draft bad, or is my server set up wrong?" The serving
engine's own per-request figures (``check --engine URL``) are compared with the embedded replay of the
SAME turns (dflash_doctor/serving/agreement.py): same prompt ids, same outputs (at T = 0), the embedded
acceptance at every anchor where the engine drafted. When both agree the draft is what it is and the
check says so with the interval. When the embedded replay accepts clearly more on the same text, the
draft is fine and the serving setup is not; replays of the usual setup mistakes (target layer ids off
by one, in-block attention causal vs bidirectional) and of a known engine defect (every layer's context
keys normed with the first layer's k_norm) name the one the server behaves like. Other facts
that explain a gap are reported too: K above the draft's block, prompts rendered differently by the
server (chat template), outputs that are not the target's greedy text.

An engine that reports no step order (llama.cpp: its verify steps come from /metrics as a histogram) is
compared on tau alone: its own tau against the embedded draft walked over the engine's own output tokens,
teacher-forced through the local target (same text, same n-max, same end-of-request budget). Its target
is often quantised and runs its own kernels, so greedy texts may part at near-ties; comparing on the
engine's text keeps that out of the tau difference, and the output comparison reports it separately.

Input: ``ctx.record.probes.engine_agreement`` from :func:`dflash_doctor.serving.agreement.compare_with_embedded`;
absent without ``--engine`` or without a local pair, which skips the check.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, Need, register, skipped
from dflash_doctor.rundir.engine_agreement import (
    EngineAgreement,
    OutputAgreement,
    PromptAgreement,
    SetupRecord,
    SetupSteps,
)

CONFIGURED = "as configured"  # the setup name dflash_doctor.serving.agreement gives the draft as configured
# where to look when the run names no draft kind's own list (runs written before the kinds carried one)
GENERIC_SERVING_CHECKLIST = (
    "the served draft's config and num_speculative_tokens against the local ones, and the chat template "
    "the server renders"
)


def _ci(values: list[float | None]) -> str:
    """``[low, high]``, or ``[-]`` where run.json holds no interval (null: the bootstrap had nothing to pool)."""
    if len(values) > 1 and values[0] is not None and values[1] is not None:
        return f"[{values[0]:.2f}, {values[1]:.2f}]"
    return "[-]"


@register
@dataclass(frozen=True)
class EngineAgreementCheck(Check):
    """The serving engine's acceptance matches the embedded replay on the same turns; a gap names its cause."""

    id = "engine-agreement"
    title = "Engine agreement"
    needs = (
        Need(
            "record.probes.engine_agreement",
            "needs `check --engine URL` with a local target and draft to replay the same prompts",
        ),
    )

    min_tau_gap: float = 0.1  # embedded - engine tau below this is agreement even when the interval excludes 0
    explains_share: float = 0.8  # the engine sides with a simulated setup on at least this share of the telling steps
    min_telling_steps: int = 10  # ... of at least this many steps where that setup and the configured draft differ
    step_agreement_warn_below: float = 0.8  # configured per-step agreement below this with no tau gap still warns
    min_steps: int = 20  # fewer comparable engine steps are too few to judge

    def run(self, ctx: CheckContext) -> CheckResult:
        data: EngineAgreement = ctx.value("record.probes.engine_agreement")
        overall = data.tau.overall
        per_step = data.per_step
        configured = per_step.get(CONFIGURED)
        # the configured draft's share of the engine's steps it reproduces, when enough came in step order to judge
        share = configured.share if configured is not None and configured.num_steps >= self.min_steps else None
        stepwise = configured if share is not None else None  # None: compared on tau alone
        engine_drafts = sum(turn.engine_drafts for turn in data.turns)
        if not overall or overall.difference is None or (stepwise is None and engine_drafts < self.min_steps):
            return skipped(
                self.id,
                f"fewer than {self.min_steps} engine steps could be replayed (need output token ids from the server)",
            )
        findings: list[Finding] = []
        findings += self._k_findings(data)
        findings += self._prompt_findings(data.prompts)
        findings += self._output_findings(data.outputs)
        gap = overall.difference
        low, high = overall.difference_ci[0], overall.difference_ci[1]
        gap_real = gap >= self.min_tau_gap and low is not None and low > 0
        explanation = self._best_setup(per_step, share) if share is not None else None
        tau_text = (
            f"engine tau {overall.engine_tau:.2f} {_ci(overall.engine_tau_ci)} vs embedded "
            f"{overall.embedded_tau:.2f} {_ci(overall.embedded_tau_ci)} on the same outputs "
            f"(difference {gap:+.2f}, 95% CI {_ci(overall.difference_ci)})"
        )
        step_text = (
            f"per-step acceptance reproduced on {stepwise.num_agreeing}/{stepwise.num_steps} engine steps ({share:.0%})"
            if stepwise is not None
            else f"the engine reports no step order ({engine_drafts} steps as a histogram): compared on tau alone"
        )
        if explanation is not None:
            name, stats = explanation
            setup = next((s for s in data.setups if s.name == name), SetupRecord(name, cause=name))
            # an engine defect that costs no acceptance on these turns is worth knowing, not a failed check
            severity = "warn" if setup.engine_defect and not gap_real else "fail"
            findings.append(
                Finding(
                    severity,
                    f"the server behaves like the draft with {name}: {setup.cause}",
                    f"{tau_text}; on the {stats.num_telling} engine steps where the two setups predict differently the "
                    f"server sided with {name} {stats.num_siding} times; it reproduces {stats.share:.0%} of all steps "
                    f"against {share:.0%} as configured",
                    setup.fix,
                )
            )
        elif gap_real:
            simulated = ", ".join(s.name for s in data.setups if s.name != CONFIGURED)  # the draft kind's own
            findings.append(
                Finding(
                    "fail",
                    f"the server accepts less than the draft does on the same text: tau {overall.engine_tau:.2f} "
                    f"vs {overall.embedded_tau:.2f}",
                    f"{tau_text}; {step_text}"
                    + (
                        f"; no simulated setup ({simulated}) reproduces the engine's steps"
                        if stepwise is not None and simulated
                        else ""
                    ),
                    "the draft is fine and the serving setup is not: check "
                    + (data.serving_checklist or GENERIC_SERVING_CHECKLIST),
                )
            )
        elif gap <= -self.min_tau_gap and high is not None and high < 0:
            findings.append(
                Finding(
                    "warn",
                    f"the server accepts more than the embedded replay: tau {overall.engine_tau:.2f} "
                    f"vs {overall.embedded_tau:.2f}",
                    tau_text,
                    "the server may run a different draft or K than the local one given with --draft: "
                    "compare the served config",
                )
            )
        elif share is not None and share < self.step_agreement_warn_below:
            findings.append(
                Finding(
                    "warn",
                    f"tau agrees but only {share:.0%} of the engine's steps are reproduced step by step",
                    f"{tau_text}; {step_text}",
                    "compare the served draft config with the local one; numerics alone part only near-ties",
                )
            )
        margins = data.deciding_margins
        metrics = {
            "engine_tau": overall.engine_tau,
            "embedded_tau": overall.embedded_tau,
            "difference_ci": overall.difference_ci,
            "per_step_share": {name: stats.share for name, stats in per_step.items()},
            "median_margin_disagreeing": margins.median_disagreeing,
            "median_margin_agreeing": margins.median_agreeing,
        }
        return CheckResult.from_findings(
            self.id, findings, metrics, f"server and embedded replay agree: {tau_text}; {step_text}"
        )

    def _best_setup(self, per_step: dict[str, SetupSteps], configured_share: float) -> tuple[str, SetupSteps] | None:
        """The simulated setup the engine sides with on its telling steps and that reproduces more of its steps
        than the configured draft (its share ``configured_share``); None when no setup does."""
        candidates = [
            (name, stats, stats.share)
            for name, stats in per_step.items()
            if name != CONFIGURED and stats.share is not None
        ]
        if not candidates:
            return None

        def siding(stats: SetupSteps) -> float:
            return stats.num_siding / stats.num_telling if stats.num_telling >= self.min_telling_steps else 0.0

        name, stats, share = max(candidates, key=lambda item: siding(item[1]))
        if siding(stats) >= self.explains_share and share > configured_share:
            return name, stats
        return None

    def _k_findings(self, data: EngineAgreement) -> list[Finding]:
        k, block = data.engine_k, data.draft_block_size
        if k is None or block is None or k <= block - 1:
            return []
        return [
            Finding(
                "fail",
                f"the server drafts K = {k} tokens per step but the draft's block holds {block - 1}",
                f"engine num_spec_tokens {k}, draft block_size {block}",
                f"set num_speculative_tokens to {block - 1} (vLLM) or --speculative-num-draft-tokens {block} (SGLang)",
            )
        ]

    def _prompt_findings(self, prompts: PromptAgreement) -> list[Finding]:
        compared, same = prompts.num_compared, prompts.num_identical
        if not compared or same == compared:
            return []
        return [
            Finding(
                "fail",
                f"the server rendered {compared - same} of {compared} prompts into different token ids "
                "than the target's chat template",
                f"first requests: {', '.join(prompts.differing)}",
                "serve with the target's own chat template (vLLM --chat-template) and send the same messages; "
                "the draft was trained on that rendering",
            )
        ]

    def _output_findings(self, outputs: OutputAgreement) -> list[Finding]:
        compared, same = outputs.num_compared, outputs.num_identical
        if not compared or same == compared or not outputs.differences:
            return []
        first = outputs.differences[0]
        margin = first.target_top2_margin
        near_tie = margin < 0.05
        return [
            Finding(
                "info" if near_tie else "warn",
                f"{compared - same} of {compared} server outputs are not the target's greedy text at T = 0",
                f"first: request {first.request_id} at output token {first.position} (target top-2 margin {margin})",
                "a near-tie broken by different kernels is harmless"
                if near_tie
                else "the server runs a different target (quantisation, revision) or samples: "
                "compare the served weights",
            )
        ]
