"""lossless: does speculative decoding reproduce plain greedy decoding token for token?

At temperature 0 a correct engine is lossless (docs/definitions.md): every committed token is the target's own
argmax, so the output equals plain decoding. A divergence means the engine changes what the model says,
which no speedup justifies. One honest exception: the speculative loop scores k + 1 tokens per forward and
plain decoding one, and the two can compute the same logits differently; where the target's top two tokens
are nearly tied that difference can flip the argmax. It comes from two places, and the check names which:

* the target's kernels. A hybrid target's recurrent layers (gated delta net in Qwen3.5 / Qwen3-Next) run a
  chunked kernel over k + 1 tokens and a recurrent one over a single token, which sum in different orders at
  their own internal precision (flash-linear-attention's on a GPU is well below float32's). The probe
  (:func:`dflash_doctor.replay.probes.kernel_path_evidence`) scores the diverging position again on the same
  committed prefix both ways, without any rollback, and records each path's top-2 tokens and margin and the
  largest difference between the two rows of logits, beside the kernels the target ran
  (:func:`dflash_doctor.engine.kernels.kernel_paths`). The divergence is the kernels' numerics when the two
  paths part as the outputs did (the verify path prefers the speculative token, the decode path the plain
  one), or when the speculative token is the decode path's runner-up by a margin within the paths' measured
  disagreement. Where both paths agree with plain decoding and the margin exceeds their disagreement, the
  kernels cannot explain the speculative token: a rollback or acceptance defect, which fails.
* the dtype's rounding (z-lab #57, vLLM #54928). In bfloat16 / float16 a near-tie is a top-2 logit margin
  within ``near_tie_ulps`` units of the dtype's rounding at the size of the top logit (:func:`rounding_at`:
  bfloat16 keeps 8 significant bits, so at a logit of 15 its spacing is 0.0625, and a margin of 0.062 there
  is rounding, not a preference; at a logit of 0.5 the same spacing is 0.002). A fixed margin in logits
  cannot tell the two apart. This rule also judges records written before the kernel paths were measured.

An explained divergence warns (confirm it); any other fails, in float32 too.

Input: ``ctx.record.probes.lossless`` (:class:`~dflash_doctor.rundir.run_record.LosslessProbe`); absent when
no speculative-vs-plain comparison ran (sampling, ``--engine`` without a local pair), which skips the check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, Need, register, skipped
from dflash_doctor.rundir.run_record import Divergence, LosslessProbe

_REDUCED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def rounding_at(dtype: str, value: float) -> float:
    """The spacing between neighbouring numbers of ``dtype`` at ``value`` (one unit in the last place):
    machine epsilon scaled by the power of two at or below ``|value|``."""
    info = torch.finfo(_REDUCED_DTYPES[dtype])
    magnitude = max(abs(value), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(magnitude))


def _describe(divergence: Divergence, dtype: str) -> str:
    """One line naming the request, the output index and both tokens (id and text) at the divergence,
    with the target's top-2 margin against the dtype's rounding at its top logit where both are known, and
    the two kernel paths' scores there where they were measured."""
    margin = divergence.top2_margin
    top1 = divergence.top1_logit
    margin_text = "" if margin is None else f"; target top-2 logit margin {float(margin):.3f}"
    if margin is not None and top1 is not None and dtype in _REDUCED_DTYPES:
        margin_text += (
            f" at logit {float(top1):.2f}, where {dtype} rounds in steps of {rounding_at(dtype, float(top1)):.4f}"
        )
    paths_text = ""
    if _has_path_evidence(divergence):
        paths_text = (
            f"; verify path (multi-token forwards) top-2 {divergence.verify_top2} "
            f"margin {divergence.verify_margin:.3g}, decode path (one token per forward) top-2 "
            f"{divergence.decode_top2} margin {divergence.decode_margin:.3g}, their logits differ by up to "
            f"{divergence.path_disagreement:.3g} there"
        )
    return (
        f"request {divergence.request_id}, output token {divergence.position}: "
        f"speculative {divergence.speculative_token} {divergence.speculative_text!r} vs "
        f"plain {divergence.plain_token} {divergence.plain_text!r}{margin_text}{paths_text}"
    )


def _has_path_evidence(divergence: Divergence) -> bool:
    return None not in (
        divergence.verify_top2,
        divergence.verify_margin,
        divergence.decode_top2,
        divergence.decode_margin,
        divergence.path_disagreement,
    )


def _kernels_text(kernels: dict[str, str]) -> str:
    """The kernels in a line: each recurrent mixer class with what its entry points run, then the attention
    implementation, the float32 matmul precision and the dtype (``"kernels not recorded"`` for an older run)."""
    if not kernels:
        return "kernels not recorded"
    by_class: dict[str, list[str]] = {}
    for key, runs in kernels.items():
        if "." in key:
            by_class.setdefault(key.split(".", 1)[0], []).append(runs)
    parts = [f"{name} runs {', '.join(runs)}" for name, runs in by_class.items()]
    parts += [f"{key} {value}" for key, value in kernels.items() if "." not in key]
    return "; ".join(parts)


