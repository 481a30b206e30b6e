"""DFlash 2: the DFlash draft plus per-layer dynamic causal convolutions and a candidate selector.

Written from the official ``DFlash2DraftModel`` (PyPI ``dflash`` 0.1.0, ``dflash/model.py``), which vLLM
0.33 and SGLang serve for z-lab's DFlash-2 collection; tests/test_dflash_oracle.py holds the two equal.

* **Convolutions.** Every layer wraps attention and the MLP each in a :class:`GroupedDynamicCausalConv`:
  before the sub-block the normed rows are convolved causally along the block (slot ``t`` mixes slots
  ``t, t-1, .. t-kernel+1``, zeros before the block start) with a static per-channel kernel plus a
  per-row, per-group kernel projected from those same rows; the sub-block's output is convolved again
  with the second half of both kernels. Channels are grouped ``conv_group_size`` at a time for the
  dynamic part.
* **Candidate selector.** Each slot keeps the ``selector_top_k`` best tokens of its draft logits. The
  walk goes slot by slot: a candidate's score is its logit plus a low-rank bigram term
  ``<pred[previous pick] * proj(hidden), succ[candidate]>`` (``selector_rank`` wide codebooks,
  ``predecessor_codebook`` / ``successor_codebook``; the first slot's predecessor is the anchor token).
  Greedy picks the best score; under sampling the pick is drawn from softmax(score / T) over the
  candidates, which is the draft distribution rejection sampling must use. Checkpoints store the two
  codebooks without the ``.weight`` suffix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_doctor.engine.dflash_model import DFLASH2_ARCHITECTURE, DSPARK_ARCHITECTURE, DFlashConfig, DFlashDraftModel
from dflash_doctor.engine.dspark_model import DSparkDraftModel
from dflash_doctor.errors import UsageError

#: Scores of tokens outside a slot's candidates: finite (divergence columns take logs), far below any logit.
NOT_A_CANDIDATE = -1e30


def _per_block(x: torch.Tensor, block_length: int) -> torch.Tensor:
    """[B, S, H] -> [B * S / block_length, block_length, H]: the convolution never crosses blocks."""
    return x.reshape(-1, block_length, x.shape[-1])


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise UsageError(
                f"dflash_config.conv_group_size {group_size} does not "
                f"divide hidden_size {hidden_size}; fix the draft config."
            )
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))  # [before/after, tap, channel]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, rows: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """rows [N, L, H]; dynamic [N, L, kernel, groups] (per output row); base [kernel, H]."""
        n, length, hidden = rows.shape
        grouped = rows.view(n, length, self.groups, self.group_size)
        out = torch.zeros_like(grouped)
        for tap in range(self.kernel_size):
            shifted = F.pad(grouped[:, : length - tap], (0, 0, 0, 0, tap, 0)) if tap else grouped
            weight = base[tap].view(1, 1, self.groups, self.group_size).to(rows.dtype) + dynamic[:, :, tap, :, None]
            out = out + weight * shifted
        return out.view(n, length, hidden)

    def prepare(self, h: torch.Tensor, block_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Convolve the sub-block's input; return it and the dynamic kernel kept for :meth:`finish`."""
        shape = h.shape
        rows = _per_block(h, block_length)
        dynamic = self.kernel_projection(rows).view(*rows.shape[:2], 2, self.kernel_size, self.groups)
        before = self._convolve(rows, dynamic[:, :, 0], self.base_kernel[0])
        return before.view(shape), dynamic[:, :, 1]

    def finish(self, out: torch.Tensor, dynamic: torch.Tensor, block_length: int) -> torch.Tensor:
        return self._convolve(_per_block(out, block_length), dynamic, self.base_kernel[1]).view(out.shape)


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(
        self, projected: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor, predecessor: torch.Tensor
    ) -> torch.Tensor:
        """Candidate scores [..., top_k] of one slot: projected [...,
        r], unary/candidates [..., top_k], predecessor [...]."""
        query = self.predecessor_codebook(predecessor) * projected  # [..., r]
        return unary + (self.successor_codebook(candidates) * query[..., None, :]).sum(-1)


