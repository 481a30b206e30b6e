"""speculative-k: is the configured number of drafted tokens K one that pays?

Every drafted token is verified by the target whether it is accepted or not, so a K past the point
where drafts are still accepted only adds verify and draft work (docs/engines.md: vLLM
``num_speculative_tokens``, SGLang ``--speculative-num-draft-tokens`` = K + 1). A served K is often
copied from a model card (15 for a block of 16) rather than measured on the actual traffic; a K sweep
(run.json ``summary.sweep``) prices every K per class, and the per-position acceptance rates show when
the last slots are almost never accepted.

Per scope (overall and each class) the check compares the speedup at the configured K with the best:
it warns when K gives up more than ``speedup_loss_share`` of the best (plain decoding counts as a
candidate at 1.0x), fails when K is slower than plain decoding while some K is faster, and fails when
slot K is accepted in fewer than ``slot_rate_floor`` of the steps. A configured K equal to the run's
``recommendation`` for the scope is never flagged: the measured speedups already chose it. A K the
recommendation names within the noise of the best is not judged on speed (the measurement cannot tell them
apart), and "slower than plain decoding" fails only when the K's whole speedup interval lies below 1 (else it
warns). When the step timings were not reliable (the ``timing`` check), no K is judged on speed. The slot rule
needs no price, so it holds in both cases: a K whose last slot is almost never accepted wastes verify work on
every step, which a busy GPU pays for in throughput even where one request's speed cannot tell.

The configured K is the engine's (``--engine-config``: ``drafted_tokens``) when given, else the largest
``--k`` of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, config_value, register, skipped
from dflash_doctor.rundir.run_record import OVERALL, Metrics, Recommendation, RunRecord
from dflash_doctor.stats.speedup import best_speedup, k_that_pays, priced_speedups, speedup_interval


def _configured_k(ctx: CheckContext) -> tuple[int | None, str]:
    """(K, where it came from): the engine config wins over the run's --k (the engine is what serves)."""
    drafted = (ctx.engine_config or {}).get("drafted_tokens")
    if drafted is not None:
        return int(drafted), "engine config"
    ks = config_value(ctx.config, "k") or [k for k in [ctx.value("record.meta.served_k")] if k]
    if ks:
        return max(int(k) for k in ks), "--k"
    return None, ""  # the run's config.k is the sweep range, not what is served: judge only a K the user named


def _scope_label(scope: str) -> str:
    return OVERALL if scope == OVERALL else f"class {scope}"