@register
@dataclass(frozen=True)
class LosslessCheck(Check):
    """Speculative output equals plain greedy decoding; a divergence the target's kernels or a reduced-precision
    near-tie explain only warns."""

    id = "lossless"
    title = "Lossless"
    needs = (
        Need("record.probes.lossless", "no speculative-vs-plain comparison was run (run.json has no probes.lossless)"),
    )

    near_tie_ulps: float = 2.0  # a top-2 gap within this many of the dtype's rounding steps at the top logit can flip

    def run(self, ctx: CheckContext) -> CheckResult:
        lossless: LosslessProbe = ctx.value("record.probes.lossless")
        num_requests = lossless.num_requests
        if num_requests == 0:
            return skipped(self.id, "the speculative-vs-plain comparison covered no requests")
        num_identical = lossless.num_identical
        dtype = (lossless.dtype or "unknown").replace("torch.", "")
        divergences = lossless.divergences
        by_kernels = [d for d in divergences if _is_kernel_numerics(d)]
        near_ties = [d for d in divergences if d not in by_kernels and self._is_near_tie(d, dtype)]
        metrics = {
            "num_requests": num_requests,
            "num_identical": num_identical,
            "dtype": dtype,
            "identical_share": num_identical / num_requests,
            "num_divergences": len(divergences),
            "num_kernel_numerics_divergences": len(by_kernels),
            "num_near_tie_divergences": len(near_ties),
        }
        if num_identical >= num_requests:
            return CheckResult.from_findings(
                self.id, [], metrics, f"all {num_requests} requests match plain decoding token for token ({dtype})"
            )
        diverged = f"{num_requests - num_identical} of {num_requests} requests diverge from plain decoding"
        unexplained = [d for d in divergences if d not in by_kernels and d not in near_ties]
        if divergences and not unexplained and by_kernels:
            first = by_kernels[0]
            also = f", the rest by {dtype} rounding of a near-tie" if near_ties else ""
            finding = Finding(
                "warn",
                f"{diverged}, explained by the target's kernels: on the same prefix its verify path (multi-token "
                f"forwards) and decode path (one token per forward) disagree by up to {first.path_disagreement:.3g} "
                f"in the logits, enough to flip a top-2 margin of {first.decode_margin:.3g}{also}",
                f"{_describe(first, dtype)}; {_kernels_text(lossless.kernels)}",
                "confirm with a target whose verify and decode passes run one kernel (attention layers only), where a "
                "lossless engine matches exactly; a divergence where both kernel paths agree fails this check",
            )
        elif divergences and not unexplained:
            finding = Finding(
                "warn",
                f"{diverged}, explained by {dtype} rounding of a near-tie "
                "(batched verify vs single-token decode numerics, z-lab #57, vLLM #54928)",
                _describe(near_ties[0], dtype),
                "compare in float32 to confirm (--dtype float32): a lossless engine then matches exactly",
            )
        else:
            evidence = _describe(unexplained[0], dtype) if unexplained else "no divergence details were recorded"
            finding = Finding(
                "fail",
                f"{diverged}: the speculative output differs from plain decoding: the engine is not lossless",
                evidence,
                "check the attention backend (verify must give the same logits as single-token decode), the KV-cache "
                "rollback after rejected drafts, and the acceptance rule (greedy: accept while draft == target argmax)",
            )
        return CheckResult.from_findings(self.id, [finding], metrics, "")

    def _is_near_tie(self, divergence: Divergence, dtype: str) -> bool:
        """Reduced precision and a top-2 gap within ``near_tie_ulps`` rounding steps of the dtype at the top
        logit: rounding alone can flip the argmax (a record without the top logit cannot be judged so)."""
        margin, top1 = divergence.top2_margin, divergence.top1_logit
        if dtype not in _REDUCED_DTYPES or margin is None or top1 is None:
            return False
        return float(margin) <= self.near_tie_ulps * rounding_at(dtype, float(top1))


def _is_kernel_numerics(divergence: Divergence) -> bool:
    """The target's two kernel paths, on the same committed prefix, part as the outputs did (the verify path's
    argmax is the speculative token, the decode path's the plain one), or the speculative token is the decode
    path's runner-up by a margin within the paths' measured disagreement. A record without the two paths'
    scores cannot be judged so."""
    if not _has_path_evidence(divergence):
        return False
    verify_top2, decode_top2 = divergence.verify_top2 or [], divergence.decode_top2 or []
    margin, disagreement = divergence.decode_margin or 0.0, divergence.path_disagreement or 0.0
    parted = verify_top2[:1] == [divergence.speculative_token] and decode_top2[:1] == [divergence.plain_token]
    return parted or (divergence.speculative_token in decode_top2 and margin <= disagreement)
