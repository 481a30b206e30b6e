"""Prompt lookup (n-gram) drafting, as vLLM's ``ngram`` speculator does it: no weights, no target states.

The rule (vLLM ``speculative_config = {"method": "ngram", ...}``, ``v1/spec_decode/ngram_proposer.py``):

* The context is the prompt plus every committed output token, the token just sampled included.
* With fewer than ``prompt_lookup_min`` context tokens nothing is proposed.
* Otherwise the longest suffix of the context of length n in [``prompt_lookup_min``, ``prompt_lookup_max``]
  that also occurs earlier in the context is looked up (an earlier occurrence may overlap the suffix);
  between occurrences of that length the *earliest* one wins. The tokens that followed it are proposed,
  at most K of them, fewer when the context ends first; K is also capped by ``max_model_len - len(context)``.
* No match of at least ``prompt_lookup_min`` tokens: nothing is proposed, and the step is a plain decode
  step (vLLM counts it as no draft at all).
* Defaults: neither bound set -> both 5; one set -> the other copies it.

Worked examples (:func:`ngram_lookup`, min 2, max 3). The suffix [2, 3] of [1, 2, 3, 4, 2, 3] occurred
earlier, followed by 4, 2, 3; K = 4 asks for four tokens but the context ends after three:

>>> from dflash_doctor.engine.proposers.ngram import NgramSettings, ngram_lookup
>>> ngram_lookup([1, 2, 3, 4, 2, 3], 4, NgramSettings(prompt_lookup_min=2, prompt_lookup_max=3))
[4, 2, 3]

The longest suffix wins, and an occurrence may overlap it: [1, 2, 3] (length 3) begins the context, so its
continuation is the suffix itself:

>>> ngram_lookup([1, 2, 3, 1, 2, 3], 4, NgramSettings(prompt_lookup_min=2, prompt_lookup_max=3))
[1, 2, 3]

Of two earlier occurrences of one length the earliest wins ([1, 2] followed by 9, not by 7). In
[1, 2, 3, 4, 2, 5] neither [2, 5] nor [4, 2, 5] occurred before: nothing is proposed, a plain decode step:

>>> ngram_lookup([5, 1, 2, 9, 1, 2, 7, 1, 2], 4, NgramSettings(prompt_lookup_min=2, prompt_lookup_max=3))
[9, 1, 2, 7]
>>> ngram_lookup([1, 2, 3, 4, 2, 5], 4, NgramSettings(prompt_lookup_min=2, prompt_lookup_max=3))
[]

vLLM scans the reversed context with a prefix function (KMP) capped at ``prompt_lookup_max``; where
the same length occurs several times its ``>=`` update keeps the occurrence furthest back. This module
does the same scan (:func:`ngram_lookup`).

A proposal has no distribution: the verifier treats it as a point mass on each proposed token (vLLM's
rejection sampler, given no draft probabilities, accepts a token with p_target(token)). Its ``logits``
rows are that point mass: 0 at the proposed token, -inf elsewhere, so the per-token divergence columns
hold what a point mass gives (docs/speculators.md): the target's probability of the proposed token, a
draft probability of the target's token of 1 or 0, a rank of 0 or 1, total variation ``1 - p_target``,
and an infinite KL unless the target was certain.

Teacher forcing: a proposal at K is the first K tokens of the proposal at a larger K (K only truncates),
so one pass at K_max is exact for every K. :meth:`NgramProposer.proposal_lengths` tells the replay how
many slots each step really drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dflash_doctor.engine.proposers.base import Proposal, TargetNeeds, TokenListProposer

#: vLLM's defaults when neither bound is given
DEFAULT_PROMPT_LOOKUP = 5
#: The longest lookup (and suffix-tree depth, :mod:`.suffix`) accepted: 2**20 tokens, above the context of
#: any model this tool replays, so a larger bound could never match more and only names a size to allocate.
MAX_LOOKUP_TOKENS = 1 << 20


@dataclass(frozen=True)
class NgramSettings:
    """vLLM's ``prompt_lookup_min`` / ``prompt_lookup_max`` and the context cap (``max_model_len``; None: no cap)."""

    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    max_model_len: int | None = None

    @classmethod
    def resolve(
        cls,
        prompt_lookup_min: int | None = None,
        prompt_lookup_max: int | None = None,
        max_model_len: int | None = None,
    ) -> "NgramSettings":
        """vLLM's defaulting: neither -> both 5; one -> the other copies it. Bounds must be in
        [1, :data:`MAX_LOOKUP_TOKENS`] and min <= max."""
        if prompt_lookup_min is None and prompt_lookup_max is None:
            prompt_lookup_min = prompt_lookup_max = DEFAULT_PROMPT_LOOKUP
        elif prompt_lookup_min is None:
            prompt_lookup_min = prompt_lookup_max
        elif prompt_lookup_max is None:
            prompt_lookup_max = prompt_lookup_min
        assert prompt_lookup_min is not None and prompt_lookup_max is not None
        if not (1 <= prompt_lookup_min <= MAX_LOOKUP_TOKENS and 1 <= prompt_lookup_max <= MAX_LOOKUP_TOKENS):
            raise ValueError(
                f"prompt_lookup_min/max must be in [1, {MAX_LOOKUP_TOKENS}], "
                f"got {prompt_lookup_min}/{prompt_lookup_max}"
            )
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {prompt_lookup_min} exceeds prompt_lookup_max {prompt_lookup_max}")
        return cls(prompt_lookup_min, prompt_lookup_max, max_model_len)


