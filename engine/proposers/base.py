"""The one small interface every draft kind implements.

A proposer *declares* what it needs from the target (:class:`TargetNeeds`), and the live loop and the
teacher-forced replay read that declaration; neither ever branches on the proposer's type (a lesson from
vLLM #43986, where an engine branch hard-coded a DFlash flag instead of asking the proposer).

Life cycle for one sequence::

    start(prompt_ids, prompt_features)         # after the target's prefill
    loop:
        proposal = propose(last_token, k, block_k)   # up to k tokens offered for verification
        accept(committed_ids, committed_features)     # [last, d1..dn]: rows now in the target's context
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class TargetNeeds:
    """What a proposer consumes from target forwards.

    hidden_state_indices: HF ``hidden_states`` indices whose rows are concatenated into "features"
    (for DFlash, ``target_layer_id + 1``; ``-1`` the final output after the decoder's norm,
    :data:`~dflash_doctor.engine.target.PRE_FINAL_NORM` the same output before it). Empty means the
    target runs without hidden-state output.
    """

    hidden_state_indices: tuple[int, ...] = ()


def required_features(features: torch.Tensor | None, kind: str) -> torch.Tensor:
    """The target's hidden states a proposer declared in its needs, checked present.

    The loops pass them because the needs name the layers to tap, so None here is a caller that forgot
    ``taps=proposer.needs.hidden_state_indices`` (a programming error, not bad input).

    Args:
        features: the tapped hidden states the loop passed, or None.
        kind: the proposer's kind, for the error message.

    Returns:
        ``features``, unchanged.

    Raises:
        ValueError: when ``features`` is None.
    """
    if features is None:
        raise ValueError(
            f"the {kind} proposer got no target hidden states; pass taps=proposer.needs.hidden_state_indices"
        )
    return features


@dataclass
class Proposal:
    """``tokens`` [k]; ``logits`` [k, V] the draft's raw scores per slot (for divergence records);
    ``probs`` [k, V] the distribution the tokens were SAMPLED from, or None for greedy (argmax) drafts."""

    tokens: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor | None


class Proposer(ABC):
    """A draft model driven one sequence at a time."""

    kind: str
    needs: TargetNeeds = TargetNeeds()

    @property
    def max_k(self) -> int | None:
        """Most tokens one step can draft (DFlash: block_size - 1); None = unbounded."""
        return None

    @abstractmethod
    def start(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None) -> None:
        """Begin a sequence whose prompt the target has just prefilled (prompt_ids [P], features [P, F])."""

    @abstractmethod
    def propose(self, last_token: int, k: int, block_k: int) -> Proposal:
        """Draft ``k`` tokens following ``last_token``; ``block_k`` >= k is the step's configured K, which a
        block drafter uses as its block length so its guesses do not depend on the remaining budget."""

    @abstractmethod
    def accept(self, committed_ids: torch.Tensor, committed_features: torch.Tensor | None) -> None:
        """The verified step committed ``committed_ids`` [n + 1] = [last, d1..dn] into the target context."""

    # Teacher-forced replay (engine/teacher.py): the whole sequence is known in advance.

    #: True when a slot's guess depends on the block length K (a block drafter attends to all its slots),
    #: so guesses for a smaller K are only *estimated* by truncating a longer block.
    guesses_depend_on_k: bool = False

    #: True when a teacher pass costs no draft-model forward (a lookup proposer): with
    #: ``guesses_depend_on_k`` the replay then runs one exact pass per K without being asked to.
    free_passes: bool = False

    #: True for a proposer whose guesses depend on the requests before (:meth:`finish_request`): a replay
    #: split over ranks would give each rank another history, so it runs in one process.
    remembers_requests: bool = False

    def finish_request(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """The replay is done with one request (called in the replay's request order, after its live run or
        its teacher-forced passes). A proposer with memory across requests (suffix decoding's tree of
        earlier responses) takes the request in; the default keeps nothing."""

    def samples_drafts(self, temperature: float) -> bool:
        """Whether drafts are sampled from ``probs`` at this temperature (False: greedy, one-hot drafts)."""
        return False

    def proposal_lengths(self, anchors: torch.Tensor, k: int) -> torch.Tensor | None:
        """How many of the ``k`` slots each anchor's step really drafts ([A] on the host), for a proposer whose
        :meth:`propose` may return fewer than k tokens (a lookup that finds no match drafts none: that step
        is a plain decode step). None: every step drafts all k (the default)."""
        return None

    @abstractmethod
    def prepare_teacher(self, token_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        """Take a known sequence (token_ids [T], target features [T, F]) for :meth:`slot_logits` calls."""

    @abstractmethod
    def slot_logits(self, anchors: torch.Tensor, k: int) -> torch.Tensor:
        """Draft logits [A, k, V] for slots 1..k of the steps whose last committed token sits at each of
        ``anchors`` [A], with every earlier token taken from the known sequence (teacher forcing).

        ``anchors`` is a CPU tensor, so that an implementation can size its work from it without waiting
        for the GPU; the logits may be in the model's dtype (upcast before taking probabilities)."""

    def slot_scorer(self, anchors: torch.Tensor, k: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """:meth:`slot_logits` on demand: ``scores(rows, slots)`` -> [M, V] are the logits of slot
        ``slots[m] + 1`` of anchor ``anchors[rows[m]]`` (the same numbers, row by row).

        A replay that only needs how far each guess run matches asks for slot j only where slots < j
        matched (about 1.6 of K slots at the demo's acceptance). This default evaluates every slot at once;
        a drafter whose vocabulary head is most of its cost evaluates the head per request instead."""
        logits = self.slot_logits(anchors, k)
        return lambda rows, slots: logits[rows, slots]


class TokenListProposer(Proposer):
    """A weightless proposer whose draft is a list of token ids (n-gram lookup, suffix trees): its logits are a
    point mass on each proposed token, and its teacher-forced slots are built from ``_proposal(anchor, k)``
    alone, so every such kind shares one way of turning a token list into the rows the replay reads."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu"):
        self.vocab_size = vocab_size
        self.device = torch.device(device)

    def _point_mass(self, tokens: Sequence[int], rows: int) -> torch.Tensor:
        """[rows, V] logits: 0 at each proposed token, -inf elsewhere (rows past the proposal all -inf)."""
        logits = torch.full((rows, self.vocab_size), float("-inf"), device=self.device)
        if tokens:
            logits[torch.arange(len(tokens), device=self.device), torch.tensor(list(tokens), device=self.device)] = 0.0
        return logits

    @abstractmethod
    def _proposal(self, anchor: int, k: int) -> list[int]:
        """The tokens drafted at teacher-forced anchor ``anchor`` (after prepare_teacher) with K = ``k``."""

    def proposal_lengths(self, anchors: torch.Tensor, k: int) -> torch.Tensor:
        return torch.tensor([len(self._proposal(int(a), k)) for a in anchors.tolist()], dtype=torch.long)

    def slot_logits(self, anchors: torch.Tensor, k: int) -> torch.Tensor:
        return (
            torch.stack([self._point_mass(self._proposal(int(a), k), k) for a in anchors.tolist()])
            if len(anchors)
            else torch.empty(0, k, self.vocab_size, device=self.device)
        )

    def slot_scorer(self, anchors: torch.Tensor, k: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Rows built on demand: a point mass row per (anchor, slot) asked for, no [A, k, V] tensor."""
        proposals = [self._proposal(int(a), k) for a in anchors.tolist()]

        def scores(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            out = torch.full((len(rows), self.vocab_size), float("-inf"), device=self.device)
            for m, (row, slot) in enumerate(zip(rows.tolist(), slots.tolist())):
                if slot < len(proposals[row]):
                    out[m, proposals[row][slot]] = 0.0
            return out

        return scores
