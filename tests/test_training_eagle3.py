"""train-draft --draft-kind eagle3: an EAGLE-3 head trained against a tiny in-process target learns to draft,
is trained in the layout the proposer drafts in, saves in the speculators layout the eagle3 kind loads,
resumes bit for bit, and refuses the other kind's flags."""

from __future__ import annotations

import json

import pytest
import torch

from cli_helpers import assert_usage_error, invoke
from dflash_doctor.engine.proposers.eagle3 import Eagle3Proposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.models.eagle3_format import load_eagle3_head
from dflash_doctor.models.training import (
    SequenceRecord,
    TrainConfig,
    chain_rows,
    draft_vocabulary,
    extract_features,
    held_out_steps,
    new_eagle3_head,
    speculators_config,
    tau_by_class,
    train_eagle3_head,
    vocabulary_maps,
)
from dflash_doctor.models.training.checkpoints import save_draft
from tiny_models import markov_target, torch_threads

AUX_IDS = [1, 2, 3]
TTT = 4
NEW_TOKENS = 20
STOP_IDS = frozenset({2})


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with torch_threads(1):
        yield


def greedy_records(target, count: int, seed: int) -> list[SequenceRecord]:
    generator = torch.Generator().manual_seed(seed)
    records = []
    for i in range(count):
        prompt = torch.randint(
            4, 97, (int(torch.randint(3, 8, (1,), generator=generator)),), generator=generator
        ).tolist()
        with torch.no_grad():
            out = target.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        records.append(
            SequenceRecord(
                request_id=f"r{i}", request_class="chat", turn=0, token_ids=out[0].tolist(), prompt_length=len(prompt)
            )
        )
    return records


def new_head(target, records, vocab: int = 48):
    draft_ids, _ = draft_vocabulary([r.token_ids[r.prompt_length :] for r in records], target.config.vocab_size, vocab)
    config = speculators_config(
        target, aux_layer_ids=AUX_IDS, draft_vocab_size=vocab, ttt_steps=TTT, target_spec="tiny"
    )
    return new_eagle3_head(target, config, draft_ids, seed=0), config


def train(target, records, head, config, steps: int, **kwargs):
    train_config = TrainConfig(
        steps=steps,
        batch_size=8,
        anchors_per_sequence=6,
        lr=3e-3,
        log_every=kwargs.pop("log_every", 10),
        checkpoint_every=kwargs.pop("checkpoint_every", 500),
    )
    return train_eagle3_head(
        target,
        [r.token_ids for r in records],
        [r.prompt_length for r in records],
        train_config,
        head,
        ttt_steps=TTT,
        head_config=config,
        **kwargs,
    )


@pytest.fixture(scope="module")
def trained():
    target = markov_target()
    records, held_out = greedy_records(target, 48, seed=0), greedy_records(target, 10, seed=1)
    head, config = new_head(target, records)
    before = tau_by_class(held_out_steps(target, head, held_out, stop_ids=STOP_IDS, k=TTT))["overall"]["tau"]
    result = train(target, records, head, config, steps=200)
    after = tau_by_class(held_out_steps(target, result.draft, held_out, stop_ids=STOP_IDS, k=TTT))["overall"]["tau"]
    return target, records, result, config, before, after


def test_loss_falls_and_held_out_tau_rises(trained):
    _, _, result, _, before, after = trained
    log = result.log
    assert log[-1]["loss"] < 0.5 * log[0]["loss"]
    assert log[-1]["accepted_per_block"] > log[0]["accepted_per_block"] + 0.5
    assert after > before + 0.5, (before, after)


def test_objective_rows_are_the_proposers_teacher_forced_rows(trained):
    """The training layout IS the drafting layout: the objective's slot rows on a right-padded batch equal the
    proposer's teacher-forced rows on each sequence alone, wherever the slot has a label (past the sequence end
    the padded batch reads padding where the lone sequence repeats its last token; no loss reads those rows)."""
    target, records, result, _, _, _ = trained
    head = result.draft
    picked = [records[0], records[5], records[9]]
    features = extract_features(target, [r.token_ids for r in picked], head.hidden_state_indices)
    token_ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(r.token_ids) for r in picked], batch_first=True)
    anchors = torch.stack([torch.tensor([r.prompt_length, r.prompt_length + 3, len(r.token_ids) - 2]) for r in picked])
    with torch.no_grad():
        rows = chain_rows(
            head,
            target.get_input_embeddings(),
            token_ids,
            torch.nn.utils.rnn.pad_sequence(features, batch_first=True),
            anchors,
            TTT,
        )
    proposer = Eagle3Proposer(head, TargetModel(target))
    for i, record in enumerate(picked):
        proposer.prepare_teacher(torch.tensor(record.token_ids), features[i])
        labelled = anchors[i][:, None] + torch.arange(1, TTT + 1) < len(record.token_ids)  # [A, k]
        assert labelled.sum() >= 2 * TTT
        torch.testing.assert_close(
            rows[i][labelled], proposer._chain_rows(anchors[i], TTT)[labelled], rtol=1e-4, atol=1e-5
        )


