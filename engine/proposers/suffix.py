"""Suffix decoding, as vLLM's ``suffix`` speculator runs it through Arctic Inference: no weights, no target states.

The rule (vLLM ``speculative_config = {"method": "suffix", ...}``; docs/speculators.md says it in full):

* Two frequency trees over token strings of at most ``max_tree_depth`` tokens: a *local* tree per request
  (its prompt and every committed output token, the one just sampled included) and a *global* tree of
  responses (output tokens only): every earlier request's, plus the current request's own output so far.
  The global tree keeps the last ``max_cached_requests`` responses (first in, first out; 0: no global
  tree). A node's count is how often its string occurs.
* Pattern = the last ``max_tree_depth`` context tokens. For match lengths m = 1, 2, ... (below the
  pattern's length; stop at the first m whose last-m tokens are not in the tree) the draft follows the
  most frequent child from the matched node, multiplying ``child count / node count`` into a running
  probability and stopping before a token whose probability falls below ``min_token_prob``, at most
  ``floor(m * max_spec_factor + 1e-6)`` tokens, and at most ``min(K, max_model_len - len(context) - 1)``.
  Its score is the sum of its tokens' probabilities; the best score wins, a tie going to the longer
  match; between the two trees a tie goes to the local one.
* Children of equal count keep the order the engine's sibling list gives them (:meth:`SuffixTree._bump`,
  :meth:`SuffixTree._drop`): a new child goes last; a child whose count rises joins the front of its new
  count's class when it led its old class, else its back; a child whose count falls goes to the front
  of its new class. The probabilities and scores are computed in float32, as the engine does.

Worked example (the defaults: depth 24, spec factor 1, min probability 0.1), the local tree of the prompt
[1, 2, 3, 4, 1, 2, 3, 5, 1, 2]. Matching the last token 2 (m = 1, one token allowed): 3 followed it twice
in three, probability 2/3, score 2/3. Matching [1, 2] (m = 2, two tokens allowed): 3 (2/3), then 4 (4 and
5 each followed [1, 2, 3] once; the child added first leads), probability 2/3 * 1/2, score 2/3 + 1/3 = 1.
The better score wins; at K = 1 both drafts are cut to [3] and the tie goes to the longer match:

>>> from dflash_doctor.engine.proposers.suffix import SuffixCache, SuffixSettings, choose
>>> cache = SuffixCache(SuffixSettings())
>>> context = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
>>> cache.start_request(context)
>>> choose(*cache.candidates(context), cache.budget(4, len(context)))
[3, 4]
>>> choose(*cache.candidates(context), cache.budget(1, len(context)))
[3]

The global tree holds responses only. After the response [3, 4, 6], a request [9, 3] whose own text never
continued 3 is offered what followed 3 in that response (m = 1: one token):

>>> cache.add_response([3, 4, 6])
>>> cache.start_request([9, 3])
>>> choose(*cache.candidates([9, 3]), cache.budget(4, 2))
[4]

Teacher forcing: the trees at a step depend only on the text before it (never on K or the schedule),
so each anchor's candidate drafts (one per match length, before the K cap) are computed once per request
in one walk over its output; any K then picks from them exactly. A proposal at K is *not* always the
first K tokens of a proposal at a larger K (the cap changes which match length scores best), so the
proposer declares ``guesses_depend_on_k`` with ``free_passes``: the replay asks for every K, each exact.

Request order: the global tree is the proposer's state across requests. A live request begins at
:meth:`start`; a teacher-forced request begins at the first :meth:`prepare_teacher` after
:meth:`finish_request` (the passes of one request at several K all see the same trees).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from dflash_doctor.engine.proposers.base import Proposal, TargetNeeds, TokenListProposer
from dflash_doctor.engine.proposers.ngram import MAX_LOOKUP_TOKENS

F32 = np.float32
#: The most requests the global tree may keep (vLLM's default is 10,000): a count, bounded like every size.
MAX_CACHED_REQUESTS = 1 << 31


@dataclass(frozen=True)
class SuffixSettings:
    """vLLM's four ``suffix_decoding_*`` settings (its defaults) and the context cap (``max_model_len``).

    Every value is bounded: the depth by :data:`MAX_LOOKUP_TOKENS` (a longer string than any context never
    matches), the spec factor by the same number (a draft is never longer than the tree is deep, so a larger
    factor drafts nothing more, and ``m * factor`` stays finite in float32, where the engine computes it)."""

    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_tree_depth <= MAX_LOOKUP_TOKENS:
            raise ValueError(
                f"suffix_decoding_max_tree_depth={self.max_tree_depth} must be in [1, {MAX_LOOKUP_TOKENS}]"
            )
        if not 0 <= self.max_cached_requests <= MAX_CACHED_REQUESTS:
            raise ValueError(
                f"suffix_decoding_max_cached_requests={self.max_cached_requests} must be in [0, {MAX_CACHED_REQUESTS}]"
            )
        if not 0 <= self.max_spec_factor <= MAX_LOOKUP_TOKENS:
            raise ValueError(
                f"suffix_decoding_max_spec_factor={self.max_spec_factor} must be in [0, {MAX_LOOKUP_TOKENS}]"
            )
        if not 0 <= self.min_token_prob <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob={self.min_token_prob} must be in [0, 1]")


class _Node:
    __slots__ = ("token", "count", "children", "order")

    def __init__(self, token: int = -1, count: int = 0):
        self.token = token
        self.count = count
        # made on the first child (most nodes are leaves): children by token, and the same nodes by
        # decreasing count with ties in the engine's sibling order
        self.children: dict[int, _Node] | None = None
        self.order: list[_Node] | None = None


class SuffixTree:
    """Every substring of at most ``depth`` tokens of the sequences it holds, with its number of occurrences."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()
        self.sequences: dict[int, list[int]] = {}
        self._active: dict[int, deque[_Node]] = {}

    def append(self, seq_id: int, token: int) -> None:
        active = self._active.setdefault(seq_id, deque())
        self.sequences.setdefault(seq_id, []).append(token)
        active.append(self.root)
        self.root.count += 1
        if len(active) > self.depth:
            active.popleft()
        for j, node in enumerate(active):
            if node.children is None:
                node.children, node.order = {}, []
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(token, 1)
                node.order.append(child)  # type: ignore[union-attr]
            else:
                self._bump(node, child)
            active[j] = child

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(seq_id, token)

    def remove(self, seq_id: int) -> None:
        """Take a sequence out: every occurrence it contributed is uncounted, start by start."""
        sequence = self.sequences.pop(seq_id)
        self._active.pop(seq_id, None)
        for start in range(len(sequence)):
            node = self.root
            node.count -= 1
            for token in sequence[start : start + self.depth]:
                child = node.children.get(token) if node.children is not None else None
                if child is None:
                    break
                if child.count > 1:
                    self._drop(node, child)
                else:
                    del node.children[token]  # type: ignore[union-attr]
                    node.order.remove(child)  # type: ignore[union-attr]
                    break
                node = child

    @staticmethod
    def _bump(parent: _Node, child: _Node) -> None:
        """count + 1; led its class -> front of the new class, else its back."""
        order, old = parent.order, child.count
        assert order is not None
        i = order.index(child)
        led = i == 0 or order[i - 1].count != old
        del order[i]
        child.count = old + 1
        if led:
            while i > 0 and order[i - 1].count == old + 1:
                i -= 1
        else:
            while i > 0 and order[i - 1].count == old:
                i -= 1
        order.insert(i, child)

    @staticmethod
    def _drop(parent: _Node, child: _Node) -> None:
        """count - 1: to the front of its new class (behind every sibling still at the old count)."""
        order, old = parent.order, child.count
        assert order is not None
        i = order.index(child)
        del order[i]
        child.count = old - 1
        while i < len(order) and order[i].count == old:
            i += 1
        order.insert(i, child)

    def find(self, tokens: Sequence[int]) -> _Node | None:
        node: _Node | None = self.root
        for token in tokens:
            node = node.children.get(token) if node.children is not None else None  # type: ignore[union-attr]
            if node is None:
                return None
        return node


