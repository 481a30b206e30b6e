"""prompt-format: do prompts reach the target in the format the draft was trained on?

A draft learns to continue the target's hidden states over the prompts it saw in training. When it was
trained on chat-templated conversations and the workload is replayed or served as raw text (a
completions endpoint, a client that skips ``apply_chat_template``), the context looks nothing like
training and acceptance drops for every request although every component is "correct". A mix of raw
and templated prompts halves the damage and hides it in averages.

Inputs: ``ctx.record.probes.prompt_format`` (:class:`~dflash_doctor.rundir.run_record.PromptFormat`, the counts of
raw and templated prompts; a run without them skips the check) and ``ctx.draft_training_template`` (the
template the draft was trained with, None when not recorded).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, Need, register, skipped
from dflash_doctor.rundir.run_record import PromptFormat

_FIX = (
    "apply the tokenizer's chat template (use the chat endpoint "
    "/ apply_chat_template), or train the draft on raw prompts"
)


@register
@dataclass(frozen=True)
class PromptFormatCheck(Check):
    """Prompts are chat-templated when the draft was trained on templated conversations, and never mixed."""

    id = "prompt-format"
    title = "Prompt format"
    needs = (
        Need(
            "record.probes.prompt_format",
            "the run recorded no prompt-format counts (run.json has no probes.prompt_format)",
        ),
    )

    def run(self, ctx: CheckContext) -> CheckResult:
        counts: PromptFormat = ctx.value("record.probes.prompt_format")
        num_raw, num_templated = counts.num_raw_prompts, counts.num_templated
        num_prompts = num_raw + num_templated
        if num_prompts == 0:
            return skipped(self.id, "the run has no prompts")
        trained_templated = bool(ctx.draft_training_template)
        metrics = {
            "num_raw_prompts": num_raw,
            "num_templated": num_templated,
            "draft_trained_on_template": trained_templated if ctx.draft_training_template is not None else None,
        }
        evidence = f"{num_raw} raw and {num_templated} chat-templated prompts; draft training template " + (
            "recorded" if trained_templated else "not recorded"
        )
        findings: list[Finding] = []
        if num_raw == num_prompts and trained_templated:
            findings.append(
                Finding(
                    "fail",
                    "prompts reach the target without the chat template (raw text) but the draft "
                    "was trained on templated conversations",
                    evidence,
                    _FIX,
                )
            )
        elif 0 < num_raw < num_prompts:
            findings.append(
                Finding(
                    "warn",
                    f"{num_raw} of {num_prompts} prompts reach the target as raw text, the others "
                    "chat-templated: the draft sees two prompt formats",
                    evidence,
                    "send every prompt in the format the draft was trained on: " + _FIX,
                )
            )
        elif num_raw == num_prompts:
            findings.append(
                Finding(
                    "info",
                    "every prompt is raw text and the draft records no training template, so "
                    "whether it was trained on templated conversations is unknown",
                    evidence,
                    "record the training template in the draft (dflash-doctor train-draft does)",
                )
            )
        pass_summary = (
            f"all {num_prompts} prompts are chat-templated"
            if num_raw == 0
            else f"all {num_prompts} prompts are raw text; the draft records no training template"
        )
        return CheckResult.from_findings(self.id, findings, metrics, pass_summary)