def test_saved_head_loads_through_the_eagle3_kind_and_drafts_as_the_trained_module(trained, tmp_path):
    target, records, result, config, _, _ = trained
    save_draft(result.draft, tmp_path, config)
    loaded = load_eagle3_head(tmp_path, target.config)
    assert loaded.facts["aux_layer_ids_source"] == "eagle_aux_hidden_state_layer_ids" and loaded.facts[
        "ignored_tensors"
    ] == ["t2d"]
    assert all(switch["checkpoint"] is False for switch in loaded.facts["norm_switches"].values())
    for module in (result.draft, loaded):
        module.eval()
    drafts = []
    for module in (result.draft, loaded):
        proposer = Eagle3Proposer(module, TargetModel(target))
        tokens = torch.tensor(records[3].token_ids)
        proposer.prepare_teacher(
            tokens, extract_features(target, [records[3].token_ids], module.hidden_state_indices)[0]
        )
        anchors = torch.arange(records[3].prompt_length, len(tokens) - 1)
        drafts.append(proposer.slot_logits(anchors, TTT).argmax(-1))
    assert torch.equal(drafts[0], drafts[1])


def test_draft_vocabulary_holds_the_most_frequent_response_tokens_and_the_maps_agree():
    responses = [
        [9, 9, 9, 4, 4, 7],
        [7, 5, 5, 6],
    ]  # counts 9:3, 4:2, 7:2, 5:2, 6:1: a tie for second place broken by id
    ids, coverage = draft_vocabulary(responses, 12, 3)
    assert ids == [4, 5, 9] and coverage == pytest.approx(7 / 10)
    d2t, t2d = vocabulary_maps(ids, 12)
    assert (torch.arange(3) + d2t).tolist() == ids and t2d.nonzero().flatten().tolist() == ids


def test_a_resume_gives_the_same_weights_and_loss_log_as_an_uninterrupted_run(tmp_path):
    target = markov_target()
    records = greedy_records(target, 12, seed=2)
    straight_head, config = new_head(target, records, vocab=40)
    straight = train(
        target, records, straight_head, config, steps=8, log_every=2, checkpoint_every=4, checkpoint_dir=tmp_path / "a"
    )
    first, _ = new_head(target, records, vocab=40)
    stopped = train(
        target,
        records,
        first,
        config,
        steps=8,
        log_every=2,
        checkpoint_every=4,
        checkpoint_dir=tmp_path / "b",
        deadline=0.0,
    )
    assert stopped.final_step == 2
    again, _ = new_head(target, records, vocab=40)
    resumed = train(
        target, records, again, config, steps=8, log_every=2, checkpoint_every=4, checkpoint_dir=tmp_path / "b"
    )
    assert resumed.resumed_from_step == 2 and resumed.final_step == 8

    def curve(log):
        return [(row["step"], row["loss"], row["accepted_per_block"], row["lr"]) for row in log]

    assert curve(resumed.log) == curve(straight.log)
    for name, tensor in straight.draft.state_dict().items():
        assert torch.equal(tensor, resumed.draft.state_dict()[name]), name


def _train_draft(target_and_workload, out, *args):
    target, workload = target_and_workload
    return invoke(
        "train-draft",
        "--target",
        target,
        "--workload",
        workload,
        "--device",
        "cpu",
        "--batch-size",
        "4",
        "--anchors-per-sequence",
        "4",
        "--max-new-tokens",
        "8",
        "--eval-requests",
        "0",
        "--steps",
        "4",
        "--out",
        out,
        *args,
    )


def test_cli_writes_a_speculators_head_that_check_runs_as_eagle3(target_and_workload, tmp_path):
    target, workload = target_and_workload
    out = tmp_path / "head"
    result = _train_draft(
        target_and_workload,
        out,
        "--draft-kind",
        "eagle3",
        "--aux-layer-ids",
        "1,3",
        "--draft-vocab-size",
        "40",
        "--ttt-steps",
        "3",
    )
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3] and config["draft_vocab_size"] == 40
    assert config["norm_before_residual"] is False and config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["speculators_config"]["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3}]
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target)
    assert config["dflash_doctor"]["target_weights_fingerprint"]
    from safetensors.torch import load_file

    tensors = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in tensors and tensors["lm_head.weight"].shape[0] == 40
    assert tensors["t2d"].nonzero().flatten().tolist() == (torch.arange(40) + tensors["d2t"]).tolist()
    card = (out / "README.md").read_text()
    assert "EAGLE-3 head" in card and "aux layer ids [1, 3]" in card and "TTT steps 3" in card

    checked = invoke(
        "check",
        "--target",
        target,
        "--draft",
        out,
        "--workload",
        workload,
        "--max-new-tokens",
        "10",
        "--out",
        tmp_path / "run",
    )
    assert checked.exit_code in (0, 1), checked.output
    assert json.loads((tmp_path / "run" / "run.json").read_text())["models"]["draft"]["kind"] == "eagle3"


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--draft-kind", "eagle3", "--block-size", "4"], ["--block-size", "--draft-kind eagle3"]),
        (["--draft-kind", "eagle3", "--init-from-target"], ["--init-from-target"]),
        (["--ttt-steps", "3"], ["--ttt-steps", "--draft-kind dflash"]),
        (["--aux-layer-ids", "1,2"], ["--aux-layer-ids"]),
        (["--draft-kind", "medusa"], ["--draft-kind 'medusa'"]),
        (["--draft-kind", "eagle3", "--ttt-steps", "0"], ["--ttt-steps 0"]),
        (["--draft-kind", "eagle3", "--aux-layer-ids", "1,9"], ["--aux-layer-ids 9", "4 layers"]),
    ],
)
def test_bad_flag_combinations_exit_2_in_one_sentence(target_and_workload, tmp_path, args, fragments):
    assert_usage_error(_train_draft(target_and_workload, tmp_path / "out", *args), *fragments)
