"""timing: can the step costs that price every K be trusted?

The K advice and a head-to-head's verdict are ratios of step times (docs/definitions.md#net-speedup). They are timed
here in interleaved rounds until each median is known within 5% or the time budget runs out
(:mod:`dflash_doctor.stats.step_costs`), then fitted under the physics of a forward pass: verifying more
tokens never costs less, and no verify costs less than a decode. Raw medians that break that order beyond
their own intervals are re-timed once. If the re-timing breaks it again on its own samples, the kernels
of this machine really run that shape faster (a CPU GEMM may do 16 rows in less time than 9): the check
warns, names the pair, and the advice on the Ks whose costs the fit pooled is marked uncertain; so too when
the pooled samples still break it and none of its kinds moved between the two timings. If a kind of the
pair moved (its medians' intervals in the two timings do not overlap), the machine changed under the
measurement, and the recommendation gives no advice: the check warns
(``[checks.timing] fail_on_violation = true`` makes it fail, for a CI lane whose runner is meant to be quiet).
A median still looser than the target when the budget ran out is worth knowing (the intervals carry it) but
changes nothing by itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, register, skipped
from dflash_doctor.rundir.run_record import RunRecord


@register
@dataclass(frozen=True)
class TimingCheck(Check):
    """The step timings obey the cost model's physics within their noise."""

    id = "timing"
    title = "Step timing"
    needs = ("record",)  # record.summary.sweep.costs: the fitted costs and their spread

    fail_on_violation: bool = False  # a timing that breaks the physics fails instead of warning

    def run(self, ctx: CheckContext) -> CheckResult:
        record: RunRecord = ctx.value("record")
        sweep = record.summary.sweep
        if sweep is None or not sweep.costs:
            return skipped(self.id, "the run priced no K")
        if sweep.costs.get("source") == "profile":
            return skipped(
                self.id, f"priced with a cost profile ({sweep.costs.get('device', 'unknown device')}), not timed here"
            )
        spread = sweep.costs.get("spread")
        if not isinstance(spread, dict):
            return skipped(self.id, "the run's costs carry no spread (timed before intervals were kept)")
        severity = "fail" if self.fail_on_violation else "warn"
        retimed = ", ".join(spread.get("retimed") or []) or "nothing"
        violations = list(spread.get("violations") or [])
        effects = list(spread.get("shape_effects") or [])
        findings = []
        if violations:
            findings.append(
                Finding(
                    severity,
                    f"the step timings changed while they were taken: {_pairs(violations)} of the cost model's order "
                    "whose step times moved between the first timing and the re-timing; the K advice is withheld",
                    evidence=f"{'; '.join(violations)}; re-timed {retimed} once; raw samples in costs.parquet",
                    fix="rerun on a quiet machine, give the timing more time (--timing-budget) "
                    "or price with --cost-profile",
                )
            )
        if effects:
            ks = ", ".join(map(str, spread.get("shape_effect_ks") or []))
            findings.append(
                Finding(
                    "warn",
                    f"this machine's kernels break the cost model's order: {_pairs(effects)}, in the first timing "
                    f"and again in the re-timing; the costs of K {ks} are pooled and advice on them is marked "
                    "uncertain",
                    evidence=f"{'; '.join(effects)}; raw samples in costs.parquet",
                    fix="price with a --cost-profile measured on the serving hardware, "
                    "whose kernels are the ones that count",
                )
            )
        target = float(spread.get("target_relative_half_width", 0.05))
        loose = {name: width for name, width in _half_widths(spread).items() if not width <= target}
        if loose:
            worst = max(loose, key=lambda name: loose[name])
            findings.append(
                Finding(
                    "info",
                    f"{len(loose)} step kind(s) timed looser than +-{target:.0%} within the "
                    f"{spread.get('budget_s', 0):g} s budget (worst {worst}: +-{loose[worst]:.1%}); "
                    "the speedup intervals carry it",
                )
            )
        metrics = {
            "half_widths": _half_widths(spread),
            "violations": list(spread.get("violations") or []),
            "shape_effects": list(spread.get("shape_effects") or []),
        }
        return CheckResult.from_findings(self.id, findings, metrics, "step costs obey the physics within their noise")


def _pairs(sentences: list[str]) -> str:
    return "one break" if len(sentences) == 1 else f"{len(sentences)} breaks"


def _half_widths(spread: dict) -> dict[str, float]:
    """``{"decode": w, "verify@4": w, "draft@4": w}`` from run.json's ``costs.spread``."""
    widths = {"decode": float(spread.get("decode", float("inf")))}
    for kind in ("verify", "draft"):
        widths.update({f"{kind}@{k}": float(w) for k, w in (spread.get(kind) or {}).items()})
    return widths