@dataclass
class Candidate:
    """One match length's draft before the K cap: its tokens and the float32 running sum of their probabilities."""

    match_len: int
    tokens: list[int]
    scores: list[F32]  # scores[j] = score of the first j tokens (scores[0] = 0)


def candidates(
    tree: SuffixTree, pattern: Sequence[int], settings: SuffixSettings, limit: int | None = None
) -> list[Candidate]:
    """Each match length's draft from one tree, computed once so that any budget can pick from them exactly.

    The greedy path follows the most frequent child from the matched node, multiplying ``child count /
    node count`` into a running float32 probability, and stops before a token whose probability falls
    below ``min_token_prob``.

    Args:
        tree: the local or global suffix tree.
        pattern: the last ``max_tree_depth`` context tokens.
        settings: the suffix settings (``max_spec_factor``, ``min_token_prob``).
        limit: the most tokens per draft (the engine's cap by the model length); None for no cap beyond
            the spec factor's.

    Returns:
        One candidate per match length m = 1 .. len(pattern) - 1, up to the first m whose last m tokens
        are not in the tree; each at most ``floor(m * max_spec_factor + 1e-6)`` tokens (and ``limit``).
    """
    out: list[Candidate] = []
    factor, floor_prob = F32(settings.max_spec_factor), F32(settings.min_token_prob)
    for m in range(1, len(pattern)):
        node = tree.find(pattern[len(pattern) - m :])
        if node is None:
            break
        cap = max(int(float(F32(m) * factor) + 1e-6), 0)
        if limit is not None:
            cap = min(cap, limit)
        tokens: list[int] = []
        scores = [F32(0.0)]
        prob = F32(1.0)
        while len(tokens) < cap and prob >= floor_prob and node.order:  # type: ignore[union-attr]
            child = node.order[0]
            prob = F32(prob * (F32(child.count) / F32(node.count)))
            if not prob >= floor_prob:
                break
            tokens.append(child.token)
            scores.append(F32(scores[-1] + prob))
            node = child
        out.append(Candidate(m, tokens, scores))
    return out


