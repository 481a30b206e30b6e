"""The engine's commands end to end on tiny saved models: bad input exits 2 with one sentence, good input
writes a run directory.

Everything a user can point the CLI at is written by the test into ``tmp_path``: a tiny Llama target with
a ChatML tokenizer, a DFlash draft in the z-lab layout (then edited into each malformed variant), an
autoregressive draft, workload files and cost profiles. No network, no real model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from dflash_doctor import pipeline
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.models.draft_kinds import detect_draft_kind
from dflash_doctor.inputs.validation import read_config_json
from dflash_doctor.models.loading import load_dflash_draft, save_dflash_draft
from dflash_doctor.rundir.load import load_run
from cli_helpers import assert_usage_error, drafted_inside_the_answer, invoke, pair_args
from hub_cache import hub_snapshot, offline_hub_cache
from tiny_models import CLASSES, VOCAB, tiny_dflash, tiny_target, write_workload

pytestmark = pytest.mark.usefixtures("one_thread")

RUN_FILES = ("run.json", "requests.parquet", "steps.parquet", "tokens.parquet")


def edited_dflash(tiny_dir: Path, tmp_path: Path, **dflash_config) -> Path:
    """A copy of the tiny DFlash draft whose config.json dflash_config has the given values."""
    out = tmp_path / "edited"
    out.mkdir()
    (out / "model.safetensors").write_bytes((tiny_dir / "dflash" / "model.safetensors").read_bytes())
    config = json.loads((tiny_dir / "dflash" / "config.json").read_text())
    config["dflash_config"].update(dflash_config)
    (out / "config.json").write_text(json.dumps(config))
    return out


# ----------------------------------------------------------------------------------------------------
# Good input: run directories


def test_hub_ids_at_a_revision_load_from_the_cache_and_run_json_records_the_snapshot_commits(
    tiny_dir, tmp_path, monkeypatch
):
    cache = offline_hub_cache(monkeypatch, tmp_path / "hub")
    target_commit, draft_commit = "1" * 40, "2" * 40
    hub_snapshot(cache, "org/tiny-target", target_commit, tiny_dir / "target", refs=("v1",))
    hub_snapshot(cache, "org/tiny-dflash", draft_commit, tiny_dir / "dflash")
    out = tmp_path / "run"
    result = invoke(
        "replay",
        "--target",
        "org/tiny-target@v1",
        "--draft",
        "org/tiny-dflash",
        "--workload",
        tiny_dir / "workload.jsonl",
        "--max-requests",
        "1",
        "--max-new-tokens",
        "10",
        "--k",
        "3",
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    models = json.loads((out / "run.json").read_text())["models"]
    assert models["target"]["id"] == "org/tiny-target@v1" and models["target"]["hub_commit"] == target_commit
    assert models["draft"]["hub_commit"] == draft_commit
    assert models["draft"]["revision_or_hash"]  # the file hash stays beside the commit


def test_replay_detects_dflash_and_writes_a_run_directory(tiny_dir, tmp_path):
    out = tmp_path / "run"
    result = invoke(
        "replay", *pair_args(tiny_dir, tiny_dir / "dflash", "--draft-kind", "auto", "--k", "5", "--out", out)
    )
    assert result.exit_code == 0, result.output
    assert all((out / name).is_file() for name in RUN_FILES)
    run = load_run(out)
    assert run.meta["models"]["draft"]["kind"] == "dflash"
    assert run.meta["models"]["draft"]["block_size"] == 6
    assert sorted(run.requests["request_id"]) == sorted(f"{c}-{i}" for c in CLASSES for i in range(2))
    assert (run.steps["num_drafted"] <= 5).all() and run.steps["num_drafted"].max() == 5
    assert len(run.tokens) == drafted_inside_the_answer(run.steps, run.meta["config"]["max_new_tokens"])
    assert run.meta["summary"]["overall"]["num_drafts"] == int((run.steps["num_drafted"] > 0).sum())


def test_sweep_detects_autoregressive_and_recommends_a_k(tiny_dir, tmp_path):
    out = tmp_path / "sweep"
    profile = tmp_path / "costs.json"
    profile.write_text(
        json.dumps({"t_decode_s": 0.01, "t_verify_s": 0.011, "t_draft_s": {"1": 0.002, "2": 0.004, "3": 0.006}})
    )
    result = invoke(
        "sweep", *pair_args(tiny_dir, tiny_dir / "ar", "--k", "1-3", "--cost-profile", profile, "--out", out)
    )
    assert result.exit_code == 0, result.output
    assert all((out / name).is_file() for name in RUN_FILES)
    meta = json.loads((out / "run.json").read_text())
    assert meta["models"]["draft"]["kind"] == "autoregressive"
    sweep = meta["summary"]["sweep"]
    assert [row["k"] for row in sweep["overall"]] == [1, 2, 3]
    assert all(row["estimate"] == "exact" for row in sweep["overall"])  # a chain draft: one pass is exact at every K
    assert set(sweep["by_class"]) == set(CLASSES)
    assert sweep["costs"]["source"] == "profile"
    assert set(meta["recommendation"]) >= {"overall", *CLASSES}
    assert all(0 <= item["k"] <= 3 for item in meta["recommendation"].values())


def test_max_requests_samples_every_class(tiny_dir, tmp_path):
    workload = write_workload(tmp_path / "nine.jsonl", per_class=3)
    out = tmp_path / "run"
    result = invoke(
        "replay",
        "--target",
        tiny_dir / "target",
        "--draft",
        tiny_dir / "ar",
        "--workload",
        workload,
        "--max-requests",
        "3",
        "--max-new-tokens",
        "6",
        "--k",
        "2",
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(out / "requests.parquet")
    assert len(requests) == 3
    assert sorted(requests["class"]) == sorted(CLASSES)


# ----------------------------------------------------------------------------------------------------
# DFlash checkpoints in the z-lab layout


@pytest.mark.parametrize("prefix", ["", "model."])
def test_zlab_checkpoint_reproduces_the_in_memory_logits(tmp_path, prefix):
    from safetensors.torch import load_file, save_file

    target_model = tiny_target()
    draft = tiny_dflash(target_model, block_size=6)
    out = save_dflash_draft(draft, tmp_path / "draft")
    if prefix:
        weights = out / "model.safetensors"
        save_file({prefix + key: tensor for key, tensor in load_file(weights).items()}, weights)
        assert all(key.startswith(prefix) for key in load_file(weights))
    loaded = load_dflash_draft(out)
    assert loaded.config.target_layer_ids == draft.config.target_layer_ids
    assert loaded.config.mask_token_id == draft.config.mask_token_id and loaded.config.block_size == 6

    prompt = torch.tensor([5, 17, 42, 8, 9])
    logits = []
    for model in (draft, loaded):
        target = TargetModel(target_model, model.hidden_state_indices)
        proposer = DFlashProposer(model, target)
        proposer.start(prompt, target.forward(prompt).features)
        logits.append(proposer.propose(11, 5, 5).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


def test_draft_kind_auto_tells_dflash_from_autoregressive(tiny_dir):
    assert detect_draft_kind(read_config_json(tiny_dir / "dflash")).name == "dflash"
    assert detect_draft_kind(read_config_json(tiny_dir / "ar")).name == "autoregressive"


# ----------------------------------------------------------------------------------------------------
# Bad input: exit 2, one sentence, no traceback


def test_missing_target_path(tiny_dir, tmp_path):
    missing = tmp_path / "no-such-model"
    result = invoke(
        "replay", "--target", missing, "--draft", tiny_dir / "dflash", "--workload", tiny_dir / "workload.jsonl"
    )
    assert_usage_error(result, "no-such-model")


def test_dflash_hidden_size_mismatch(tiny_dir, tmp_path):
    wide_target = tiny_target(hidden=48)
    draft_dir = save_dflash_draft(tiny_dflash(wide_target), tmp_path / "wide")
    assert_usage_error(invoke("replay", *pair_args(tiny_dir, draft_dir)), "hidden_size 48", "32")


def test_dflash_fc_width_mismatch(tiny_dir, tmp_path):
    draft_dir = edited_dflash(tiny_dir, tmp_path, target_layer_ids=[0, 1, 2])  # fc was trained on 2 taps
    assert_usage_error(invoke("replay", *pair_args(tiny_dir, draft_dir)), "fc.weight", "target_layer_ids")


def test_dflash_layer_id_outside_the_target(tiny_dir, tmp_path):
    draft_dir = edited_dflash(tiny_dir, tmp_path, target_layer_ids=[0, 7])  # the target has layers 0..3
    assert_usage_error(invoke("replay", *pair_args(tiny_dir, draft_dir)), "target_layer_ids", "[7]")


def test_dflash_mask_id_outside_the_vocabulary(tiny_dir, tmp_path):
    draft_dir = edited_dflash(tiny_dir, tmp_path, mask_token_id=VOCAB)
    assert_usage_error(invoke("replay", *pair_args(tiny_dir, draft_dir)), f"mask_token_id {VOCAB}")


def test_autoregressive_draft_with_another_vocabulary(tiny_dir, tmp_path):
    other = tiny_target(vocab=VOCAB + 4)
    other.save_pretrained(tmp_path / "other")
    result = invoke("replay", *pair_args(tiny_dir, tmp_path / "other", "--draft-kind", "autoregressive"))
    assert_usage_error(result, f"vocab_size {VOCAB + 4}", f"{VOCAB}")


def test_empty_workload_file(tiny_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    result = invoke("replay", "--target", tiny_dir / "target", "--draft", tiny_dir / "dflash", "--workload", empty)
    assert_usage_error(result, "empty.jsonl", "no requests")


def test_malformed_jsonl_line_is_named_by_number(tiny_dir, tmp_path):
    broken = tmp_path / "broken.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "w1 w2"}]})
    broken.write_text(f'{good}\n{{"messages": [\n{good}\n', encoding="utf-8")
    result = invoke("replay", "--target", tiny_dir / "target", "--draft", tiny_dir / "dflash", "--workload", broken)
    assert_usage_error(result, "broken.jsonl:2")


@pytest.mark.parametrize("command", ["sweep", "replay", "check"])
def test_k_above_the_dflash_block_is_refused_before_a_run_is_written(tiny_dir, tmp_path, command):
    out = tmp_path / "run"
    assert_usage_error(
        invoke(command, *pair_args(tiny_dir, tiny_dir / "dflash", "--k", "99", "--out", out)), "--k 99", "block_size"
    )
    assert not (out / "run.json").exists()


@pytest.mark.parametrize("command", ["sweep", "check"])
def test_a_cost_profile_that_does_not_parse_is_refused_before_any_work(tiny_dir, tmp_path, command, monkeypatch):
    """Read before the models load: the refusal costs no replay, and no run directory is left behind."""
    profile = tmp_path / "costs.toml"
    profile.write_text("t_decode_s = [0.01\n", encoding="utf-8")

    def no_replay(*args, **kwargs):
        raise AssertionError("the pair was loaded before the cost profile was read")

    monkeypatch.setattr(pipeline, "load_pair", no_replay)
    monkeypatch.chdir(tmp_path)
    result = invoke(command, *pair_args(tiny_dir, tiny_dir / "dflash", "--k", "1-5", "--cost-profile", profile))
    assert_usage_error(result, "costs.toml")
    assert not (tmp_path / "runs").exists()


def test_multi_turn_request_with_its_own_limit_records_the_same_turns_live_and_teacher_forced(tiny_dir, tmp_path):
    """A later turn is asked after the answer the target gave under the request's OWN max_new_tokens.

    The regression: teacher-forced replay built turn 2's prompt from a 16-token answer while recording the
    4-token one, so its turn-2 continuation answered a prompt the run directory does not hold. The
    live loop (`replay`) and teacher-forced replay (`sweep`) must record identical turns.
    """
    workload = tmp_path / "two_turns.jsonl"
    workload.write_text(
        json.dumps(
            {
                "id": "conv",
                "class": "chat",
                "max_new_tokens": 4,
                "messages": [{"role": "user", "content": "w1 w8 w3 w9"}, {"role": "user", "content": "w5 w2 w7"}],
            }
        )
        + "\n",
        encoding="utf-8",
    )
    outputs = {}
    for command in ("replay", "sweep"):
        out = tmp_path / command
        result = invoke(
            command,
            "--target",
            tiny_dir / "target",
            "--draft",
            tiny_dir / "ar",
            "--workload",
            workload,
            "--max-new-tokens",
            "16",
            "--k",
            "3",
            "--out",
            out,
        )
        assert result.exit_code == 0, result.output
        requests = load_run(out).requests.sort_values("turn")
        assert requests["turn"].tolist() == [0, 1]
        outputs[command] = [list(ids) for ids in requests["output_token_ids"]]
        assert requests["prompt_num_tokens"].iloc[1] > requests["prompt_num_tokens"].iloc[0]
    first_answer = outputs["replay"][0]
    assert len(first_answer) == 4 and 2 not in first_answer  # cut by the request's own limit, not by EOS
    assert outputs["sweep"] == outputs["replay"]
