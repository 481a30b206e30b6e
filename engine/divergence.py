"""Per-drafted-token divergence between the draft and the target, from the same forward passes.

Computed on the models' own distributions at temperature 1 (what the draft learned to imitate), not
on temperature-scaled ones, so numbers from greedy and sampled runs are comparable.

The columns are computed batched on the models' device and packed into ONE float64 tensor
(:func:`divergence_tensor`), so that a caller copies to the host once per request, never once per
column or per token: on a GPU every copy is a synchronisation that stalls the kernel queue.
:func:`unpack_divergence` turns the host copy into the ``tokens.parquet`` columns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from dflash_doctor.engine.compiled import CompiledOrEager

TOP_K = 5

# (name, width) in packing order; ids and ranks are exact in float64 (vocabularies are far below 2**53)
_LAYOUT = (
    ("target_prob_of_draft", 1),
    ("draft_prob_of_target", 1),
    ("target_rank_in_draft", 1),
    ("kl_target_draft", 1),
    ("total_variation", 1),
    ("target_entropy", 1),
    ("target_top1_margin", 1),
    ("draft_topk_ids", TOP_K),
    ("target_topk_ids", TOP_K),
)
_INTEGER_COLUMNS = frozenset({"target_rank_in_draft", "draft_topk_ids", "target_topk_ids"})
WIDTH = sum(width for _, width in _LAYOUT)


# Scores per block of the columns' passes over the vocabulary on a CPU: 16 rows of a 49k vocabulary (3 MB
# per float32 tensor) stay in cache through the dozen passes the columns take, which measured 3x less time
# than passes over whole [A, k, V] tensors that go to memory each time (the same numbers: every column
# is computed row by row). A smaller vocabulary gets more rows per block, so that the per-block
# overhead stays small beside the block's work. A GPU takes whole tensors through :func:`_fused_columns`
# once compiling has paid (COMPILE_AFTER_SCORES); before that, its eager columns go in blocks of
# GPU_BLOCK_SCORES, whose dozen float32 temporaries (256 MiB each) stay small beside any model.
CPU_BLOCK_SCORES = 16 * 49152
GPU_BLOCK_SCORES = 1 << 26

# Scores whose columns a GPU computes eagerly before it compiles them. Measured on an H200 (torch 2.11, a 152k
# vocabulary): eager columns cost about 48 ps per score, compiled ones about 8; a compile took 16 s with empty
# on-disk caches and 7 s with them filled. At 40 ps saved per score a compile pays after 2e11 to 4e11 scores;
# 2e11 is about 40 teacher-forced sequences of 2k tokens at K = 15, or 900 live-loop requests of 96 tokens:
# a small `check` never compiles, a large one compiles after its first tenth or so.
COMPILE_AFTER_SCORES = 2e11


def _block_rows(device: torch.device, total: int, vocab: int) -> int:
    return max(1, CPU_BLOCK_SCORES // max(vocab, 1)) if device.type == "cpu" else max(total, 1)


def _order_keys(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys that order (score, id) pairs by score, then by lower id first: unique per id, so a
    top-k over them has no ties. The float's bits as an int32 keep the order of the non-negative floats;
    flipping the 31 magnitude bits of the negative ones makes a larger magnitude a smaller key; -0.0 is
    taken as 0.0 (they compare equal).

    The id enters as ``INT32_MAX - id``, which stays inside int32 for any id a vocabulary has: a compiler
    may compute it in the dtype of a kernel index, and Inductor makes an ``arange`` an int32 index on a
    GPU, where the former ``0xFFFFFFFF - id`` was a constant out of range and failed to compile."""
    bits = torch.where(scores == 0, 0.0, scores.float()).view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered * (1 << 32) + (0x7FFFFFFF - ids)


