"""speculative-k: is the configured number of drafted tokens K one that pays?

Every drafted token is verified by the target whether it is accepted or not, so a K past the point
where drafts are still accepted only adds verify and draft work (REFERENCE.md: vLLM
``num_speculative_tokens``, SGLang ``--speculative-num-draft-tokens`` = K + 1). A served K is often
copied from a model card (15 for a block of 16) rather than measured on the actual traffic; a K sweep
(run.json ``summary.sweep``) prices every K per class, and the per-position acceptance rates show when
the last slots are almost never accepted.

Per scope (overall and each class) the check compares the speedup at the configured K with the best:
it warns when K gives up more than ``speedup_loss_share`` of the best (plain decoding counts as a
candidate at 1.0x), fails when K is slower than plain decoding while some K is faster, and fails when
slot K is accepted in fewer than ``slot_rate_floor`` of the steps. A configured K equal to the run's
``recommendation`` for the scope is never flagged: the measured speedups already chose it.

The configured K is the engine's (``--engine-config``: ``drafted_tokens``) when given, else the largest
``--k`` of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, config_value, register, skipped


def _configured_k(ctx: CheckContext) -> tuple[int | None, str]:
    """(K, where it came from): the engine config wins over the run's --k (the engine is what serves)."""
    drafted = (ctx.engine_config or {}).get("drafted_tokens")
    if drafted is not None:
        return int(drafted), "engine config"
    ks = config_value(ctx.config, "k") or [k for k in [(ctx.run_meta or {}).get("served_k")] if k]
    if ks:
        return max(int(k) for k in ks), "--k"
    return None, ""  # the run's config.k is the sweep range, not what is served: judge only a K the user named


def _is_priced(row: dict[str, Any]) -> bool:
    speedup = row.get("speedup")
    return speedup is not None and math.isfinite(speedup) and int(row.get("k", 0)) >= 1


def _scope_label(scope: str) -> str:
    return "overall" if scope == "overall" else f"class {scope}"


