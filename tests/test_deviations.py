"""Deviation analysis on hand-made token tables: every statistic checked against numbers worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch


from dflash_doctor.stats import deviations
from dflash_doctor.stats.deviations import ConfidenceRule, categorize, deviation_tables
from dflash_doctor.engine.divergence import TargetRows, divergence_tensor, unpack_divergence

CONFIDENT = {"target_entropy": 0.2, "target_top1_margin": 0.9}
UNSURE = {"target_entropy": 2.5, "target_top1_margin": 0.05}


def _run(steps_spec, prompts=None, turns=None):
    """Tables from ``steps_spec``: (request, class, [slots], bonus) per step, a slot being
    (draft id, target id, accepted, category, extra columns). Positions follow the live loop's schedule."""
    steps, tokens = [], []
    position = {}
    step_index = {}
    texts = {}
    for request_id, cls, slots, bonus in steps_spec:
        start = position.get(request_id, 1)
        index = step_index.get(request_id, 0)
        num_accepted = sum(1 for slot in slots if slot[2])
        steps.append(
            {
                "request_id": request_id,
                "class": cls,
                "step": index,
                "position": start,
                "k": len(slots),
                "num_drafted": len(slots),
                "num_accepted": num_accepted,
                "bonus_token": bonus,
            }
        )
        for offset, (draft, target, accepted, category, extra) in enumerate(slots, start=1):
            texts[draft], texts[target] = f"d{draft}", f"t{target}"
            tokens.append(
                {
                    "request_id": request_id,
                    "class": cls,
                    "step": index,
                    "position": start + offset - 1,
                    "offset": offset,
                    "draft_token": draft,
                    "target_token": target,
                    "draft_text": f"<{draft}>",
                    "target_text": f"<{target}>",
                    "accepted": accepted,
                    "target_category": category,
                    "target_entropy": 0.1,
                    "target_top1_margin": 0.95,
                    **extra,
                }
            )
        position[request_id] = start + num_accepted + 1
        step_index[request_id] = index + 1
    request_ids = list(dict.fromkeys(s[0] for s in steps_spec))
    requests = pd.DataFrame(
        {
            "request_id": request_ids,
            "class": [next(s[1] for s in steps_spec if s[0] == r) for r in request_ids],
            "turn": [(turns or {}).get(r, 0) for r in request_ids],
            "prompt_num_tokens": [(prompts or {}).get(r, 10) for r in request_ids],
            "output_token_ids": [list(range(100, 100 + position[r] + 1)) for r in request_ids],
        }
    )
    return pd.DataFrame(tokens), pd.DataFrame(steps), requests


def _ok(token, category="word_start"):
    return (token, token, True, category, {})


def _miss(draft, target, category="word_start", **extra):
    return (draft, target, False, category, extra)


def _after(draft, target):
    """A slot after the first rejection: never verified on the committed context."""
    return (draft, target, False, "special", {})


# --------------------------------------------------------------------------- first rejections and lost tokens


def test_first_rejection_and_lost_tokens_only_count_verified_slots():
    tokens, steps, requests = _run(
        [
            ("r", "chat", [_ok(1), _miss(9, 2), _after(3, 3), _after(4, 4)], 2),  # lost 3: slots 2-4
            ("r", "chat", [_ok(5), _ok(6), _ok(7), _ok(8)], 11),  # all accepted: no rejection
            (
                "r",
                "chat",
                [_ok(1), _after(12, 12), _after(13, 13), _after(14, 14)],
                -1,
            ),  # stop token accepted at slot 1
        ]
    )
    tables = deviation_tables(tokens, steps, requests)
    decided = tables.decided
    assert len(decided) == 2 + 4 + 1  # slots after a rejection or a stop are never decided
    rejections = decided[decided["first_rejection"]]
    assert rejections[["draft_token", "target_token", "lost_tokens"]].values.tolist() == [[9, 2, 3]]
    assert decided["lost_tokens"].sum() == 3


def test_pairs_are_ranked_by_lost_tokens_not_by_count():
    k = 4
    frequent_cheap = [("r", "code", [_ok(1), _ok(1), _ok(1), _miss(7, 8)], 8) for _ in range(3)]  # lost 1 each
    rare_costly = [("r", "code", [_miss(5, 6)] + [_after(1, 1)] * (k - 1), 6)]  # lost 4
    tokens, steps, requests = _run(frequent_cheap + rare_costly)
    pairs = deviations.pair_table(deviation_tables(tokens, steps, requests).decided)
    assert pairs[["target_token", "draft_token", "count", "lost_tokens"]].values.tolist() == [
        [6, 5, 1, 4],
        [8, 7, 3, 3],
    ]
    assert pairs["share_of_lost"].tolist() == pytest.approx([4 / 7, 3 / 7])


