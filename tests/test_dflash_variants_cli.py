"""DFlash variants through the whole tool: teacher-forced replay equals the live loop, and ``check`` /
``replay`` run end to end on tiny DFlash 2 and sliding-layer drafts (official checkpoints, see
tests/official_dflash.py), recording what the draft is and which engine conventions the run used.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from official_dflash import official_config, official_model, save_official
from tiny_models import tiny_target, tiny_tokenizer, torch_threads, write_workload

from dflash_doctor.cli import app
from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.schedule import CONVENTIONS
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, token_rows, walk_schedule
from dflash_doctor.models.loading import load_dflash_draft
from dflash_doctor.rundir.load import load_run

PROMPTS = [[1, 17, 42, 8, 9, 30, 31, 44], [1, 60, 61, 5, 22]]
STEP_KEYS = ("position", "num_drafted", "num_accepted", "bonus_token")
VARIANTS = ("sliding", "causal", "scaled", "dflash2")
DIVERGENCE_COLUMNS = (
    "target_prob_of_draft",
    "draft_prob_of_target",
    "total_variation",
    "target_entropy",
    "target_top1_margin",
)


@pytest.fixture(scope="module")
def target():
    with torch_threads(1):
        model = tiny_target()
        with torch.no_grad():
            model.lm_head.weight[5:8] *= 6.0  # favoured tokens: drafts are accepted often enough to matter
        yield model


@pytest.mark.parametrize("convention", ["vllm", "official"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_teacher_forced_replay_equals_live(variant, convention, target, tmp_path):
    """One masked pass over every anchor gives the live loop's steps (DFlash 2: the selector's true-prefix
    walk), under either end-of-request convention, with a stop token that ends requests mid-run."""
    draft = load_dflash_draft(save_official(official_model(official_config(target, variant)), tmp_path))
    rule, stop = CONVENTIONS[convention], frozenset({6})
    accepted = set()
    for prompt in PROMPTS:
        wrapped = TargetModel(target, draft.hidden_state_indices)
        truth = plain_generate(wrapped, torch.tensor(prompt), max_new_tokens=30, stop_ids=stop).output_ids
        table, _ = slot_table(
            wrapped,
            DFlashProposer(draft, wrapped),
            TeacherSequence(prompt, truth),
            5,
            max_new_tokens=30,
            convention=rule,
        )
        live = speculative_generate(
            wrapped,
            DFlashProposer(draft, wrapped),
            torch.tensor(prompt),
            k=5,
            max_new_tokens=30,
            stop_ids=stop,
            convention=rule,
        )
        assert live.output_ids == truth
        walked = walk_schedule(table.matches, truth, 5, 30, stop, rule)
        assert [tuple(getattr(s, k) for k in STEP_KEYS) for s in walked] == [
            tuple(getattr(s, k) for k in STEP_KEYS) for s in live.steps
        ]
        accepted.update(s.num_accepted for s in live.steps)
    assert max(accepted) >= 1


@pytest.mark.parametrize("convention", ["vllm", "official"])
@pytest.mark.parametrize("variant", ["sliding", "dflash2"])
def test_teacher_forced_divergence_equals_live(variant, convention, target, tmp_path):
    """The per-token divergence columns of teacher-forced rows are the live loop's, the official
    convention's shortened last blocks included (no stop token, so requests run to max_new_tokens):
    accepted slots and the first rejected one were drafted on the true prefix in both paths."""
    draft = load_dflash_draft(save_official(official_model(official_config(target, variant)), tmp_path))
    rule, k, max_new = CONVENTIONS[convention], 5, 14
    compared, shortened = 0, 0
    for prompt in PROMPTS:
        wrapped = TargetModel(target, draft.hidden_state_indices)
        truth = plain_generate(wrapped, torch.tensor(prompt), max_new_tokens=max_new).output_ids
        table, _ = slot_table(
            wrapped,
            DFlashProposer(draft, wrapped),
            TeacherSequence(prompt, truth),
            k,
            max_new_tokens=max_new,
            convention=rule,
        )
        live = speculative_generate(
            wrapped, DFlashProposer(draft, wrapped), torch.tensor(prompt), k=k, max_new_tokens=max_new, convention=rule
        )
        replayed = {
            row.position: row
            for row in token_rows(table, walk_schedule(table.matches, truth, k, max_new, frozenset(), rule), truth)
        }
        num_accepted = {s.step: s.num_accepted for s in live.steps}
        for row in live.tokens:
            if row.offset > num_accepted[row.step] + 1:
                continue
            twin = replayed[row.position]
            assert twin.draft_token == row.draft_token
            for name in DIVERGENCE_COLUMNS:
                assert getattr(twin, name) == pytest.approx(getattr(row, name), rel=1e-4, abs=1e-6), name
            compared += 1
            step_position = row.position - row.offset + 1
            shortened += rule.block_k(k, max_new - step_position) < k
    assert compared > 10
    assert (shortened > 0) == (convention == "official")


@pytest.fixture(scope="module")
def pair_dir(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("variant_pair")
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    for variant in ("dflash2", "sliding"):
        save_official(official_model(official_config(target, variant)), root / variant)
    write_workload(root / "workload.jsonl", per_class=1)
    return root


@pytest.mark.parametrize("variant", ["dflash2", "sliding"])
def test_check_runs_end_to_end_on_variant_drafts(variant, pair_dir, tmp_path):
    out = tmp_path / "check"
    args = [
        "check",
        "--target",
        pair_dir / "target",
        "--draft",
        pair_dir / variant,
        "--workload",
        pair_dir / "workload.jsonl",
        "--max-new-tokens",
        "10",
        "--k",
        "5",
        "--plotly",
        "cdn",
        "--out",
        out,
    ]
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code in (0, 1), result.output  # 1 = a check failed on random weights; never a crash or a refusal
    assert all((out / name).is_file() for name in ("report.html", "report.md", "report.json", "junit.xml"))
    assert 'src="https://cdn.plot.ly/plotly-' in (out / "report.html").read_text()  # --plotly reaches check's report
    draft = json.loads((out / "run.json").read_text())["models"]["draft"]
    assert draft["architecture"] == ("DFlash2DraftModel" if variant == "dflash2" else "DFlashDraftModel")
    assert draft["causal_layers"] == ([True, False] if variant == "sliding" else [False, False])
    assert draft["format"]["dialect"] == "zlab-nested"


def test_replay_records_the_end_of_request_convention(pair_dir, tmp_path):
    runs = {}
    for convention in ("vllm", "official"):
        out = tmp_path / convention
        args = [
            "replay",
            "--target",
            pair_dir / "target",
            "--draft",
            pair_dir / "dflash2",
            "--workload",
            pair_dir / "workload.jsonl",
            "--max-new-tokens",
            "12",
            "--k",
            "5",
            "--end-of-request",
            convention,
            "--out",
            out,
        ]
        result = CliRunner().invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.output
        runs[convention] = load_run(out)
        assert runs[convention].record.config["end_of_request"] == convention
    assert list(runs["vllm"].requests["output_token_ids"].map(list)) == list(
        runs["official"].requests["output_token_ids"].map(list)
    )
