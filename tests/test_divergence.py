"""Divergence columns are computed batched on the device and unpacked on the host: they must equal the
textbook definitions, and the teacher-forced replay must give the live loop's values for the same slots."""

import copy
import logging

import numpy as np
import pytest
import torch

from dflash_doctor.engine import divergence
from dflash_doctor.engine.compiled import CompiledOrEager
from dflash_doctor.engine.divergence import TOP_K, TargetRows, divergence_tensor, top_ids, unpack_divergence
from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, token_rows, walk_schedule
from tiny_models import tiny_target

FLOAT_COLUMNS = (
    "target_prob_of_draft",
    "draft_prob_of_target",
    "kl_target_draft",
    "total_variation",
    "target_entropy",
    "target_top1_margin",
)


def test_packed_columns_equal_the_definitions():
    generator = torch.Generator().manual_seed(7)
    draft = torch.randn(9, 301, generator=generator) * 3
    target = torch.randn(9, 301, generator=generator) * 3
    draft_tokens = torch.randint(0, 301, (9,), generator=generator)
    target_tokens = target.argmax(dim=-1)
    columns = unpack_divergence(divergence_tensor(draft, draft_tokens, TargetRows.of(target)).numpy())

    p, q = torch.softmax(target.double(), -1), torch.softmax(draft.double(), -1)
    rows = torch.arange(9)
    expected = {
        "target_prob_of_draft": p[rows, draft_tokens],
        "draft_prob_of_target": q[rows, target_tokens],
        "kl_target_draft": (p * (p.log() - q.log())).sum(-1),
        "total_variation": 0.5 * (p - q).abs().sum(-1),
        "target_entropy": -(p * p.log()).sum(-1),
        "target_top1_margin": p.topk(2, -1).values[:, 0] - p.topk(2, -1).values[:, 1],
    }
    for name, values in expected.items():
        np.testing.assert_allclose(columns[name], values.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    ranks = [int((draft[i] > draft[i, target_tokens[i]]).sum()) for i in range(9)]
    assert columns["target_rank_in_draft"] == ranks and all(isinstance(r, int) for r in ranks)
    assert columns["draft_topk_ids"] == draft.topk(TOP_K, -1).indices.tolist()
    assert columns["target_topk_ids"] == target.topk(TOP_K, -1).indices.tolist()


def stable_top(scores: torch.Tensor) -> torch.Tensor:
    """The top-k rule by its definition: the first TOP_K of a stable descending sort (equal scores keep id order)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :TOP_K]


@pytest.mark.parametrize("vocab", [TOP_K, 7, 301, 1025, 151_936])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_top_ids_are_a_stable_sorts_first_ids_with_ties_on_any_vocabulary(vocab, dtype):
    """Ties everywhere (eight distinct scores; the best chunks hold more tied scores than there are
    slots, and ties straddle the chunk boundaries), -0.0 beside 0.0, -inf, a last chunk shorter than the
    others: the ids are the rule's, their first is argmax's."""
    generator = torch.Generator().manual_seed(vocab)
    scores = torch.randint(-4, 4, (6, vocab), generator=generator).to(dtype)
    scores[0] = 0.0
    scores[0, ::2] = -0.0
    scores[1, : vocab // 2] = float("-inf")
    scores[2, -1] = 9.0  # the best score alone in the last chunk
    ids = top_ids(scores)
    assert torch.equal(ids, stable_top(scores))
    assert torch.equal(ids[:, 0], scores.argmax(dim=-1))
    assert ids[0].tolist() == list(range(TOP_K))


def test_top_ids_equal_torch_topk_where_no_scores_tie_and_follow_the_rule_where_bf16_ties():
    """Random scores of a 152k vocabulary at the draft head's precision: in float32 no two scores of a row
    tie and the ids are torch.topk's; in bf16 many top fives hold ties, whose order torch.topk leaves to its
    kernel, and the ids are the rule's in every row, with torch.topk's scores."""
    generator = torch.Generator().manual_seed(11)
    scores = torch.randn(48, 151_936, generator=generator) * 3
    assert torch.equal(top_ids(scores), scores.topk(TOP_K, dim=-1).indices)
    coarse = scores.bfloat16()
    values = coarse.gather(-1, stable_top(coarse))
    assert (values[:, :-1] == values[:, 1:]).any(dim=-1).sum() >= 5  # the case that matters is exercised
    assert torch.equal(top_ids(coarse), stable_top(coarse))
    assert torch.equal(coarse.gather(-1, top_ids(coarse)), coarse.topk(TOP_K, dim=-1).values)


def test_no_rows_gives_empty_columns():
    empty = divergence_tensor(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), TargetRows.of(torch.zeros(0, 5)))
    columns = unpack_divergence(empty.numpy())
    assert columns and all(values == [] for values in columns.values())


def test_windows_read_the_rows_each_slot_predicts_from():
    logits = torch.randn(7, 11)
    rows = TargetRows.of(logits, pad=3)
    windows = rows.windows(2, 4, 3)  # anchors 2..5, slots 0..2 -> rows 2 + a + j (the last ones are padding)
    index = (torch.arange(4)[:, None] + torch.arange(3)[None] + 2).clamp(max=6)
    assert torch.equal(windows.log_p, torch.log_softmax(logits, -1)[index])
    assert torch.equal(windows.tokens, logits.argmax(-1)[index])
    assert windows.topk_ids.shape == (4, 3, TOP_K) and windows.entropy.shape == (4, 3)


@pytest.mark.parametrize("block_rows", [1, 4, 7])
def test_cache_sized_blocks_give_the_numbers_of_whole_tensors(block_rows, monkeypatch):
    """The CPU computes the columns a few rows at a time (cache-sized blocks); every column is row by row,
    so the blocks must give exactly what one pass over the whole tensors (a GPU's way) gives, also for a
    subset of a window's anchors (the schedule's)."""
    torch.manual_seed(4)
    target_logits, draft_logits = torch.randn(12, 300) * 3, torch.randn(6, 3, 300) * 3
    draft_tokens = draft_logits.argmax(-1)
    anchors = torch.tensor([0, 2, 3, 5, 6, 8])

    def columns():
        rows = TargetRows.of(target_logits, pad=3)
        return rows, divergence_tensor(draft_logits, draft_tokens, rows.windows(0, 9, 3), anchors)

    monkeypatch.setattr(divergence, "CPU_BLOCK_SCORES", 10_000 * 300)
    whole_rows, whole = columns()
    monkeypatch.setattr(divergence, "CPU_BLOCK_SCORES", block_rows * 300)
    rows, blocked = columns()
    assert all(torch.equal(a, b) for a, b in zip(rows._fields(), whole_rows._fields()))
    assert torch.equal(blocked, whole)
    assert torch.equal(whole, divergence_tensor(draft_logits, draft_tokens, whole_rows.windows(0, 9, 3).take(anchors)))


def test_compiled_columns_equal_the_eager_ones_with_tied_bf16_scores():
    """What a GPU runs (:func:`divergence._fused_columns`, compiled; here by the CPU's compiler) against the
    eager columns, on bf16 draft scores with ties in their top five and a subset of the anchors: integer
    columns (ranks, top-5 ids) equal, float columns to float32 rounding."""
    generator = torch.Generator().manual_seed(5)
    target_logits = (torch.randn(24, 2000, generator=generator) * 3).bfloat16().float()
    draft_logits = (torch.randn(12, 4, 2000, generator=generator) * 3).bfloat16()
    rows = TargetRows.of(target_logits, pad=4).windows(0, 12, 4)
    anchors = torch.tensor([0, 2, 5, 11])
    draft_tokens = draft_logits[anchors].argmax(-1)
    fused = divergence._fused_columns()
    compiled = fused(draft_logits[anchors], draft_tokens, *rows._fields(), anchors)
    assert fused.failure is None  # compiled indeed, not the eager fallback
    eager = divergence._columns(draft_logits[anchors], draft_tokens, rows.take(anchors))
    ids = slice(7, 7 + TOP_K)
    assert torch.equal(compiled[..., 7:], eager[..., 7:]) and torch.equal(compiled[..., 2], eager[..., 2])
    assert torch.equal(eager[..., ids].long(), stable_top(draft_logits[anchors]))
    scores = draft_logits[anchors].float()
    assert (scores.gather(-1, stable_top(scores)).diff(dim=-1) == 0).any()  # ties among the recorded ids
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def _tied_bf16_inputs():
    generator = torch.Generator().manual_seed(5)
    target_logits = (torch.randn(24, 2000, generator=generator) * 3).bfloat16().float()
    draft_logits = (torch.randn(12, 4, 2000, generator=generator) * 3).bfloat16()
    rows = TargetRows.of(target_logits, pad=4).windows(0, 12, 4)
    anchors = torch.tensor([0, 2, 5, 11])
    return draft_logits[anchors], draft_logits[anchors].argmax(-1), rows, anchors


def test_a_compiler_failure_falls_back_to_the_eager_columns_once_with_one_warning(monkeypatch, caplog):
    """A compiled function that raises (here the Triton error torch 2.11's Inductor gave on a GPU) costs
    one warning and the eager columns, to the bit; the compiler is not tried again in the process."""
    tries = []

    def compile_that_fails(fn, **options):
        def run(*args):
            tries.append(options)
            raise ValueError("Scalar 4294967295 is out of range for type int32")

        return run

    monkeypatch.setattr(torch, "compile", compile_that_fails)
    fused = CompiledOrEager(divergence._columns_of, "divergence columns", dynamic=True)
    draft_logits, draft_tokens, rows, anchors = _tied_bf16_inputs()
    with caplog.at_level(logging.INFO, logger="dflash_doctor"):
        first = fused(draft_logits, draft_tokens, *rows._fields(), anchors)
        second = fused(draft_logits, draft_tokens, *rows._fields(), anchors)
    eager = divergence._columns(draft_logits, draft_tokens, rows.take(anchors))
    assert torch.equal(first, eager) and torch.equal(second, eager)
    assert tries == [{"dynamic": True}]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "divergence columns" in warnings[0] and "eagerly" in warnings[0]
    assert any("out of range for type int32" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_out_of_memory_in_the_compiled_path_is_raised_not_absorbed(monkeypatch):
    """The eager columns need more memory than the fused ones: falling back would fail later and slower."""

    def compile_that_runs_out(fn, **options):
        def run(*args):
            raise torch.OutOfMemoryError("CUDA out of memory")

        return run

    monkeypatch.setattr(torch, "compile", compile_that_runs_out)
    fused = CompiledOrEager(divergence._columns_of, "divergence columns")
    draft_logits, draft_tokens, rows, anchors = _tied_bf16_inputs()
    with pytest.raises(torch.OutOfMemoryError):
        fused(draft_logits, draft_tokens, *rows._fields(), anchors)
    assert fused.failure is None


def test_small_runs_never_compile_and_a_long_one_compiles_once_the_eager_work_reaches_the_threshold(monkeypatch):
    """A compile costs seconds that a small `check` never wins back: calls stay eager until their work adds up
    to ``compile_after``, the call that reaches it and every later one are compiled, and a failure ends it."""
    compiles = []

    def counting_compile(fn, **options):
        compiles.append(options)
        return fn

    monkeypatch.setattr(torch, "compile", counting_compile)
    fused = CompiledOrEager(divergence._columns_of, "divergence columns", compile_after=100, dynamic=True)
    assert [fused.wanted(30), fused.wanted(30), fused.wanted(30)] == [False, False, False]
    assert compiles == []
    assert fused.wanted(30)  # 120 scores: the eager overhead paid so far is about one compile
    draft_logits, draft_tokens, rows, anchors = _tied_bf16_inputs()
    fused(draft_logits, draft_tokens, *rows._fields(), anchors)
    assert compiles == [{"dynamic": True}] and fused.wanted(1)
    fused.failure = RuntimeError("a failed compiled call")
    assert not fused.wanted(10**12)
    assert divergence._fused_columns().compile_after == divergence.COMPILE_AFTER_SCORES > 0


def test_order_keys_stay_in_int32_for_the_id_part_at_any_vocabulary_size():
    """The id's part of a key is computed where a compiler may hold it in an int32 kernel index: it must
    fit there for every id below 2**31, and the keys must still order by score, then lower id first."""
    ids = torch.tensor([0, 1, 151_935, 2**31 - 1])
    assert int((0x7FFFFFFF - ids).min()) >= 0 and int((0x7FFFFFFF - ids).max()) <= 2**31 - 1
    scores = torch.tensor([1.0, 1.0, -0.0, float("-inf")])
    keys = divergence._order_keys(scores, ids)
    assert keys[0] > keys[1] > keys[2] > keys[3]
    extremes = divergence._order_keys(torch.tensor([float("inf"), float("-inf")]), torch.tensor([0, 2**31 - 1]))
    assert extremes[0] > extremes[1]


@pytest.mark.parametrize("k", [2, 5])
def test_teacher_rows_carry_the_live_loops_divergence(k):
    """Accepted slots and the first rejected one were drafted on the true prefix in both paths."""
    target_model = tiny_target()
    draft_model = copy.deepcopy(target_model)
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in draft_model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.004)
    prompt = [5, 17, 42, 8, 9]
    truth = plain_generate(TargetModel(target_model), torch.tensor(prompt), max_new_tokens=30).output_ids
    live = speculative_generate(
        TargetModel(target_model), AutoregressiveProposer(draft_model), torch.tensor(prompt), k=k, max_new_tokens=30
    )
    table, _ = slot_table(
        TargetModel(target_model), AutoregressiveProposer(draft_model), TeacherSequence(prompt, truth), k
    )
    replayed = token_rows(table, walk_schedule(table.matches, truth, k, 30, frozenset()), truth)
    on_true_prefix = [
        row for row in live.tokens if row.offset <= 1 + sum(s.num_accepted for s in live.steps if s.step == row.step)
    ]
    by_position = {row.position: row for row in replayed}
    assert len(on_true_prefix) > 10
    for row in on_true_prefix:
        twin = by_position[row.position]
        assert twin.draft_token == row.draft_token and twin.draft_topk_ids[0] == row.draft_topk_ids[0]
        for name in FLOAT_COLUMNS:
            assert getattr(twin, name) == pytest.approx(getattr(row, name), rel=1e-4, abs=1e-6), name
