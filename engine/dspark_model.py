"""DSpark: the DFlash draft plus a Markov head that biases each slot's logits by the token before it.

Written from speculators' ``DSparkDraftModel`` (``src/speculators/models/dspark/core.py`` and
``model_definitions.py``, commit c05b95b3) and llama.cpp's ``build_dspark_markov_head``
(``src/models/dflash.cpp``, llama-cpp-python 0.3.36 sdist, commit 0c1e570):

* **Markov head** (``markov_head_type: vanilla``): slot ``k``'s logits get ``markov_w2(markov_w1[prev_k])``,
  a rank-``markov_rank`` bigram bias; ``prev_0`` is the anchor (the last committed token) and ``prev_k`` the
  token picked for slot ``k - 1``, so drafting walks the slots in order, as DFlash 2's selector does.
  Under sampling the pick is drawn from softmax((logits + bias) / T), the distribution verification uses.
* **Layout.** Only ``sample_from_anchor = false`` is modelled: slot ``k`` of ``[anchor, mask x K]`` predicts
  the token at ``anchor + k`` exactly as in DFlash (speculators' EAGLE-3-style exports). DSpark's own
  default, anchor-first (``sample_from_anchor = true``), is refused by the config reader.
* **Confidence head** (``confidence_head.proj``): loaded, not used. It predicts each slot's acceptance so
  that llama.cpp can stop a draft early under ``--spec-draft-p-min``; vLLM's DSpark proposer leaves it out
  (``v1/spec_decode/dspark.py``: confidence scheduling "deliberately out of scope"), and so do we.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_doctor.engine.dflash_model import DFlashConfig, DFlashDraftModel
from dflash_doctor.errors import UsageError


class MarkovHead(nn.Module):
    """speculators' vanilla ``MarkovHead``: ``markov_w1`` [V, r]
    embeds the previous token, ``markov_w2`` maps it to a bias [V]."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def bias(self, previous: torch.Tensor) -> torch.Tensor:
        """Logit bias [..., V] for previous-token ids [...]."""
        return self.markov_w2(self.markov_w1(previous)).float()


class DSparkDraftModel(DFlashDraftModel):
    def __init__(self, cfg: DFlashConfig):
        if not cfg.markov_rank:
            raise UsageError("the DSpark config lacks markov_rank; add it (the value the draft was trained with).")
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        if cfg.confidence_head:
            width = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_head = nn.ModuleDict({"proj": nn.Linear(width, 1)})

    def draft_tokens(self, hidden, anchor_token, lm_head, temperature, generator):
        """The Markov walk over slots: each pick is the next slot's previous token."""
        logits = self.compute_logits(hidden, lm_head)
        previous = torch.tensor(anchor_token, device=hidden.device)
        tokens, scores, probs = [], [], []
        for slot in range(hidden.shape[0]):
            slot_scores = logits[slot] + self.markov_head.bias(previous)
            if temperature > 0:
                q = torch.softmax(slot_scores / temperature, dim=-1)
                previous = torch.multinomial(q, 1, generator=generator)[0]
                probs.append(q)
            else:
                previous = slot_scores.argmax()
            tokens.append(previous)
            scores.append(slot_scores)
        if not tokens:
            return logits.argmax(dim=-1), logits, None
        return torch.stack(tokens), torch.stack(scores), (torch.stack(probs) if probs else None)

    def teacher_scores(self, hidden, predecessors, lm_head):
        """Scores with the true previous token as each slot's predecessor (speculators' training layout)."""
        return self.compute_logits(hidden, lm_head) + self.markov_head.bias(predecessors)