def test_top_pairs_carry_an_example_with_its_context():
    tokens, steps, requests = _run([("r", "chat", [_ok(100 + 1), _ok(100 + 2), _miss(7, 103)], 103)])
    summary = deviations.analyze(deviation_tables(tokens, steps, requests)).by_class["chat"]
    pair = summary.top_pairs[0]
    assert (pair.target_text, pair.draft_text, pair.count, pair.lost_tokens) == ("<103>", "<7>", 1, 1)
    assert pair.example == deviations.PatternExample(request_id="r", step=0, position=3, context="<id 100><101><102>")


# --------------------------------------------------------------------------- categories


def test_acceptance_by_category_is_accepted_over_decided():
    tokens, steps, requests = _run(
        [
            ("r", "chat", [_ok(1, "whitespace"), _ok(2, "special"), _miss(3, 4, "special"), _after(5, 5)], 4),
            ("r", "chat", [_ok(6, "special"), _miss(7, 8, "word_start"), _after(9, 9), _after(10, 10)], 8),
        ]
    )
    table = deviations.category_table(deviation_tables(tokens, steps, requests).decided).set_index("category")
    assert table.loc["special", ["num_decided", "num_accepted", "num_first_rejections", "lost_tokens"]].tolist() == [
        3,
        2,
        1,
        2,
    ]
    assert table.loc["special", "acceptance_rate"] == pytest.approx(2 / 3)
    assert table.loc["word_start", "lost_tokens"] == 3 and table.loc["word_start", "share_of_lost"] == pytest.approx(
        3 / 5
    )
    assert table.loc["whitespace", "acceptance_rate"] == 1.0
    assert table.index[0] == "word_start"  # most lost first


def test_runs_without_recorded_categories_are_uncategorised():
    tokens, steps, requests = _run([("r", "chat", [_ok(1), _miss(2, 3)], 3)])
    tables = deviation_tables(tokens.drop(columns=["target_category"]), steps, requests)
    assert set(tables.decided["category"]) == {deviations.UNCATEGORISED}


@pytest.mark.parametrize(
    "piece, text, special, expected",
    [
        ("<|im_start|>", "<|im_start|>", True, "special"),
        ("Ċ", "\n", False, "whitespace"),
        ("ĠĠĠĠ", "    ", False, "whitespace"),
        ("Ġ42", " 42", False, "number"),
        ("3.", "3.", False, "number"),
        ("),", "),", False, "punctuation"),
        ("Ġ==", " ==", False, "punctuation"),
        ("Ġself", " self", False, "code"),
        ("_id", "_id", False, "code"),
        ("getValue", "getValue", False, "code"),
        ("__init__", "__init__", False, "code"),
        ("Ġthe", " the", False, "word_start"),
        ("▁Haus", "Haus", False, "word_start"),  # SentencePiece drops the space when decoding one piece
        ("Ġвода", " вода", False, "word_start"),  # any script: the marker decides, not an English list
        ("ing", "ing", False, "word_continuation"),
        ("'ve", "'ve", False, "word_continuation"),
        ("Ġfor", " for", False, "word_start"),  # an English word is not taken for a keyword
        ("âĢ", "\ufffd", False, "other"),  # half of a multi-byte character
    ],
)
def test_categorize_from_token_strings(piece, text, special, expected):
    assert categorize(piece, text, special) == expected


def test_token_categories_read_a_real_tokenizer(qwen3_tokenizer):
    tokenizer = qwen3_tokenizer  # the real Qwen3 tokenizer (npm), fetched by setup-dev
    categories = deviations.TokenCategories(tokenizer)
    ids = {
        text: tokenizer.encode(text, add_special_tokens=False)
        for text in ("<|im_start|>", " the", "\n\n", " 7", "ness")
    }
    assert categories(ids["<|im_start|>"][0]) == "special"
    assert categories(ids[" the"][0]) == "word_start"
    assert categories(ids["\n\n"][0]) == "whitespace"
    assert categories(ids[" 7"][-1]) == "number"
    assert categories(tokenizer.convert_tokens_to_ids("ness")) == "word_continuation"


