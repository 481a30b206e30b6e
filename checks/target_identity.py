"""target-identity: is the served target the one the draft was trained against?

A draft is trained to predict one target's next tokens from that target's hidden states. Fine-tune the
target, quantise it, or move to a new version and the draft keeps loading and running, but it now
drafts for a model that no longer exists and acceptance falls (the "target changed under the draft"
case: AEON-7 #6, z-lab #152). Nothing in the configs changes, so only the weights tell.

Inputs: the draft's ``config.json`` section ``"dflash_doctor": {"target_weights_fingerprint", "target"}``
(written by ``dflash-doctor train-draft``, see :func:`dflash_doctor.models.loading.weights_fingerprint`) and
``ctx.record.probes.target_weights_fingerprint``, the served target's fingerprint. When either fingerprint is
missing, only the recorded and served target *names* can be compared: differing names warn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, config_value, register, skipped


def _served_target_name(ctx: CheckContext) -> str | None:
    """The served target as the user named it (--target), else as the run recorded it."""
    recorded = ctx.record.models.get("target") if ctx.record is not None else None
    return config_value(ctx.config, "target") or (recorded.id if recorded is not None else None)


def _comparable_name(name: str) -> str:
    """Last path component, lower-cased: a hub id and a local folder of the same model compare equal."""
    return PurePosixPath(name.strip().rstrip("/")).name.lower()


@register
@dataclass(frozen=True)
class TargetIdentityCheck(Check):
    """The served target's weights fingerprint equals the one the draft recorded at training time."""

    id = "target-identity"
    title = "Target identity"
    needs = ("draft_config",)

    def run(self, ctx: CheckContext) -> CheckResult:
        recorded: dict[str, Any] = (ctx.draft_config or {}).get("dflash_doctor") or {}
        recorded_fingerprint, recorded_name = recorded.get("target_weights_fingerprint"), recorded.get("target")
        if not recorded_fingerprint and not recorded_name:
            return skipped(self.id, "the draft records no target it was trained against (config.json 'dflash_doctor')")
        served_fingerprint = ctx.value("record.probes.target_weights_fingerprint")
        served_name = _served_target_name(ctx)
        metrics = {"recorded_target": recorded_name, "recorded_fingerprint": recorded_fingerprint,
                   "served_target": served_name, "served_fingerprint": served_fingerprint}
        if recorded_fingerprint and served_fingerprint:
            if recorded_fingerprint == served_fingerprint:
                return CheckResult.from_findings(self.id, [], metrics,
                                                 f"the served target's weights are the ones the draft was trained against ({served_fingerprint})")
            finding = Finding(
                "fail",
                "the target's weights differ from the ones the draft was trained against (fine-tune, quantisation or a "
                "new version: the 'target changed under the draft' case, AEON-7 #6, z-lab #152)",
                f"draft trained against {recorded_name or 'an unnamed target'} (fingerprint {recorded_fingerprint}); "
                f"served {served_name or 'target'} (fingerprint {served_fingerprint})",
                self._retrain_fix(ctx))
            return CheckResult.from_findings(self.id, [finding], metrics, "")
        if recorded_name and served_name and _comparable_name(recorded_name) != _comparable_name(served_name):
            unknown = "the draft records no weights fingerprint" if not recorded_fingerprint else "the served target was not fingerprinted"
            finding = Finding(
                "warn",
                f"the draft was trained against {recorded_name!r} but {served_name!r} is served, and {unknown}",
                f"recorded target {recorded_name!r}; served target {served_name!r}",
                "if the served model is not the training target (a fine-tune, quantisation or new version): "
                + self._retrain_fix(ctx))
            return CheckResult.from_findings(self.id, [finding], metrics, "")
        missing = "the served target's weights fingerprint" if recorded_fingerprint else "a weights fingerprint in the draft"
        return skipped(self.id, f"cannot compare weights: {missing} is absent and the target names agree or are unknown")

    @staticmethod
    def _retrain_fix(ctx: CheckContext) -> str:
        draft = config_value(ctx.config, "draft") or "<draft>"
        target = config_value(ctx.config, "target") or "<new target>"
        return (f"fine-tune the draft on the new target: `dflash-doctor train-draft --init-from {draft} --target {target}`, "
                "then compare runs with `dflash-doctor compare`")