def choose(local: list[Candidate], global_: list[Candidate], budget: int) -> list[int]:
    """The draft at a budget of ``budget`` tokens: best score per tree (ties to the longer match), local on a tie.

    Args:
        local: the local tree's candidates, shortest match first (:func:`candidates`).
        global_: the global tree's candidates, shortest match first.
        budget: the most tokens the draft may have (each candidate is cut to it before scoring).

    Returns:
        The winning candidate's tokens cut to ``budget``; empty when no candidate has a token.
    """

    def best(cands: list[Candidate]) -> tuple[F32, list[int]]:
        score, tokens = F32(0.0), []
        for c in cands:
            n = min(budget, len(c.tokens))
            if c.scores[n] >= score:
                score, tokens = c.scores[n], c.tokens[:n]
        return score, tokens

    local_score, local_tokens = best(local)
    global_score, global_tokens = best(global_)
    return local_tokens if local_score >= global_score else global_tokens


class SuffixCache:
    """The per-request local tree and the global tree of responses, as the engine keeps them (FIFO eviction)."""

    def __init__(self, settings: SuffixSettings):
        self.settings = settings
        self.global_tree = SuffixTree(settings.max_tree_depth)
        self.cached: deque[int] = deque()  # response sequence ids in the global tree, oldest first
        self.local: SuffixTree | None = None
        self.seq_id: int | None = None
        self._next = 0

    def start_request(self, prompt_ids: Sequence[int]) -> None:
        self.local = SuffixTree(self.settings.max_tree_depth)
        self.local.extend(0, prompt_ids)
        self.seq_id = None
        if self.settings.max_cached_requests:
            self.seq_id = self._next
            self._next += 1
            self.cached.append(self.seq_id)
            while len(self.cached) > self.settings.max_cached_requests:
                evicted = self.cached.popleft()
                if evicted in self.global_tree.sequences:
                    self.global_tree.remove(evicted)

    def add_response(self, token_ids: Sequence[int]) -> None:
        assert self.local is not None
        self.local.extend(0, token_ids)
        if self.seq_id is not None:
            self.global_tree.extend(self.seq_id, token_ids)

    def candidates(self, context: Sequence[int], limit: int | None = None) -> tuple[list[Candidate], list[Candidate]]:
        assert self.local is not None
        pattern = list(context[-self.settings.max_tree_depth :])
        return candidates(self.local, pattern, self.settings, limit), candidates(
            self.global_tree, pattern, self.settings, limit
        )

    def budget(self, k: int, context_len: int) -> int:
        """``min(K, max_model_len - len(context) - 1)``, never below 0."""
        if self.settings.max_model_len is not None:
            k = min(k, self.settings.max_model_len - context_len - 1)
        return max(k, 0)