# --------------------------------------------------------------------------- confident misses and attainable tau


def test_confident_and_uncertain_misses_split_the_lost_tokens():
    tokens, steps, requests = _run(
        [
            ("r", "math", [_ok(1), _miss(2, 3, **CONFIDENT), _after(4, 4), _after(5, 5)], 3),  # confident, lost 3
            ("r", "math", [_miss(6, 7, **UNSURE), _after(8, 8), _after(9, 9), _after(1, 1)], 7),  # near tie, lost 4
            (
                "r",
                "math",
                [_miss(6, 7, target_entropy=0.2, target_top1_margin=0.1)] + [_after(1, 1)] * 3,
                7,
            ),  # sure-ish but tied: uncertain
            ("r", "math", [_ok(1), _ok(1), _ok(1), _ok(1)], 2),
        ]
    )
    split = deviations.miss_split(*_decided_and_drafts(tokens, steps, requests))
    assert (split.confident.num_first_rejections, split.confident.lost_tokens) == (1, 3)
    assert split.confident.share_of_lost == pytest.approx(3 / 11)
    assert (split.uncertain.num_first_rejections, split.uncertain.lost_tokens) == (2, 8)
    assert split.uncertain.share_of_lost == pytest.approx(8 / 11)
    # 4 drafts accepting 1 + 0 + 0 + 4; the confident step is credited its 3 lost tokens.
    assert split.tau == pytest.approx(1 + 5 / 4)
    assert split.attainable_tau == pytest.approx(1 + (5 + 3) / 4)


def test_attainable_tau_bounds_tau_and_reaches_the_block_when_every_miss_is_confident():
    rng = np.random.default_rng(0)
    spec = []
    for _ in range(40):
        n = int(rng.integers(0, 5))
        slots = [_ok(1)] * n + ([_miss(2, 3, **CONFIDENT)] + [_after(1, 1)] * (4 - n - 1) if n < 4 else [])
        spec.append(("r", "code", slots, 5))
    split = deviations.miss_split(*_decided_and_drafts(*_run(spec)))
    assert split.attainable_tau == pytest.approx(1 + 4)  # every step credited its whole block of 4
    assert split.tau is not None and split.tau < split.attainable_tau


def test_attainable_credit_walks_to_the_first_uncertain_miss_in_teacher_forced_rows():
    step = [
        _ok(1),
        _miss(2, 3, **CONFIDENT),
        _after(4, 4),
        _miss(5, 6, **CONFIDENT),
        _miss(7, 8, **UNSURE),
        _after(9, 9),
    ]
    tokens, steps, requests = _run([("r", "code", step, 3)])
    teacher = deviation_tables(tokens, steps, requests, teacher_forced=True)
    assert teacher.drafts["credited_tokens"].tolist() == [3]  # slots 2-4: a confident miss, a match, a confident miss
    assert deviations.miss_split(teacher.decided, teacher.drafts).attainable_tau == pytest.approx(1 + 1 + 3)
    live = deviation_tables(tokens, steps, requests, teacher_forced=False)
    assert live.drafts["credited_tokens"].tolist() == [5]  # live rows after a rejection say nothing: the whole block
    uncertain_first = deviation_tables(*_run([("r", "code", [_miss(2, 3, **UNSURE), _after(4, 4)], 3)]))
    assert uncertain_first.drafts["credited_tokens"].tolist() == [0]


def test_confidence_rule_comes_from_run_thresholds_and_margin_is_optional():
    rule = ConfidenceRule.from_thresholds({"confident_max_entropy": 3.0, "confident_min_margin": 0.01})
    assert (rule.max_entropy, rule.min_margin) == (3.0, 0.01)
    tokens, steps, requests = _run([("r", "chat", [_miss(6, 7, **UNSURE), _after(1, 1)], 7)])
    assert deviation_tables(tokens, steps, requests, rule).decided["confident"].tolist() == [True]
    old_run = deviation_tables(
        tokens.drop(columns=["target_top1_margin"]), steps, requests, ConfidenceRule(max_entropy=3.0)
    )
    assert old_run.decided["confident"].tolist() == [True] and not old_run.margin_recorded  # entropy alone


def _decided_and_drafts(tokens, steps, requests):
    tables = deviation_tables(tokens, steps, requests)
    return tables.decided, tables.drafts


# --------------------------------------------------------------------------- acceptance along the sequence