@register
@dataclass(frozen=True)
class SpeculativeKCheck(Check):
    """The configured K is close to the best-paying K in every class and inside the useful draft range."""

    id = "speculative-k"
    title = "Speculative K"
    needs = ("record",)  # record.summary (sweep, per-position rates), record.recommendation, record.meta.served_k

    speedup_loss_share: float = 0.10  # warn when the configured K loses more than this share of the best speedup
    slot_rate_floor: float = 0.02  # slot K accepted in fewer than this share of steps: K is past the useful range
    min_drafts: int = 20  # scopes with fewer drafts are too noisy for the slot-rate floor

    def run(self, ctx: CheckContext) -> CheckResult:
        k, k_source = _configured_k(ctx)
        if k is None:
            return skipped(self.id, "no served K given: pass --k or --engine-config to judge it against the sweep")
        if k < 1:
            return skipped(self.id, f"speculation is off (K={k})")
        record: RunRecord = ctx.value("record")
        summary = record.summary
        sweep_rows = summary.sweep.scopes() if summary.sweep is not None else {OVERALL: []}
        scope_metrics: dict[str, Metrics | None] = {OVERALL: summary.overall, **summary.by_class}
        if not any(sweep_rows.values()) and not any(
            m is not None and m.acceptance_rate_per_pos for m in scope_metrics.values()
        ):
            return skipped(self.id, "the run has neither a K sweep nor per-position acceptance rates")
        findings: list[Finding] = []
        per_scope: dict[str, dict[str, Any]] = {}
        for scope in dict.fromkeys([*scope_metrics, *sweep_rows]):
            speedups = priced_speedups(sweep_rows.get(scope) or [])
            intervals = {row.k: speedup_interval(row) for row in sweep_rows.get(scope) or [] if row.k in speedups}
            taus = {row.k: row.mean_acceptance_length for row in sweep_rows.get(scope) or []}
            scope_findings, per_scope[scope] = self._judge_scope(
                scope, k, speedups, taus, scope_metrics.get(scope), record.recommendation.get(scope), intervals
            )
            findings += scope_findings
        metrics = {"configured_k": k, "k_source": k_source, "by_scope": per_scope}
        pass_summary = (
            f"K={k} ({k_source}) is within {self.speedup_loss_share:.0%} "
            "of the best speedup and inside the useful range"
        )
        return CheckResult.from_findings(self.id, findings, metrics, pass_summary)

    def _judge_scope(
        self,
        scope: str,
        k: int,
        speedups: dict[int, float],
        taus: dict[int, float | None],
        metrics: Metrics | None,
        recommended: Recommendation | None,
        bounds: dict[int, tuple[float, float] | None],
    ) -> tuple[list[Finding], dict[str, Any]]:
        label = _scope_label(scope)
        best = best_speedup(speedups) if speedups else None
        rates = (metrics.acceptance_rate_per_pos if metrics is not None else None) or []
        slot_rate = rates[k - 1] if len(rates) >= k else None
        if recommended is not None:
            serve_k = int(recommended.k)
        elif best is not None:
            serve_k = k_that_pays(best)
        else:  # no sweep: the last slot still accepted at least the floor's share of steps
            serve_k = max(
                (i + 1 for i, rate in enumerate(rates) if rate is not None and rate >= self.slot_rate_floor), default=0
            )
        facts = {
            "speedup_at_k": speedups.get(k),
            "best_k": None if best is None else best[0],
            "best_speedup": None if best is None else best[1],
            "slot_rate_at_k": slot_rate,
            "suggested_k": serve_k,
        }
        if k == serve_k:
            return [], facts
        fix = self._fix(scope, serve_k)
        findings = []
        # speed is judged only where the timing holds and tells K from the best; the slot rule below needs no price
        if recommended is not None and recommended.confidence == "unreliable":
            findings.append(
                Finding(
                    "info",
                    f"{label}: K={k} not judged by speed: the step timings were not reliable (see the timing check)",
                )
            )
        elif recommended is not None and k in recommended.ks_within_noise:
            pass  # the measurement cannot tell K's speed from the best's
        elif k in speedups and best is not None:
            findings += self._speedup_findings(label, k, speedups, taus, best, fix, bounds.get(k))
        elif best is not None:
            swept = list(speedups)
            findings.append(
                Finding(
                    "info",
                    f"{label}: K={k} was not part of the sweep (K {swept[0]}..{swept[-1]})",
                    "",
                    f"sweep up to K={k}: `dflash-doctor sweep --k 1-{k}`",
                )
            )
        judged = (metrics.num_drafts if metrics is not None else 0) >= self.min_drafts
        if slot_rate is not None and metrics is not None and judged and slot_rate < self.slot_rate_floor:
            tail = ", ".join(
                f"slot {i + 1}: {rate:.1%}"
                for i, rate in enumerate(rates[:k])
                if i >= max(0, k - 5) and rate is not None
            )
            findings.append(
                Finding(
                    "fail",
                    f"{label}: K={k} is far past the useful range: slot {k} is accepted in {slot_rate:.1%} of steps",
                    f"unconditional acceptance rate per slot over {metrics.num_drafts} drafts: {tail}",
                    fix,
                )
            )
        return findings, facts

    def _speedup_findings(
        self,
        label: str,
        k: int,
        speedups: dict[int, float],
        taus: dict[int, float | None],
        best: tuple[int, float],
        fix: str,
        bounds: tuple[float, float] | None,
    ) -> list[Finding]:
        speedup, (best_k, best_value) = speedups[k], best
        evidence = "speedup by K: " + ", ".join(f"{row_k}: {value:.2f}x" for row_k, value in speedups.items())
        if bounds is not None:
            evidence += f"; K={k}: 95% interval [{bounds[0]:.2f}, {bounds[1]:.2f}]"
        if speedup < 1.0 < best_value:
            # slower for sure only when the whole interval (requests and step timings) lies below plain decoding
            severity, how = ("fail", "is slower") if bounds is None or bounds[1] < 1.0 else ("warn", "may be slower")
            return [
                Finding(
                    severity,
                    f"{label}: K={k} {how} than plain decoding ({speedup:.2f}x) while K={best_k} "
                    f"runs at {best_value:.2f}x",
                    evidence,
                    fix,
                )
            ]
        target_speedup, target_name = (best_value, f"K={best_k}") if best_value >= 1.0 else (1.0, "plain decoding")
        if speedup < (1.0 - self.speedup_loss_share) * target_speedup:
            loss = 1.0 - speedup / target_speedup
            tau, best_tau = taus.get(k), taus.get(best_k)
            if (
                best_value >= 1.0 and tau is not None and best_tau is not None
            ):  # the acceptance another K would use, from the same sweep
                evidence += f"; tau {tau:.2f} at K={k} against {best_tau:.2f} at K={best_k}"
            return [
                Finding(
                    "warn",
                    f"{label}: K={k} gives {speedup:.2f}x, {loss:.0%} below {target_name} at {target_speedup:.2f}x",
                    evidence,
                    fix,
                )
            ]
        return []

    @staticmethod
    def _fix(scope: str, serve_k: int) -> str:
        where = "" if scope == OVERALL else f" for {scope}"
        if serve_k == 0:
            return f"turn speculation off{where}: no K beats plain decoding"
        return (
            f"serve num_speculative_tokens={serve_k}{where} (vLLM; "
            f"SGLang --speculative-num-draft-tokens {serve_k + 1}; "
            f"llama.cpp --spec-draft-n-max {serve_k})"
        )
