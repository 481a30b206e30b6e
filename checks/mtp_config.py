"""mtp-config: did the replay hand the target's MTP head the state an engine hands it, and is K servable?

An MTP head is fit to one side of a norm for the target's state it is handed (the target's output after
the decoder's final norm, in every engine listed) and for its own state carried from one drafted slot to
the next, and which side an engine carries depends on the architecture it runs: vLLM's DeepSeek-V3 and
Qwen3-Next/Qwen3.5 MTP models carry the head's output after its output norm, its GLM-4.5 ones
(``glm4_moe``, ``glm4_moe_lite``) the output before it. Handed the other side a head still drafts fluent
tokens, only fewer are accepted, and nothing but acceptance shows it (vLLM's DeepSeek path once carried
the pre-norm output, and GLM-5's acceptance collapsed after the first slot until it carried the normed
one). So this check names the sides the replay used (run.json ``models.draft``: ``hidden_state``,
``carried_state``, ``sides_from``) and what each engine passes for the target's architecture
(``engine_sides``, with the engine's MTP model and why), warns when the replay used a side no engine
listed passes for it, or a side other than the one the engine named by ``--engine-config`` passes, and
fails when the configured K is not a multiple of the head's ``n_predict`` (vLLM refuses it: step s runs
layer s % n).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, config_value, register, skipped

SIDES = ("hidden_state", "carried_state")
WHAT = {
    "hidden_state": "the target's state handed to the head",
    "carried_state": "the head's state carried between slots",
}


@register
@dataclass(frozen=True)
class MtpConfigCheck(Check):
    """The MTP head was replayed on the side of the norm the serving engine uses, with a K vLLM accepts."""

    id = "mtp-config"
    title = "MTP head setup"
    needs = ("record",)

    def run(self, ctx: CheckContext) -> CheckResult:
        models = ctx.record.models if ctx.record is not None else {}
        draft = models.get("draft") or models.get("local draft")  # `check --engine` records the replayed pair as local
        if draft is None or draft.kind != "mtp":
            return skipped(self.id, "the draft is not a target's MTP head")
        facts = draft.facts
        used = {side: facts.get(side) for side in SIDES}
        engine_sides: dict[str, dict[str, str]] = facts.get("engine_sides") or {}
        findings: list[Finding] = []
        architecture = facts.get("architecture") or "this architecture"
        described = ", ".join(
            f"{engine}: {sides['hidden_state']} / {sides['carried_state']}"
            + ("" if sides.get("verified", True) else " (unverified)")
            for engine, sides in engine_sides.items()
        )
        evidence = (
            f"replay: hidden_state={used['hidden_state']}, carried_state={used['carried_state']}; "
            f"engines for {architecture} (handed / carried): {described}"
        )
        fix = (
            "replay with --draft mtp (no side set: the sides vLLM passes "
            f"for {architecture}) to measure what a current server accepts"
        )
        for side in SIDES:
            passed = {sides[side] for sides in engine_sides.values()}
            if passed and used[side] not in passed:
                findings.append(
                    Finding(
                        "warn",
                        f"the replay handed the MTP head the {used[side]} side for {WHAT[side]}, which no "
                        f"engine listed passes for {architecture}; its acceptance is that of a misconfigured engine",
                        evidence,
                        fix,
                    )
                )
        engine = (ctx.engine_config or {}).get("engine")
        served = engine_sides.get(engine) if engine else None
        if served is not None:
            for side in SIDES:
                if used[side] != served[side]:
                    findings.append(
                        Finding(
                            "warn",
                            f"{engine} passes the {served[side]} side for {WHAT[side]}, the replay "
                            f"used {used[side]}: its acceptance is not the server's",
                            evidence,
                            f"replay with --draft mtp:{side}={served[side]}",
                        )
                    )
        n_predict = int(facts.get("n_predict") or 1)
        drafted = (ctx.engine_config or {}).get("drafted_tokens")
        ks = [int(drafted)] if drafted is not None else [int(k) for k in config_value(ctx.config, "k") or []]
        for k in ks:
            if k % n_predict:
                findings.append(
                    Finding(
                        "fail",
                        f"K={k} is not a multiple of the head's {n_predict} MTP layers, which vLLM refuses",
                        f"n_predict={n_predict}; draft step s runs MTP layer s % {n_predict}",
                        f"serve num_speculative_tokens = {n_predict * max(1, k // n_predict)}",
                    )
                )
        metrics = {
            "hidden_state": used["hidden_state"],
            "carried_state": used["carried_state"],
            "engine_sides": engine_sides,
            "architecture": facts.get("architecture"),
            "n_predict": n_predict,
            "engine": engine,
        }
        return CheckResult.from_findings(
            self.id,
            findings,
            metrics,
            f"the replay handed the MTP head the sides the engines pass for {architecture} ({evidence})",
        )
