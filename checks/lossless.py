"""lossless: does speculative decoding reproduce plain greedy decoding token for token?

At temperature 0 a correct engine is lossless (docs/definitions.md): every committed token is the target's own
argmax, so the output equals plain decoding. A divergence means the engine changes what the model says,
which no speedup justifies. One honest exception: in bfloat16 / float16 the batched verify pass and a
single-token decode step round differently, so where the target's top two tokens are nearly tied the
argmax can flip (z-lab #57, vLLM #54928). A divergence at such a near-tie is a warning to confirm in
float32; a divergence anywhere else, or in float32, is a broken engine.

The dtype rule: a near-tie is a target top-2 logit margin within ``near_tie_ulps`` units of the
dtype's rounding at the size of the top logit (:func:`rounding_at`: bfloat16 keeps 8 significant bits,
so at a logit of 15 its spacing is 0.0625, and a margin of 0.062 there is rounding, not a preference;
at a logit of 0.5 the same spacing is 0.002). A fixed margin in logits cannot tell the two apart. The
finding says which was found: the margin, the logit size and the dtype's spacing there. In float32 every
divergence fails, as before.

Input: ``ctx.record.probes.lossless`` (:class:`~dflash_doctor.rundir.run_record.LosslessProbe`); absent when
no speculative-vs-plain comparison ran (sampling, ``--engine`` without a local pair), which skips the check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, Need, register, skipped
from dflash_doctor.rundir.run_record import Divergence, LosslessProbe

_EXACT_DTYPE = "float32"
_REDUCED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def rounding_at(dtype: str, value: float) -> float:
    """The spacing between neighbouring numbers of ``dtype`` at ``value`` (one unit in the last place):
    machine epsilon scaled by the power of two at or below ``|value|``."""
    info = torch.finfo(_REDUCED_DTYPES[dtype])
    magnitude = max(abs(value), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(magnitude))


def _describe(divergence: Divergence, dtype: str) -> str:
    """One line naming the request, the output index and both tokens (id and text) at the divergence,
    with the target's top-2 margin against the dtype's rounding at its top logit where both are known."""
    margin = divergence.top2_margin
    top1 = divergence.top1_logit
    margin_text = "" if margin is None else f"; target top-2 logit margin {float(margin):.3f}"
    if margin is not None and top1 is not None and dtype in _REDUCED_DTYPES:
        margin_text += (
            f" at logit {float(top1):.2f}, where {dtype} rounds in steps of {rounding_at(dtype, float(top1)):.4f}"
        )
    return (
        f"request {divergence.request_id}, output token {divergence.position}: "
        f"speculative {divergence.speculative_token} {divergence.speculative_text!r} vs "
        f"plain {divergence.plain_token} {divergence.plain_text!r}{margin_text}"
    )


@register
@dataclass(frozen=True)
class LosslessCheck(Check):
    """Speculative output equals plain greedy decoding; a reduced-precision near-tie only warns."""

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
        near_ties = [d for d in divergences if self._is_near_tie(d, dtype)]
        metrics = {
            "num_requests": num_requests,
            "num_identical": num_identical,
            "dtype": dtype,
            "identical_share": num_identical / num_requests,
            "num_divergences": len(divergences),
            "num_near_tie_divergences": len(near_ties),
        }
        if num_identical >= num_requests:
            return CheckResult.from_findings(
                self.id, [], metrics, f"all {num_requests} requests match plain decoding token for token ({dtype})"
            )
        diverged = f"{num_requests - num_identical} of {num_requests} requests diverge from plain decoding"
        unexplained = [d for d in divergences if d not in near_ties]
        if divergences and not unexplained:
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
