"""acceptance: are the measured acceptance numbers healthy, and is any part of the workload left behind?

Reads the run record's ``summary`` (never recomputes): tau per class against thresholds, a per-position collapse
(the conditional rate a_i = r_i / r_{i-1} falling below a floor within the first slots: later drafts are
wasted verify work), a class far below the others (prompt domain off the draft's training data,
z-lab #7: Chinese 3.3 vs English 6.4), and "suspiciously perfect" acceptance: every drafted token
accepted usually means the draft reads the wrong features or is the target itself, so the numbers
measure nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, register, skipped
from dflash_doctor.rundir.run_record import OVERALL, Metrics, Summary


@register
@dataclass(frozen=True)
class AcceptanceCheck(Check):
    """Measured tau and per-position acceptance are within thresholds for every request class."""

    id = "acceptance"
    title = "Acceptance"
    needs = ("record",)  # record.summary: overall and per-class metrics

    tau_warn_below: float = 2.0  # mean acceptance length (bonus included) below which we warn
    tau_fail_below: float = 1.3  # ... and below which we fail: speculation barely beats plain decoding
    conditional_rate_floor: float = 0.3  # a_i below this within the first slots is a collapse
    collapse_within_positions: int = 3  # only the first N draft slots count as "early"
    class_gap_ratio: float = 0.6  # a class whose tau is below this x the median of the others is left behind
    min_drafts: int = 20  # scopes with fewer drafts are too noisy to judge
    perfect_rate: float = 1.0  # draft acceptance rate at or above this in every scope is suspicious

    def run(self, ctx: CheckContext) -> CheckResult:
        summary: Summary = ctx.value("record.summary")
        scopes: dict[str, Metrics | None] = {OVERALL: summary.overall}
        scopes.update({f"class {name}": metrics for name, metrics in summary.by_class.items()})
        # a scope that drafted has a tau (tokens per step), so every judged scope has one
        judged = {
            name: m
            for name, m in scopes.items()
            if m is not None and m.num_drafts >= self.min_drafts and m.mean_acceptance_length is not None
        }
        if not judged:
            return skipped(self.id, f"the run has no scope with at least {self.min_drafts} drafts")

        findings: list[Finding] = []
        taus = {name: m.mean_acceptance_length for name, m in judged.items() if m.mean_acceptance_length is not None}
        for name, m in judged.items():
            findings += self._tau_findings(name, m)
            findings += self._collapse_findings(name, m)
        findings += self._class_gap_findings(taus)
        findings += self._perfect_findings(judged)
        metrics = {"tau": taus, "num_scopes_judged": len(judged)}
        overall = taus.get(OVERALL)
        pass_summary = (
            f"tau {overall:.2f} overall; every class above {self.tau_warn_below}"
            if overall is not None
            else f"every class above tau {self.tau_warn_below}"
        )
        return CheckResult.from_findings(self.id, findings, metrics, pass_summary)

    def _tau_findings(self, name: str, m: Metrics) -> list[Finding]:
        tau = m.mean_acceptance_length
        if tau is None or tau >= self.tau_warn_below:
            return []
        ci = m.mean_acceptance_length_ci
        evidence = (
            f"tau {tau:.2f}" + (f" (95% CI {ci[0]:.2f}-{ci[1]:.2f})" if ci else "") + f" over {m.num_drafts} drafts"
        )
        severity = "fail" if tau < self.tau_fail_below else "warn"
        limit = self.tau_fail_below if severity == "fail" else self.tau_warn_below
        return [
            Finding(
                severity,
                f"{name}: mean acceptance length {tau:.2f} is below {limit}",
                evidence,
                "check the tokenizer, chat-template and draft-config findings "
                "first; then lower K for this class (`dflash-doctor sweep`)",
            )
        ]

    def _collapse_findings(self, name: str, m: Metrics) -> list[Finding]:
        rates = m.conditional_acceptance_rate_per_pos
        for position, rate in enumerate(rates[: self.collapse_within_positions]):
            if rate is not None and rate < self.conditional_rate_floor:
                shown = ", ".join(f"{r:.2f}" for r in rates[: self.collapse_within_positions + 2] if r is not None)
                return [
                    Finding(
                        "warn",
                        f"{name}: acceptance collapses at draft slot {position + 1} (conditional rate {rate:.2f})",
                        f"conditional rates a_i: {shown}",
                        "drafted tokens past this slot are mostly wasted "
                        "verify work: lower K, or look for a feature/offset bug",
                    )
                ]
        return []

    def _class_gap_findings(self, taus: dict[str, float]) -> list[Finding]:
        classes = {name: tau for name, tau in taus.items() if name != OVERALL}
        if len(classes) < 2:
            return []
        findings = []
        for name, tau in classes.items():
            others = statistics.median(t for n, t in classes.items() if n != name)
            if tau < self.class_gap_ratio * others:
                findings.append(
                    Finding(
                        "warn",
                        f"{name} is far below the other classes: tau {tau:.2f} vs median {others:.2f}",
                        f"ratio {tau / others:.2f} < {self.class_gap_ratio}",
                        "the draft was likely not trained on this kind of "
                        "prompt: serve this class with a smaller K or none",
                    )
                )
        return findings

    def _perfect_findings(self, judged: dict[str, Metrics]) -> list[Finding]:
        rates = {name: m.draft_acceptance_rate for name, m in judged.items()}
        if all(rate is not None and rate >= self.perfect_rate for rate in rates.values()):
            return [
                Finding(
                    "fail",
                    "every drafted token was accepted in every class: suspiciously perfect",
                    ", ".join(f"{name} {rate:.3f}" for name, rate in rates.items()),
                    "the draft probably reads the target's own outputs or "
                    "IS the target: check --draft and the target layer ids",
                )
            ]
        return []