def ngram_lookup(context: Sequence[int], k: int, settings: NgramSettings) -> list[int]:
    """The tokens vLLM's n-gram proposer offers after ``context`` (the rule and worked examples: module docstring).

    Args:
        context: the prompt and every committed output token, the token just sampled included.
        k: the most tokens to propose; also capped by ``settings.max_model_len - len(context)``.
        settings: the lookup's n-gram bounds and model length.

    Returns:
        The tokens that followed the earliest earlier occurrence of the context's longest matching suffix, at
        most ``k``; empty when no suffix of at least ``prompt_lookup_min`` tokens occurred before (a plain
        decode step).
    """
    total = len(context)
    if total < settings.prompt_lookup_min:
        return []
    if settings.max_model_len is not None:
        k = min(k, settings.max_model_len - total)
    if k <= 0:
        return []
    max_n = min(
        settings.prompt_lookup_max, total
    )  # no match is longer than the context: the same scan, a list that fits
    reversed_ids = context[::-1]
    # prefix function of the reversed context, kept for its first max_n entries only (longer matches are capped)
    lps = [0] * max_n
    longest, position, matched, i = 0, 0, 0, 1
    while i < total:
        if reversed_ids[matched] == reversed_ids[i]:
            matched += 1
            if matched >= longest:  # ">=": of equal lengths, the one furthest back in the context
                longest, position = matched, i
            if i < max_n:
                lps[i] = matched
            if matched == max_n:
                matched = lps[max_n - 1]
            i += 1
        elif matched:
            matched = lps[matched - 1]
        else:
            i += 1
    if longest < settings.prompt_lookup_min:
        return []
    start = total - 1 - position + longest  # first token after the matched occurrence
    return list(context[start : start + min(k, total - start)])


class NgramProposer(TokenListProposer):
    kind = "ngram"
    needs = TargetNeeds()

    def __init__(self, settings: NgramSettings, vocab_size: int, device: torch.device | str = "cpu"):
        super().__init__(vocab_size, device)
        self.settings = settings
        self.context: list[int] = []

    def start(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None) -> None:
        self.context = prompt_ids.tolist()

    def propose(self, last_token: int, k: int, block_k: int) -> Proposal:
        tokens = ngram_lookup(self.context + [last_token], k, self.settings)
        return Proposal(
            tokens=torch.tensor(tokens, dtype=torch.long, device=self.device),
            logits=self._point_mass(tokens, len(tokens)),
            probs=None,
        )

    def accept(self, committed_ids: torch.Tensor, committed_features: torch.Tensor | None) -> None:
        self.context.extend(committed_ids.tolist())

    # teacher forcing: anchor a is the index (in prompt + output) of the step's last committed token

    def prepare_teacher(self, token_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        self._teacher_ids = token_ids.tolist()
        self._teacher_proposals: dict[tuple[int, int], list[int]] = {}

    def _proposal(self, anchor: int, k: int) -> list[int]:
        key = (anchor, k)
        if key not in self._teacher_proposals:
            self._teacher_proposals[key] = ngram_lookup(self._teacher_ids[: anchor + 1], k, self.settings)
        return self._teacher_proposals[key]