def top_ids(scores: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
    """Ids of the ``k`` highest scores along the last axis, the same on every device.

    Highest first, equal scores lowest id first (the first ``k`` of a stable descending sort; the first is
    ``argmax``'s). torch.topk leaves the order of equal scores to its kernel (a CPU heap, a GPU's bitonic
    network), and bf16 scores of a 152k vocabulary tie within the top five in about a third of the rows, so
    its ids would depend on the device. Selected in three stages, each exact: the maximum of each chunk of
    scores (the only pass over the whole vocabulary, one plain reduction, where torch.topk over 152k bf16
    scores was most of the records' GPU time); the ``k`` best chunks by (maximum, lower chunk first), which
    hold the ``k`` best scores (one of them has at most ``k - 1`` better scores, so at most ``k - 1`` chunks
    rank above its own); the ``k`` best of those chunks' scores, ranked by :func:`_order_keys` (no ties left).

    Args:
        scores: [..., V] logits or probabilities, V the vocabulary size (V >= k).
        k: how many ids per row.

    Returns:
        [..., k] int64 vocabulary ids, highest score first.
    """
    vocab = scores.shape[-1]
    # chunks of about sqrt(vocab / k) scores, about as many chunk maxima as candidates: the fewest keys in
    # all; a power of two, which a CPU's vector loops reduce 3x faster in bf16 (a 152k vocabulary: 1,187
    # chunks of 128, 640 candidates)
    length = 1
    while (2 * length) ** 2 * k <= vocab:
        length *= 2
    whole = vocab // length
    maxima = scores[..., : whole * length].unflatten(-1, (whole, length)).amax(dim=-1)
    if whole * length < vocab:  # the last, shorter chunk
        maxima = torch.cat([maxima, scores[..., whole * length :].amax(dim=-1, keepdim=True)], dim=-1)
    chunk_ids = torch.arange(maxima.shape[-1], device=scores.device)
    best_chunks = _order_keys(maxima, chunk_ids).topk(k, dim=-1).indices
    candidates = (best_chunks[..., None] * length + torch.arange(length, device=scores.device)).flatten(-2)
    inside = candidates < vocab
    values = torch.where(inside, scores.gather(-1, candidates.clamp(max=vocab - 1)), float("-inf"))
    return candidates.gather(-1, _order_keys(values, candidates).topk(k, dim=-1).indices)


@functools.cache
def _fused_columns() -> CompiledOrEager:
    """:func:`_columns_of` compiled once (shapes dynamic), for GPUs, once a run's eager columns reach
    COMPILE_AFTER_SCORES; eager where this torch cannot compile it.

    Eager, the columns take about fifteen passes over [A, k, V] float32 tensors (softmax, exp, the
    products and differences of the KL and the total variation, each a temporary written and read
    back) plus a copy of the target's rows for the recorded anchors: at a 152k vocabulary that made the
    records 1.8x the teacher-forced pass. Compiled, the elementwise steps (the target's probabilities
    from its log-probabilities included) fuse into the few reductions over the vocabulary, the anchors'
    target rows are gathered inside those kernels, and :func:`top_ids`' chunk maxima are one more."""
    return CompiledOrEager(_columns_of, "divergence columns", compile_after=COMPILE_AFTER_SCORES, dynamic=True)


@dataclass(frozen=True)
class TargetRows:
    """The target's side of the columns, computed once per target row.

    In a teacher-forced pass one row of the target's scores serves up to K slots (slot j of anchor a and
    slot j - 1 of anchor a + 1 predict the same token), so its softmax, entropy and top-k are computed
    once per row and every slot reads them through a view (:meth:`windows`), never through a copy. The
    probabilities are not kept beside ``log_p``: every slot takes their exp where it reads them (inside
    the fused kernel on a GPU), which halves the target's bytes that the columns read per slot.
    """

    log_p: torch.Tensor  # [R, V] float32
    entropy: torch.Tensor  # [R]
    # how sure the target was of its own top token, p(top1) - p(top2): a miss near a tie is irreducible at T = 0
    top1_margin: torch.Tensor  # [R]
    topk_ids: torch.Tensor  # [R, TOP_K] (:func:`top_ids`)
    tokens: torch.Tensor  # [R] the target's own (argmax) token

    @classmethod
    @torch.inference_mode()
    def of(cls, target_logits: torch.Tensor, pad: int = 0) -> "TargetRows":
        """Rows of ``target_logits`` [R, V]; ``pad`` copies of the last row are appended so that windows
        reaching past the end stay in bounds (their slots have no known token and are dropped later)."""
        if pad:
            target_logits = torch.cat([target_logits, target_logits[-1:].expand(pad, -1)])
        step = _block_rows(target_logits.device, target_logits.shape[0], target_logits.shape[-1])
        blocks = [cls._block(target_logits[i : i + step]) for i in range(0, max(target_logits.shape[0], 1), step)]
        return (
            blocks[0] if len(blocks) == 1 else cls(*(torch.cat(parts) for parts in zip(*(b._fields() for b in blocks))))
        )

    @classmethod
    def _block(cls, target_logits: torch.Tensor) -> "TargetRows":
        log_p = torch.log_softmax(target_logits, dim=-1, dtype=torch.float32)
        p = log_p.exp()
        topk_ids = top_ids(target_logits)
        top2 = p.gather(-1, topk_ids[:, :2])  # softmax keeps the order: the two largest probabilities
        return cls(
            log_p=log_p,
            entropy=-(p * log_p).sum(dim=-1),
            top1_margin=top2[:, 0] - top2[:, 1],
            topk_ids=topk_ids,
            tokens=topk_ids[:, 0],
        )

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return (self.log_p, self.entropy, self.top1_margin, self.topk_ids, self.tokens)

    def windows(self, first: int, count: int, k: int) -> "TargetRows":
        """[count, k, ...] views: element [a, j] is row ``first + a + j``
        (the slots of ``count`` consecutive anchors)."""

        def view(x: torch.Tensor) -> torch.Tensor:
            return x.unfold(0, k, 1)[first : first + count].movedim(-1, 1)

        return TargetRows(*(view(x) for x in self._fields()))

    def take(self, index: torch.Tensor | slice) -> "TargetRows":
        """Entries ``index`` of every field along the first dimension (a view for a slice, a copy for a tensor)."""
        return TargetRows(*(x[index] for x in self._fields()))


@torch.inference_mode()
def divergence_tensor(
    draft_logits: torch.Tensor, draft_tokens: torch.Tensor, target: TargetRows, entries: torch.Tensor | None = None
) -> torch.Tensor:
    """The divergence columns of every drafted slot packed in one float64 tensor, left on the logits' device
    so that the caller copies to the host once (:func:`unpack_divergence`).

    Args:
        draft_logits: [..., V] the draft's logits of each slot, indexed as ``target``'s rows are, or as
            its ``entries`` are.
        draft_tokens: [...] the token the draft proposed at each slot.
        target: the target's rows for the same slots (:meth:`TargetRows.windows` views).
        entries: indices along ``target``'s first dimension (a subset of its anchors) that the slots
            belong to; None when the slots are ``target``'s rows in order.

    Returns:
        [..., WIDTH] float64 on the logits' device: per slot the columns of ``_LAYOUT`` in order.
    """
    if draft_tokens.numel() == 0:
        return torch.empty((*draft_tokens.shape, WIDTH), dtype=torch.float64, device=draft_logits.device)
    vocab = draft_logits.shape[-1]
    on_gpu = draft_logits.device.type == "cuda"
    if on_gpu and _fused_columns().wanted(draft_tokens.numel() * vocab):
        return _fused_columns()(draft_logits, draft_tokens, *target._fields(), entries)
    per_entry = draft_tokens[0].numel() if draft_tokens.dim() > 1 else 1
    block_scores = GPU_BLOCK_SCORES if on_gpu else CPU_BLOCK_SCORES
    step = max(1, block_scores // max(vocab, 1) // per_entry)
    blocks = []
    for i in range(0, draft_tokens.shape[0], step):
        rows = target.take(slice(i, i + step) if entries is None else entries[i : i + step])
        blocks.append(_columns(draft_logits[i : i + step], draft_tokens[i : i + step], rows))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def _columns_of(
    draft_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    log_p: torch.Tensor,
    entropy: torch.Tensor,
    top1_margin: torch.Tensor,
    topk_ids: torch.Tensor,
    tokens: torch.Tensor,
    entries: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`_columns` over whole tensors, the target's fields passed one by one (what a compiled function takes)."""
    target = TargetRows(log_p, entropy, top1_margin, topk_ids, tokens)
    return _columns(draft_logits, draft_tokens, target if entries is None else target.take(entries))


def _columns(draft_logits: torch.Tensor, draft_tokens: torch.Tensor, target: TargetRows) -> torch.Tensor:
    log_q = torch.log_softmax(draft_logits, dim=-1, dtype=torch.float32)
    q = log_q.exp()
    p = target.log_p.exp()
    target_tokens = target.tokens[..., None]
    draft_score_of_target = draft_logits.gather(-1, target_tokens)
    columns = (
        target.log_p.gather(-1, draft_tokens[..., None])[..., 0].exp(),
        q.gather(-1, target_tokens)[..., 0],
        (draft_logits > draft_score_of_target).sum(dim=-1),
        (p * (target.log_p - log_q)).sum(dim=-1).clamp_min(0.0),
        0.5 * (p - q).abs().sum(dim=-1),
        target.entropy,
        target.top1_margin,
    )
    packed = [column.to(torch.float64)[..., None] for column in columns]
    packed.append(top_ids(draft_logits).to(torch.float64))
    packed.append(target.topk_ids.to(torch.float64))
    return torch.cat(packed, dim=-1)


def unpack_divergence(packed: np.ndarray) -> dict[str, list]:
    """The ``tokens.parquet`` divergence columns from a :func:`divergence_tensor` copied to the host.

    Args:
        packed: [rows, WIDTH] float64, a :func:`divergence_tensor` flattened to rows and copied with
            ``.numpy()``.

    Returns:
        Column name -> one entry per row: a float, an int for the rank, a list of TOP_K ints for the
        top-k id columns.
    """
    columns: dict[str, list] = {}
    start = 0
    for name, width in _LAYOUT:
        block = packed[:, start : start + width]
        if name in _INTEGER_COLUMNS:
            block = block.astype(np.int64)
        columns[name] = (block if width > 1 else block[:, 0]).tolist()
        start += width
    return columns