@register
@dataclass(frozen=True)
class SpeculativeKCheck(Check):
    """The configured K is close to the best-paying K in every class and inside the useful draft range."""

    id = "speculative-k"
    title = "Speculative K"
    needs = ("run_meta",)

    speedup_loss_share: float = 0.10  # warn when the configured K loses more than this share of the best speedup
    slot_rate_floor: float = 0.02  # slot K accepted in fewer than this share of steps: K is past the useful range
    min_drafts: int = 20  # scopes with fewer drafts are too noisy for the slot-rate floor

    def run(self, ctx: CheckContext) -> CheckResult:
        k, k_source = _configured_k(ctx)
        if k is None:
            return skipped(self.id, "no served K given: pass --k or --engine-config to judge it against the sweep")
        if k < 1:
            return skipped(self.id, f"speculation is off (K={k})")
        summary = (ctx.run_meta or {}).get("summary") or {}
        sweep = summary.get("sweep") or {}
        sweep_rows = {"overall": sweep.get("overall") or [], **(sweep.get("by_class") or {})}
        scope_metrics = {"overall": summary.get("overall") or {}, **(summary.get("by_class") or {})}
        recommendation = (ctx.run_meta or {}).get("recommendation") or {}
        if not any(sweep_rows.values()) and not any(m.get("acceptance_rate_per_pos") for m in scope_metrics.values()):
            return skipped(self.id, "the run has neither a K sweep nor per-position acceptance rates")

        findings: list[Finding] = []
        per_scope: dict[str, dict[str, Any]] = {}
        for scope in dict.fromkeys([*scope_metrics, *sweep_rows]):
            rows = sorted((r for r in sweep_rows.get(scope) or [] if _is_priced(r)), key=lambda r: int(r["k"]))
            scope_findings, per_scope[scope] = self._judge_scope(scope, k, rows, scope_metrics.get(scope) or {},
                                                                 recommendation.get(scope))
            findings += scope_findings
        metrics = {"configured_k": k, "k_source": k_source, "by_scope": per_scope}
        pass_summary = f"K={k} ({k_source}) is within {self.speedup_loss_share:.0%} of the best speedup and inside the useful range"
        return CheckResult.from_findings(self.id, findings, metrics, pass_summary)

    def _judge_scope(self, scope: str, k: int, rows: list[dict[str, Any]], metrics: dict[str, Any],
                     recommended: dict[str, Any] | None) -> tuple[list[Finding], dict[str, Any]]:
        label = _scope_label(scope)
        by_k = {int(r["k"]): r for r in rows}
        best = max(rows, key=lambda r: r["speedup"]) if rows else None  # max keeps the smallest K on ties
        rates = metrics.get("acceptance_rate_per_pos") or []
        slot_rate = rates[k - 1] if len(rates) >= k else None
        if recommended is not None:
            serve_k = int(recommended["k"])
        elif best is not None:
            serve_k = int(best["k"]) if best["speedup"] >= 1.0 else 0
        else:  # no sweep: the last slot still accepted at least the floor's share of steps
            serve_k = max((i + 1 for i, rate in enumerate(rates) if rate >= self.slot_rate_floor), default=0)
        facts = {"speedup_at_k": by_k[k]["speedup"] if k in by_k else None,
                 "best_k": None if best is None else int(best["k"]),
                 "best_speedup": None if best is None else best["speedup"],
                 "slot_rate_at_k": slot_rate, "suggested_k": serve_k}
        if k == serve_k:
            return [], facts
        fix = self._fix(scope, serve_k)
        findings = []
        if k in by_k and best is not None:
            findings += self._speedup_findings(label, k, by_k[k], best, rows, fix)
        elif best is not None:
            findings.append(Finding("info", f"{label}: K={k} was not part of the sweep (K {int(rows[0]['k'])}..{int(rows[-1]['k'])})",
                                    "", f"sweep up to K={k}: `dflash-doctor sweep --k 1-{k}`"))
        judged = (metrics.get("num_drafts") or 0) >= self.min_drafts
        if slot_rate is not None and judged and slot_rate < self.slot_rate_floor:
            tail = ", ".join(f"slot {i + 1}: {rate:.1%}" for i, rate in enumerate(rates[: k]) if i >= max(0, k - 5))
            findings.append(Finding("fail", f"{label}: K={k} is far past the useful range: slot {k} is accepted in {slot_rate:.1%} of steps",
                                    f"unconditional acceptance rate per slot over {metrics['num_drafts']} drafts: {tail}", fix))
        return findings, facts

    def _speedup_findings(self, label: str, k: int, row: dict[str, Any], best: dict[str, Any],
                          rows: list[dict[str, Any]], fix: str) -> list[Finding]:
        speedup, best_speedup = row["speedup"], best["speedup"]
        evidence = "speedup by K: " + ", ".join(f"{int(r['k'])}: {r['speedup']:.2f}x" for r in rows)
        if speedup < 1.0 < best_speedup:
            return [Finding("fail", f"{label}: K={k} is slower than plain decoding ({speedup:.2f}x) while K={int(best['k'])} "
                                    f"runs at {best_speedup:.2f}x", evidence, fix)]
        target_speedup, target_name = (best_speedup, f"K={int(best['k'])}") if best_speedup >= 1.0 else (1.0, "plain decoding")
        if speedup < (1.0 - self.speedup_loss_share) * target_speedup:
            loss = 1.0 - speedup / target_speedup
            if best_speedup >= 1.0:  # the acceptance a larger (or smaller) K would use, from the same sweep
                evidence += f"; tau {row['mean_acceptance_length']:.2f} at K={k} against {best['mean_acceptance_length']:.2f} at K={int(best['k'])}"
            return [Finding("warn", f"{label}: K={k} gives {speedup:.2f}x, {loss:.0%} below {target_name} at {target_speedup:.2f}x",
                            evidence, fix)]
        return []

    @staticmethod
    def _fix(scope: str, serve_k: int) -> str:
        where = "" if scope == "overall" else f" for {scope}"
        if serve_k == 0:
            return f"turn speculation off{where}: no K beats plain decoding"
        return (f"serve num_speculative_tokens={serve_k}{where} (vLLM; SGLang --speculative-num-draft-tokens {serve_k + 1}; "
                f"llama.cpp --spec-draft-n-max {serve_k})")