class SuffixProposer(TokenListProposer):
    kind = "suffix"
    needs = TargetNeeds()
    guesses_depend_on_k = True
    free_passes = True
    remembers_requests = True

    def __init__(self, settings: SuffixSettings, vocab_size: int, device: torch.device | str = "cpu"):
        super().__init__(vocab_size, device)
        self.settings = settings
        self.cache = SuffixCache(settings)
        self.context: list[int] = []
        self._teacher_open = False  # a teacher-forced request has begun and not finished
        self._live_open = False  # a live request has begun and not finished
        self._in_trees = 0  # context tokens already in the trees (live)
        self._teacher_ids: list[int] = []
        self._anchors: dict[int, tuple[list[Candidate], list[Candidate]]] | None = (
            None  # per anchor, both trees' candidates
        )
        self._walked = 0  # teacher ids already in the trees

    # live loop: start_request at start, the sampled token enters the trees at propose, the accepted drafts at accept

    def start(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None) -> None:
        self._teacher_open, self._live_open = False, True
        self.context = prompt_ids.tolist()
        self.cache.start_request(self.context)
        self._in_trees = len(self.context)

    def propose(self, last_token: int, k: int, block_k: int) -> Proposal:
        if self._in_trees == len(self.context):
            self.context.append(last_token)
            self.cache.add_response([last_token])
            self._in_trees += 1
        budget = self.cache.budget(block_k, len(self.context))
        local, global_ = self.cache.candidates(self.context, budget)
        tokens = choose(local, global_, budget)[:k]
        return Proposal(
            tokens=torch.tensor(tokens, dtype=torch.long, device=self.device),
            logits=self._point_mass(tokens, len(tokens)),
            probs=None,
        )

    def accept(self, committed_ids: torch.Tensor, committed_features: torch.Tensor | None) -> None:
        drafts = committed_ids.tolist()[1:]  # committed[0] is the sampled token, already in the trees
        self.context.extend(drafts)
        self.cache.add_response(drafts)
        self._in_trees = len(self.context)

    def finish_request(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """The replay is done with this request: its whole output is in the trees, as the engine adds the
        last step's sampled tokens too (``output_ids`` then holds those past the end as well). A teacher-forced
        request too short to have any anchor (one output token) enters them here."""
        if self._teacher_open and self._anchors is None:
            self.cache.start_request(list(prompt_ids))
            self.cache.add_response(list(output_ids))
        elif self._teacher_open:  # the walk stopped at the last anchor asked for
            self.cache.add_response(list(output_ids)[self._walked - len(prompt_ids) :])
        elif self._live_open:  # the last step's sampled token has not been proposed from: it enters now
            self.cache.add_response(list(output_ids)[self._in_trees - len(prompt_ids) :])
        self._teacher_open = self._live_open = False

    # teacher forcing: anchor a is the index (in prompt + output) of the step's last committed token

    def prepare_teacher(self, token_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        ids = token_ids.tolist()
        if self._teacher_open and ids == self._teacher_ids:
            return  # another pass (another K) over the same request: the same trees
        self._teacher_open, self._live_open = True, False
        self._teacher_ids = ids
        self._anchors = None

    def _walk(self, anchor: int) -> None:
        """The request's walk up to ``anchor``: started at the first anchor asked for (the teacher asks from output
        index 0, where the prompt ends), then per output token, add it and keep that anchor's candidates. It
        stops at the last anchor asked for: the ids past it (the target's tokens past the output's end) enter
        the trees only as far as the engine sampled them (:meth:`finish_request`)."""
        ids = self._teacher_ids
        if self._anchors is None:
            self.cache.start_request(ids[:anchor])
            self._anchors, self._walked = {}, anchor
        for a in range(self._walked, anchor + 1):
            self.cache.add_response([ids[a]])
            self._anchors[a] = self.cache.candidates(ids[max(a + 1 - self.settings.max_tree_depth, 0) : a + 1])
        self._walked = max(self._walked, anchor + 1)

    def _proposal(self, anchor: int, k: int) -> list[int]:
        self._walk(anchor)
        assert self._anchors is not None
        local, global_ = self._anchors[anchor]
        return choose(local, global_, self.cache.budget(k, anchor + 1))