def test_acceptance_by_context_length_output_position_and_turn():
    # request a: short prompt, first turn, all good; request b: long prompt, second turn, misses.
    tokens, steps, requests = _run(
        [
            ("a", "chat", [_ok(1), _ok(1)], 2),
            ("b", "chat", [_ok(1), _miss(2, 3)], 3),
            ("b", "chat", [_miss(2, 3), _after(1, 1)], 3),
        ],
        prompts={"a": 10, "b": 1500},
        turns={"a": 0, "b": 1},
    )
    decided = deviation_tables(tokens, steps, requests).decided
    assert decided.loc[decided["request_id"] == "b", "context_tokens"].tolist() == [1501, 1502, 1503]
    by_context = deviations.binned_acceptance(decided, "context_tokens", deviations.CONTEXT_LENGTH_EDGES).set_index(
        "bin"
    )
    assert by_context.loc["0-127", "acceptance_rate"] == 1.0
    assert by_context.loc["1024-2047", ["num_decided", "num_accepted", "lost_tokens"]].tolist() == [3, 1, 3]
    by_turn = deviations.binned_acceptance(decided, "turn", None).set_index("bin")
    assert by_turn["acceptance_rate"].to_dict() == {0: 1.0, 1: pytest.approx(1 / 3)}
    by_position = deviations.binned_acceptance(decided, "position", (0, 2, 4)).set_index("bin")
    assert by_position["num_decided"].to_dict() == {"0-1": 2, "2-3": 3}  # empty bins are left out


# --------------------------------------------------------------------------- whole analysis and growth


def test_analyze_slices_by_class_and_overall():
    tokens, steps, requests = _run(
        [
            ("m", "math", [_ok(1, "number"), _miss(2, 3, "number")], 3),
            ("c", "chat", [_miss(4, 5, "special"), _after(1, 1)], 5),
        ]
    )
    analysis = deviations.analyze(deviation_tables(tokens, steps, requests))
    assert set(analysis.by_class) == {"chat", "math"}
    assert analysis.by_class["chat"].categories[0].category == "special"
    assert analysis.overall.lost_tokens == 1 + 2
    assert analysis.overall.num_drafts == 2
    assert "upper bound" in analysis.definitions.attainable_tau
    as_json = analysis.to_json()  # report.json's why_rejected: the same figures, as plain JSON
    assert as_json["overall"]["confident"] == {
        "num_first_rejections": analysis.overall.confident.num_first_rejections,
        "lost_tokens": analysis.overall.confident.lost_tokens,
        "share_of_lost": analysis.overall.confident.share_of_lost,
    }
    assert as_json["by_class"]["chat"]["categories"][0]["category"] == "special"


def test_grown_patterns_name_what_got_costlier_per_draft():
    base = deviation_tables(*_run([("r", "chat", [_ok(1), _miss(2, 3, "word_start"), _after(1, 1)], 3)] * 4))
    new = deviation_tables(
        *_run(
            [("r", "chat", [_miss(8, 9, "special"), _after(1, 1), _after(1, 1)], 9)] * 3
            + [("r", "chat", [_ok(1), _miss(2, 3, "word_start"), _after(1, 1)], 3)]
        )
    )
    grown = deviations.grown_patterns(base, new)
    top = grown[0]
    assert (top["class"], top["kind"], top["pattern"]) == ("chat", "category", "special")
    assert top["lost_per_draft_base"] == 0 and top["lost_per_draft_new"] == pytest.approx(9 / 4)
    assert not any(row["pattern"] == "word_start" for row in grown)  # word starts cost less per draft now
    assert {row["class"] for row in grown} == {"chat", "overall"}
    assert {row["kind"] for row in grown} <= set(deviations.PATTERN_KINDS)
    assert deviations.grown_patterns(new, base) and all(
        row["pattern"] != "special" for row in deviations.grown_patterns(new, base)
    )


# --------------------------------------------------------------------------- recorded at the source


def test_divergence_records_the_targets_top1_margin():
    target_logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]]))
    draft_logits = torch.zeros(2, 5)
    target_logits = torch.cat([target_logits, torch.full((2, 2), -30.0)], dim=1)  # room for the top-5 columns
    columns = unpack_divergence(
        divergence_tensor(draft_logits, torch.tensor([1, 0]), TargetRows.of(target_logits)).numpy()
    )
    assert columns["target_top1_margin"] == pytest.approx([0.5, 0.05], abs=1e-6)
    assert all(math.isfinite(v) for v in columns["target_entropy"])
