"""eagle3-config: what vLLM decides for an EAGLE-3 head that the checkpoint leaves unsaid,
and what the head can ever propose.

Three things an EAGLE-3 checkpoint can get silently wrong (the eagle3 section of docs/speculators.md):

* **Which target layers it reads.** A config without ``eagle_aux_hidden_state_layer_ids`` (and without the
  other keys vLLM falls back to) is served with vLLM's default layers ``(2, L // 2, L - 3)`` (SGLang and the
  original EAGLE-3 code pick the same). A head trained on other layers then reads the wrong states and
  accepts almost nothing, with no error anywhere. The layer-offset probe (ids shifted by -1, 0, +1, as
  for DFlash) is judged here: a neighbour accepting clearly more means the ids are off.
* **Where it normalises.** vLLM reads a speculators config that leaves ``norm_before_residual`` out as True,
  while the speculators library trains with False: a head saved without the key is served with another
  layer than it was trained with. Any switch whose vLLM reading differs from the trainer's default warns.
* **Its vocabulary.** The head drafts over its own vocabulary mapped into the target's by ``d2t``; a target
  token outside the map can never be drafted, so the share of the run's output tokens the map covers is an
  upper bound on the acceptance rate at every slot, measured over the run and per request class. Below
  ``coverage_warn_below`` (0.95) it warns, below ``coverage_fail_below`` (0.80) it fails, for the run or for
  any one class. The thresholds are this check's choice: a draft vocabulary chosen
  from text like the workload's covers nearly all of it, so a large miss means it was chosen for other text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, config_value, register, skipped
from dflash_doctor.checks.draft_config import decoder_config
from dflash_doctor.errors import UsageError
from dflash_doctor.models.eagle3_format import (
    VLLM_DEFAULT,
    aux_layer_ids,
    is_eagle3_config,
    norm_switches,
    proposable_target_ids,
)
from dflash_doctor.models.loading import resolve_model_dir

KIND = "eagle3"


@register
@dataclass(frozen=True)
class Eagle3ConfigCheck(Check):
    """An EAGLE-3 head's aux layer ids, norm switches and vocabulary map, as vLLM serves the checkpoint.

    Warns when the ids are missing (vLLM's default layers are read) or a norm switch left out is read
    otherwise by vLLM than the trainer built it; fails or warns when the vocabulary map covers too few of
    the run's output tokens, and fails when the offset probe finds clearly better neighbouring layers.
    """

    id = "eagle3-config"
    title = "EAGLE-3 head config"
    needs = ("draft_config",)

    coverage_warn_below: float = 0.95  # share of the run's output tokens the head can propose
    coverage_fail_below: float = 0.80
    # as draft-config's offset probe: a neighbour fails the check when it accepts this share more tokens per draft
    offset_probe_margin: float = 0.10
    offset_probe_min_gain: float = 0.05  # and at least this many more tokens per draft (draft-config says why)
    offset_probe_min_drafts: int = 50

    def run(self, ctx: CheckContext) -> CheckResult:
        raw = ctx.draft_config or {}
        if ctx.draft_kind != KIND and not (ctx.draft_kind is None and is_eagle3_config(raw)):
            return skipped(self.id, "the draft is not an EAGLE-3 head")
        num_layers = config_value(decoder_config(ctx.target_config), "num_hidden_layers")
        findings: list[Finding] = []
        metrics: dict[str, Any] = {}
        if num_layers is not None:
            findings += self._layer_findings(ctx, raw, int(num_layers), metrics)
        findings += _norm_findings(raw, metrics)
        findings += self._coverage_findings(ctx, metrics)
        return CheckResult.from_findings(
            self.id,
            findings,
            metrics,
            "the head names its layers and norm switches, and its vocabulary covers the run's tokens",
        )

    def _layer_findings(
        self, ctx: CheckContext, raw: dict[str, Any], num_layers: int, metrics: dict[str, Any]
    ) -> list[Finding]:
        ids, source = aux_layer_ids(raw, num_layers)
        metrics.update(aux_layer_ids=ids, aux_layer_ids_source=source)
        probe = {int(k): float(v) for k, v in (ctx.value("record.probes.offset_probe") or {}).items()}
        drafts = ctx.value("record.probes.offset_probe_drafts")
        evidence = _probe_evidence(probe, drafts)
        findings = []
        if source == VLLM_DEFAULT:
            findings.append(
                Finding(
                    "warn",
                    f"the head names no aux layer ids, so vLLM reads its default layers {ids} (2, L // 2, L - 3 of the "
                    f"target's {num_layers}; SGLang and the original EAGLE-3 code pick the same)",
                    evidence
                    or (
                        "a head trained on other layers reads the wrong "
                        "states and accepts almost nothing, with no error"
                    ),
                    "write eagle_aux_hidden_state_layer_ids = the layers "
                    "the head was trained on (its model card or training "
                    "config) into config.json",
                )
            )
        if probe and 0 in probe:
            metrics["offset_probe"] = probe
            best = max(probe, key=probe.__getitem__)
            gain = (probe[best] - 1.0) / max(probe[0] - 1.0, 1e-9) - 1.0
            if best != 0 and drafts is not None and drafts < self.offset_probe_min_drafts:
                findings.append(
                    Finding(
                        "info",
                        f"offset probe inconclusive: {drafts} drafts are too few to judge the aux layer ids",
                        evidence,
                        "rerun with more --max-requests or --max-new-tokens",
                    )
                )
            elif best != 0 and gain > self.offset_probe_margin and probe[best] - probe[0] >= self.offset_probe_min_gain:
                findings.append(
                    Finding(
                        "fail",
                        f"aux layer ids shifted by {best:+d} give acceptance "
                        f"length {probe[best]:.2f} vs {probe[0]:.2f} as served",
                        evidence,
                        f"write eagle_aux_hidden_state_layer_ids = {[i + best for i in ids]} into config.json",
                    )
                )
            else:
                findings.append(
                    Finding(
                        "info",
                        f"aux layer ids {ids} (from {source}): no neighbouring layers accept "
                        f"{self.offset_probe_margin:.0%} more",
                        evidence,
                    )
                )
        return findings

    def _coverage_findings(self, ctx: CheckContext, metrics: dict[str, Any]) -> list[Finding]:
        """Coverage of the run's output tokens by the head's vocabulary, overall and per request class: a
        class whose text the map leaves out (code beside chat) is judged on its own share, so a run
        pooled with well covered classes cannot hide it."""
        by_class = {name: ids for name, ids in (ctx.output_token_ids_by_class or {}).items() if ids}
        produced = [token for ids in by_class.values() for token in ids]
        draft = config_value(ctx.config, "draft")
        if not produced or not draft:
            return [
                Finding(
                    "info", "vocabulary coverage not measured: the run recorded no output tokens or no draft checkpoint"
                )
            ]
        try:
            proposable = proposable_target_ids(resolve_model_dir(str(draft)))
        except UsageError:  # the checkpoint has moved since the run: nothing to measure against
            return [Finding("info", f"vocabulary coverage not measured: {draft} is no longer readable")]
        if proposable is None:
            metrics["output_token_coverage"] = 1.0
            return [Finding("info", "the head drafts over the whole target vocabulary (no d2t)")]
        covered = set(proposable.tolist())
        missed = [token for token in produced if token not in covered]
        share = 1.0 - len(missed) / len(produced)
        shares = {name: _covered_share(ids, covered) for name, ids in sorted(by_class.items())}
        metrics.update(
            output_token_coverage=share,
            output_token_coverage_by_class=shares,
            draft_vocab_size=len(covered),
            num_output_tokens=len(produced),
        )
        counts: dict[int, int] = {}
        for token in missed:
            counts[token] = counts.get(token, 0) + 1
        top = sorted(counts, key=lambda t: (-counts[t], t))[:5]
        metrics["most_missed_tokens"] = top
        shown = ", ".join(f"{_token_text(ctx, t)} x{counts[t]}" for t in top)
        per_class = "; ".join(f"{name} {value:.1%}" for name, value in shares.items())
        evidence = (
            f"{len(produced) - len(missed)} of the run's {len(produced)} output tokens are in the head's "
            f"{len(covered)}-token vocabulary"
            + (f" (per class: {per_class})" if len(shares) > 1 else "")
            + (f"; most often missed: {shown}" if top else "")
        )
        fix = "use a head whose draft vocabulary was built from text like this workload's (or one without d2t)"
        overall = self._coverage_severity(share)
        findings = [
            Finding(
                overall,
                f"the head can propose {share:.1%} of the tokens the "
                "target produced (an upper bound on its acceptance rate)",
                evidence,
                fix if overall != "info" else "",
            )
        ]
        if len(shares) > 1:
            for name, value in shares.items():
                severity = self._coverage_severity(value)
                if severity != "info":
                    findings.append(
                        Finding(
                            severity,
                            f"class {name}: the head can propose {value:.1%} of the tokens the target produced there",
                            f"{len(by_class[name])} output tokens of class {name}",
                            fix,
                        )
                    )
        return findings

    def _coverage_severity(self, share: float) -> str:
        return "fail" if share < self.coverage_fail_below else "warn" if share < self.coverage_warn_below else "info"


def _covered_share(tokens: list[int], covered: set[int]) -> float:
    return sum(token in covered for token in tokens) / len(tokens)


def _norm_findings(raw: dict[str, Any], metrics: dict[str, Any]) -> list[Finding]:
    switches = norm_switches(raw)
    metrics["norm_switches"] = {name: switch.to_json() for name, switch in switches.items()}
    findings = []
    for name, switch in switches.items():
        if switch.checkpoint is None and switch.vllm != switch.trained:
            findings.append(
                Finding(
                    "warn",
                    f"config.json leaves {name} out: vLLM runs the head with {name} = {switch.vllm}, the trainer's "
                    f"default is {switch.trained}",
                    f"the replay followed vLLM ({switch.replay}); a head "
                    "trained with the other value is served with another layer",
                    f'write "{name}": {str(switch.trained).lower()} into '
                    f"config.json (or {str(switch.vllm).lower()} if the "
                    "head was trained that way)",
                )
            )
    return findings


def _probe_evidence(probe: dict[int, float], drafts: Any) -> str:
    if not probe:
        return ""
    figures = ", ".join(f"offset {k:+d}: {v:.2f}" for k, v in sorted(probe.items()))
    return f"layer-offset probe, mean acceptance length over {drafts} teacher-forced drafts: {figures}"


def _token_text(ctx: CheckContext, token: int) -> str:
    tokenizer = ctx.target_tokenizer
    return f"{token} {tokenizer.decode([token])!r}" if tokenizer is not None else str(token)