class DFlash2DraftModel(DFlashDraftModel):
    def __init__(self, cfg: DFlashConfig):
        kernel, group, rank, top_k = cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k
        if kernel is None or group is None or rank is None or top_k is None:
            missing = [
                k
                for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
                if getattr(cfg, k) is None
            ]
            raise UsageError(
                f"the DFlash 2 config lacks dflash_config.{missing[0]}; add it (the value the draft was trained with)."
            )
        super().__init__(cfg)
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, kernel, group)
            layer.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, kernel, group)
        self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.hidden_size, rank, int(top_k))

    def _candidates(self, hidden: torch.Tensor, lm_head: nn.Module):
        logits = self.compute_logits(hidden, lm_head)
        unary, candidates = torch.topk(logits, self.candidate_selector.top_k, dim=-1)
        projected = self.candidate_selector.hidden_projection(hidden.to(self.fc.weight.dtype)).float()
        return logits, unary, candidates, projected

    @staticmethod
    def _scatter(candidates: torch.Tensor, values: torch.Tensor, vocab: int, fill: float) -> torch.Tensor:
        out = torch.full((*candidates.shape[:-1], vocab), fill, dtype=values.dtype, device=values.device)
        return out.scatter(-1, candidates, values)

    def draft_tokens(self, hidden, anchor_token, lm_head, temperature, generator):
        """The selector's walk over slots: each pick becomes the next slot's predecessor."""
        logits, unary, candidates, projected = self._candidates(hidden, lm_head)
        selector = self.candidate_selector
        predecessor = torch.tensor(anchor_token, device=hidden.device)
        tokens, scores, probs = [], [], []
        for slot in range(hidden.shape[0]):
            slot_scores = selector.scores(projected[slot], unary[slot], candidates[slot], predecessor)
            if temperature > 0:
                q = torch.softmax(slot_scores / temperature, dim=-1)
                index = torch.multinomial(q, 1, generator=generator)[0]
                probs.append(self._scatter(candidates[slot], q, logits.shape[-1], 0.0))
            else:
                index = slot_scores.argmax()
            predecessor = candidates[slot, index]
            tokens.append(predecessor)
            scores.append(self._scatter(candidates[slot], slot_scores, logits.shape[-1], NOT_A_CANDIDATE))
        if not tokens:
            return candidates[:, 0], logits, None
        return torch.stack(tokens), torch.stack(scores), (torch.stack(probs) if probs else None)

    def teacher_scores(self, hidden, predecessors, lm_head):
        """Selector scores with the true previous token as each slot's predecessor: slot j is only ever
        judged after slots < j matched, when the walk's pick there was exactly that token."""
        logits, unary, candidates, projected = self._candidates(hidden, lm_head)
        slot_scores = self.candidate_selector.scores(projected, unary, candidates, predecessors)
        return self._scatter(candidates, slot_scores, logits.shape[-1], NOT_A_CANDIDATE)


#: Safetensors names of the codebooks in DFlash 2 checkpoints (no ``.weight``) -> our parameter names.
CHECKPOINT_KEY_RENAMES = {
    f"candidate_selector.{name}": f"candidate_selector.{name}.weight"
    for name in ("predecessor_codebook", "successor_codebook")
}


def draft_model_class(cfg: DFlashConfig) -> type[DFlashDraftModel]:
    """The module class for a config's architecture (the one place that maps it).

    Args:
        cfg: the draft's config; its ``architecture`` picks the class.

    Returns:
        :class:`DFlash2DraftModel` or :class:`DSparkDraftModel` for their architectures, plain
        :class:`DFlashDraftModel` for any other.
    """
    return {DFLASH2_ARCHITECTURE: DFlash2DraftModel, DSPARK_ARCHITECTURE: DSparkDraftModel}.get(
        cfg.architecture, DFlashDraftModel
    )
