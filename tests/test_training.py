"""train-draft: a tiny draft trained against a tiny in-process target learns to draft, saves, reloads, resumes."""

from __future__ import annotations

import copy
import json
import shutil
import time
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from dflash_doctor.models import training
from dflash_doctor.models.training import checkpoints, sequences as training_data
from dflash_doctor.cli import app
from dflash_doctor.engine.blocks import context_kv_for, draft_block_hidden
from dflash_doctor.engine.dflash_model import DFlashDraftModel
from dflash_doctor.engine.batched import generate_greedy_batch
from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.step_records import StepRecord
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.errors import UsageError
from dflash_doctor.models.loading import load_dflash_draft, save_dflash_draft
from dflash_doctor.models.training import (
    SequenceRecord,
    TrainConfig,
    choose_mask_token_id,
    held_out_steps,
    sample_anchors,
    slot_weights,
    train_dflash_draft,
    validate_mask_token_id,
)
from tiny_models import markov_target, tiny_dflash, tiny_target, torch_threads

STOP_IDS = frozenset({2})
NEW_TOKENS = 24
NUM_HELD_OUT = 12


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Two shared cores: one intra-op thread is ~10x faster for these tiny matrices than two fighting."""
    with torch_threads(1):
        yield


def random_prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, 97, (int(torch.randint(3, 9, (1,), generator=generator)),), generator=generator).tolist()
        for _ in range(count)
    ]


def live_steps(target_model, draft, prompts) -> list[StepRecord]:
    """Step records of the real speculative loop at T = 0 with K = block size - 1."""
    target = TargetModel(target_model, draft.hidden_state_indices)
    proposer = DFlashProposer(draft, target)
    rows = []
    for prompt in prompts:
        result = speculative_generate(
            target,
            proposer,
            torch.tensor(prompt),
            k=draft.config.block_size - 1,
            max_new_tokens=NEW_TOKENS,
            stop_ids=STOP_IDS,
            record_tokens=False,
        )
        rows += result.steps
    return rows


def tau(rows) -> float:
    return 1 + sum(r.num_accepted for r in rows) / sum(1 for r in rows if r.num_drafted)


@pytest.fixture(scope="module")
def trained():
    target_model = markov_target()
    prompts = random_prompts(300, seed=5)
    responses = []
    for start in range(0, len(prompts), 100):
        responses += generate_greedy_batch(
            target_model, prompts[start : start + 100], max_new_tokens=NEW_TOKENS, stop_ids=STOP_IDS
        )
    train_prompts, held_out = prompts[:-NUM_HELD_OUT], prompts[-NUM_HELD_OUT:]
    sequences = [p + r for p, r in zip(train_prompts, responses)]
    initial = tiny_dflash(target_model, block_size=6, layer_ids=(0, 2))
    untrained_rows = live_steps(target_model, initial, held_out)
    config = TrainConfig(steps=300, batch_size=16, anchors_per_sequence=8, lr=3e-3, log_every=25)
    result = train_dflash_draft(
        target_model, sequences, [len(p) for p in train_prompts], config, copy.deepcopy(initial)
    )
    records = [
        SequenceRecord(str(i), "tiny", 0, len(p), p + r)
        for i, (p, r) in enumerate(zip(held_out, responses[-NUM_HELD_OUT:]))
    ]
    return SimpleNamespace(
        target=target_model,
        result=result,
        held_out=held_out,
        records=records,
        untrained_rows=untrained_rows,
        trained_rows=live_steps(target_model, result.draft, held_out),
    )


def test_training_raises_live_acceptance_well_above_the_untrained_draft(trained):
    untrained, after = tau(trained.untrained_rows), tau(trained.trained_rows)
    assert after > untrained + 1.0, (untrained, after)
    log = trained.result.log
    assert log[-1]["loss"] < 0.5 * log[0]["loss"]
    assert log[-1]["accepted_per_block"] > log[0]["accepted_per_block"]


def test_block_pass_acceptance_walks_the_live_schedule(trained):
    """held_out_steps (teacher-forced, no live loop) gives the live loop's steps on greedy continuations."""
    walked = held_out_steps(trained.target, trained.result.draft, trained.records, stop_ids=STOP_IDS)
    assert [(r["num_drafted"], r["num_accepted"]) for r in walked] == [
        (r.num_drafted, r.num_accepted) for r in trained.trained_rows
    ]


def test_saved_checkpoint_reloads_with_identical_logits(trained, tmp_path):
    draft = trained.result.draft
    save_dflash_draft(draft, tmp_path, extra_config={"dflash_doctor": training.chat_template_record("{{ messages }}")})
    reloaded = load_dflash_draft(tmp_path)
    assert reloaded.config.extra["dflash_doctor"]["chat_template"] == "{{ messages }}"
    sequence = torch.tensor(trained.records[0].token_ids)
    features = torch.cat(
        [
            trained.target(sequence[None], output_hidden_states=True).hidden_states[i]
            for i in draft.hidden_state_indices
        ],
        dim=-1,
    ).detach()
    anchors = torch.tensor([[trained.records[0].prompt_length, trained.records[0].prompt_length + 3]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    embed = trained.target.get_input_embeddings().weight
    with torch.no_grad():
        before = draft_block_hidden(draft, embed, sequence[None], context_kv_for(draft, features), anchors, valid, 6)
        after = draft_block_hidden(
            reloaded, embed, sequence[None], context_kv_for(reloaded, features), anchors, valid, 6
        )
    assert torch.equal(trained.target.lm_head(before), trained.target.lm_head(after))


@pytest.mark.parametrize("prefill_rows", [None, 3])  # the CPU default (alone), and padded forwards as on a GPU
def test_batched_generation_equals_plain_greedy_decoding(prefill_rows):
    """Left-padded caches, rows leaving the batch at their stop token, a repeated prompt sharing one
    prefill and prompts prefilled together (padded, sorted by length) must not change a single greedy
    token (random target, prompts of different lengths)."""
    model = tiny_target()
    target = TargetModel(model)
    prompts = random_prompts(6, seed=11)
    prompts.append(prompts[2])
    early = plain_generate(target, torch.tensor(prompts[0]), max_new_tokens=16).output_ids[4]
    stop_ids = STOP_IDS | {early}  # the first prompt's answer reaches it early: its row leaves the batch
    batched = generate_greedy_batch(model, prompts, max_new_tokens=16, stop_ids=stop_ids, prefill_rows=prefill_rows)
    assert len(batched[0]) <= 5 and any(len(output) == 16 for output in batched) and batched[2] == batched[-1]
    for prompt, output in zip(prompts, batched):
        assert output == plain_generate(target, torch.tensor(prompt), max_new_tokens=16, stop_ids=stop_ids).output_ids


def _small_run(checkpoint_dir, draft, deadline=None, **overrides):
    target_model = markov_target()
    prompts = random_prompts(24, seed=3)
    responses = generate_greedy_batch(target_model, prompts, max_new_tokens=12, stop_ids=STOP_IDS)
    config = TrainConfig(
        **{
            "steps": 20,
            "batch_size": 4,
            "anchors_per_sequence": 4,
            "lr": 3e-3,
            "checkpoint_every": 10,
            "log_every": 5,
            **overrides,
        }
    )
    return train_dflash_draft(
        target_model,
        [p + r for p, r in zip(prompts, responses)],
        [len(p) for p in prompts],
        config,
        copy.deepcopy(draft),
        checkpoint_dir=checkpoint_dir,
        deadline=deadline,
    )


def _stop_after_first_checkpoint(checkpoint_dir, draft, monkeypatch, **overrides):
    """Run until the step-10 checkpoint is written, then stop as Ctrl-C (or a command's time limit) would."""
    save = checkpoints.save_checkpoint

    def save_then_die(*args, **kwargs):
        save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoints, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        _small_run(checkpoint_dir, draft, **overrides)
    monkeypatch.setattr(checkpoints, "save_checkpoint", save)


def _copy_piece_by_piece(source, destination):
    """Every file of a checkpoint copied on its own, as files through a channel of limited size travel."""
    pieces = sorted(path for path in source.rglob("*") if path.is_file())
    for piece in pieces:
        (destination / piece.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(piece, destination / piece.relative_to(source))
    return [piece.relative_to(source).as_posix() for piece in pieces]


def _curve(log):
    """The loss log without its timing column (tokens per second differs between any two runs)."""
    return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in log]


def test_a_run_stopped_halfway_and_resumed_from_a_piecewise_copy_equals_the_straight_run(tmp_path, monkeypatch):
    piece_bytes = (
        16 * 1024
    )  # the tiny draft and its AdamW moments in several pieces each, as the 48 MB demo draft's are
    monkeypatch.setattr(checkpoints, "CHECKPOINT_PIECE_BYTES", piece_bytes)
    initial = tiny_dflash(markov_target(), block_size=6, layer_ids=(0, 2))
    straight = _small_run(tmp_path / "straight", initial)
    _stop_after_first_checkpoint(tmp_path / "stopped", initial, monkeypatch)
    names = _copy_piece_by_piece(tmp_path / "stopped", tmp_path / "copied")
    assert (
        sum(n.startswith("model-") for n in names) > 1 and sum(n.startswith("optimizer/optimizer-") for n in names) > 1
    )
    assert {
        "config.json",
        "model.safetensors.index.json",
        "optimizer/optimizer.safetensors.index.json",
        training.TRAINING_STATE_FILE,
    } <= set(names)
    assert not any(n.endswith((".pt", ".pth", ".bin", ".pkl")) for n in names)  # nothing pickled
    # a shard holds at most piece_bytes of tensors; its JSON header (names, shapes, offsets) comes on top
    assert all(
        (tmp_path / "copied" / n).stat().st_size <= piece_bytes + 2048 for n in names if n.endswith(".safetensors")
    )
    assert torch.equal(
        load_dflash_draft(tmp_path / "copied").fc.weight, _tensor_in_checkpoint(tmp_path / "copied", "fc.weight")
    )

    resumed = _small_run(tmp_path / "copied", initial)
    assert resumed.resumed_from_step == 10
    assert _curve(resumed.log) == _curve(straight.log)
    for (name, a), (_, b) in zip(straight.draft.state_dict().items(), resumed.draft.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_checkpoint_between_two_loss_log_rows_resumes_to_the_straight_log(tmp_path, monkeypatch):
    """Step 7 of rows every 5: the row of steps 6-10 is half summed when the run stops; the resumed run must
    report the same row as a run never stopped."""
    initial = tiny_dflash(markov_target(), block_size=6, layer_ids=(0, 2))
    straight = _small_run(tmp_path / "straight", initial, checkpoint_every=7)
    _stop_after_first_checkpoint(tmp_path / "run", initial, monkeypatch, checkpoint_every=7)
    resumed = _small_run(tmp_path / "run", initial, checkpoint_every=7)
    assert resumed.resumed_from_step == 7 and _curve(resumed.log) == _curve(straight.log)


def test_a_deadline_stops_at_a_log_row_with_a_checkpoint_and_the_rerun_equals_the_straight_run(tmp_path):
    initial = tiny_dflash(markov_target(), block_size=6, layer_ids=(0, 2))
    straight = _small_run(tmp_path / "straight", initial)
    stopped = _small_run(
        tmp_path / "run", initial, deadline=time.perf_counter()
    )  # already past: the first row stops it
    assert stopped.final_step == 5 and [row["step"] for row in stopped.log] == [5]
    resumed = _small_run(tmp_path / "run", initial)
    assert resumed.resumed_from_step == 5 and resumed.final_step == 20
    assert _curve(resumed.log) == _curve(straight.log)
    for (name, a), (_, b) in zip(straight.draft.state_dict().items(), resumed.draft.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_run_killed_between_the_checkpoint_renames_resumes_from_the_last_whole_checkpoint(tmp_path, monkeypatch):
    """A time limit's SIGTERM can land after the old checkpoint was moved aside and before the new one took its
    place: the run must resume from the moved one, not start afresh over it."""
    initial = tiny_dflash(markov_target(), block_size=6, layer_ids=(0, 2))
    _stop_after_first_checkpoint(tmp_path / "run", initial, monkeypatch)
    (tmp_path / "run").replace(tmp_path / "run.old")
    (tmp_path / "run.tmp").mkdir()  # the half-written next one
    assert _small_run(tmp_path / "run", initial).resumed_from_step == 10


def _tensor_in_checkpoint(checkpoint_dir, name):
    """One tensor as the checkpoint's index says where it is: the pieces are a transformers sharded checkpoint."""
    from safetensors.torch import load_file

    index = json.loads((checkpoint_dir / "model.safetensors.index.json").read_text())
    return load_file(checkpoint_dir / index["weight_map"][name])[name]


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "spoil, overrides, message",
    [
        (
            lambda c: next(c.glob("optimizer/optimizer-*.safetensors")).unlink(),
            {},
            r"optimizer-\d{5}-of-\d{5}\.safetensors is missing",
        ),
        (lambda c: _truncate(next(c.glob("model-*.safetensors"))), {}, "bytes instead of"),
        (lambda c: _flip_last_byte(next(c.glob("model-*.safetensors"))), {}, "sha256 differs"),
        (lambda c: _truncate(c / training.TRAINING_STATE_FILE), {}, "cut short or damaged"),
        (lambda c: (c / training.TRAINING_STATE_FILE).write_text('{"pieces": {}}'), {}, "cut short or damaged"),
        (lambda c: (c / training.TRAINING_STATE_FILE).write_text("[1, 2]"), {}, "cut short or damaged"),
        (lambda c: (c / training.TRAINING_STATE_FILE).unlink(), {}, "no training_state.json"),
        (None, {"lr": 1e-3}, r"lr 0.003 there, 0.001 now"),
        (None, {"steps": 40}, r"steps 20 there, 40 now.*--init-from"),
    ],
)
def test_a_spoilt_or_foreign_checkpoint_is_refused_in_one_sentence(tmp_path, monkeypatch, spoil, overrides, message):
    monkeypatch.setattr(checkpoints, "CHECKPOINT_PIECE_BYTES", 16 * 1024)
    initial = tiny_dflash(markov_target(), block_size=6, layer_ids=(0, 2))
    _stop_after_first_checkpoint(tmp_path / "run", initial, monkeypatch)
    if spoil is not None:
        spoil(tmp_path / "run")
    with pytest.raises(UsageError, match=message) as refused:
        _small_run(tmp_path / "run", initial, **overrides)
    assert str(refused.value).count(". ") == 0 and str(refused.value).endswith(".")  # one sentence


def _edit_state(checkpoint_dir, **fields):
    """training_state.json with some fields replaced, as a hand edit or a mix of two checkpoints leaves it
    (the other pieces keep their sha256: only the state file lists them)."""
    state_file = checkpoint_dir / training.TRAINING_STATE_FILE
    record = json.loads(state_file.read_text())
    for name, value in fields.items():
        if name == "last_epoch":
            record["scheduler"]["last_epoch"] = value
        elif name == "window_steps":
            record["window"]["steps"] = value
        else:
            record[name] = value
    state_file.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"step": 99_999}, "claims step 99999 of a 20-step run"),
        ({"step": 21}, "claims step 21 of a 20-step run"),
        ({"step": -1}, "claims step -1 of a 20-step run"),
        ({"step": 10.5}, "step 10.5 is not a whole number"),
        ({"step": "10"}, "step '10' is not a whole number"),
        ({"step": True}, "step True is not a whole number"),
        ({"step": 12}, "learning-rate schedule stands at step 10"),  # the checkpoint of step 10, its step field edited
        ({"step": 15, "last_epoch": 15}, "loss log and running row add up to another step"),
        ({"step": 15, "last_epoch": 15, "window_steps": 5}, "optimizer pieces were written at step 10"),
        ({"log": [{"step": 5}, {"step": 40}]}, "loss log holds rows of steps"),
        ({"scheduler": None}, "scheduler, loss log or running loss-log row"),
    ],
)
def test_a_checkpoint_whose_step_is_out_of_range_or_at_odds_with_its_pieces_is_refused(
    tmp_path, monkeypatch, fields, message
):
    """A resumed step beyond --steps, negative or disagreeing with the schedule, the loss log or AdamW's own
    step count is refused in one sentence naming the checkpoint folder and what to do, before any step runs."""
    initial = tiny_dflash(markov_target(), block_size=6, layer_ids=(0, 2))
    _stop_after_first_checkpoint(tmp_path / "run", initial, monkeypatch)
    _edit_state(tmp_path / "run", **fields)
    with pytest.raises(UsageError, match=message) as refused:
        _small_run(tmp_path / "run", initial)
    text = str(refused.value)
    assert text.startswith(str(tmp_path / "run")) and "remove" in text and "copy the checkpoint again" in text
    assert text.count(". ") == 0 and text.endswith(".")  # one sentence


def test_the_untouched_checkpoint_of_the_last_step_still_resumes(tmp_path):
    """A finished run's checkpoint claims step == --steps: that is consistent, and resuming it trains nothing."""
    initial = tiny_dflash(markov_target(), block_size=6, layer_ids=(0, 2))
    done = _small_run(tmp_path / "run", initial)
    again = _small_run(tmp_path / "run", initial)
    assert again.resumed_from_step == 20 == again.final_step and _curve(again.log) == _curve(done.log)


def test_a_checkpoint_resumes_only_from_the_weights_it_started_from(tmp_path, monkeypatch):
    """--init-from another draft with the same flags is another run: its checkpoint must not be taken over."""
    target = markov_target()
    _stop_after_first_checkpoint(tmp_path / "run", tiny_dflash(target, block_size=6, layer_ids=(0, 2)), monkeypatch)
    with pytest.raises(UsageError, match="other starting weights"):
        _small_run(tmp_path / "run", tiny_dflash(target, seed=2, block_size=6, layer_ids=(0, 2)))


def test_every_piece_of_a_demo_size_checkpoint_is_under_16_mib(tmp_path):
    """The shipped demo draft's shape (SmolLM2-135M width, 3 layers: 48 MB of weights, 96 MB of AdamW
    moments) in checkpoint pieces that each pass the GPU machine's 16 MiB file limit."""
    from transformers import LlamaConfig

    smollm2 = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
    )
    draft = DFlashDraftModel(
        training.draft_config_for_target(
            smollm2, block_size=16, num_layers=3, target_layer_ids=[1, 10, 18, 27], mask_token_id=16
        )
    )
    optimizer = torch.optim.AdamW(draft.parameters())
    for parameter in draft.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()  # AdamW's moments exist from the first step on
    state = {
        "identity": {},
        "step": 1,
        "log": [],
        "optimizer": optimizer.state_dict(),
        "scheduler": {},
        "window": {},
        "generator": torch.Generator().get_state(),
    }
    checkpoints.save_checkpoint(tmp_path / "checkpoint", draft, state, None)
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "checkpoint").rglob("*") if p.is_file()}
    assert sum(sizes.values()) > 140e6 and max(sizes.values()) < 16 * 2**20, sizes


def test_anchors_stay_inside_the_response_with_room_for_a_label():
    prompt_lengths, lengths = torch.tensor([2, 5]), torch.tensor([9, 8])
    anchors, valid = sample_anchors(prompt_lengths, lengths, 9, 4, torch.Generator().manual_seed(0))
    assert valid.sum(dim=1).tolist() == [4, 2]  # row 1 has only positions 5 and 6
    for row in range(2):
        chosen = anchors[row][valid[row]].tolist()
        assert len(set(chosen)) == len(chosen)
        assert all(prompt_lengths[row] <= a <= lengths[row] - 2 for a in chosen)
    weights = slot_weights(4, gamma=7.0)
    assert weights[0] == 1.0 and torch.allclose(weights[2], torch.exp(torch.tensor(-2 / 7.0)))


def test_mask_choice_skips_special_template_and_used_tokens():
    tokens = {i: SimpleNamespace(content=f"<t{i}>", special=True) for i in range(6)}
    tokenizer = SimpleNamespace(
        added_tokens_decoder=tokens,
        chat_template="<t4>{{ m }}",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        unk_token_id=None,
    )
    config = SimpleNamespace(vocab_size=100, bos_token_id=1, eos_token_id=2)
    assert choose_mask_token_id(tokenizer, config, used_ids=[]) == 5
    assert choose_mask_token_id(tokenizer, config, used_ids=[5]) == 3  # 4 is in the template
    with pytest.raises(UsageError, match="--mask-token-id"):
        choose_mask_token_id(tokenizer, config, used_ids=[3, 5])
    with pytest.raises(UsageError, match="bos/eos/pad"):
        validate_mask_token_id(2, config)
    with pytest.raises(UsageError, match="outside the target vocabulary"):
        validate_mask_token_id(100, config)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--steps", "0"], "--steps"),
        (["--target-layer-ids", "1,x"], "--target-layer-ids"),
        (["--target", "/no/such/model", "--steps", "3"], "/no/such/model"),
        (["--extra-word-problems", "-1"], "--extra-word-problems"),
        (["--init-from", "some-draft", "--init-from-target"], "--init-from-target"),
    ],
)
def test_cli_bad_input_exits_2_with_one_sentence(args, needle, tmp_path):
    result = CliRunner().invoke(app, ["train-draft", "--out", str(tmp_path / "out"), *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


def test_init_from_target_copies_its_last_layers_and_final_norm():
    target_model = tiny_target()
    draft = tiny_dflash(target_model, num_layers=2)
    fc_before = draft.fc.weight.clone()
    copied = training.init_draft_from_target(draft, target_model)
    assert copied == [2, 3]  # the two layers nearest the lm_head
    for layer, index in zip(draft.layers, copied):
        source = target_model.model.layers[index]
        assert torch.equal(layer.self_attn.q_proj.weight, source.self_attn.q_proj.weight)
        assert torch.equal(layer.mlp["down_proj"].weight, source.mlp.down_proj.weight)
        assert torch.equal(layer.post_attention_layernorm.weight, source.post_attention_layernorm.weight)
    assert torch.equal(draft.norm.weight, target_model.model.norm.weight)
    assert torch.equal(draft.fc.weight, fc_before)  # no counterpart in the target: left as it was
    with pytest.raises(UsageError, match="--num-layers"):
        training.init_draft_from_target(tiny_dflash(target_model, num_layers=5), target_model)


def test_extra_word_problems_never_use_a_held_out_template():
    from dflash_doctor.inputs import workloads
    from dflash_doctor.inputs.word_problems import TEMPLATES, generate_word_problems

    eval_ids = {r.id for r in workloads.load_workload("gsm", split="eval")}
    eval_templates = {template for request, template in workloads.builtin._gsm() if request.id in eval_ids}
    assert eval_templates and eval_templates != set(TEMPLATES)
    extra = workloads.extra_word_problems(300)
    template_of = {
        f"{p.question}\n{workloads.MATH_INSTRUCTION}": p.template
        for p in generate_word_problems(300 * len(TEMPLATES), seed=1)
    }
    used = {template_of[r.messages[0]["content"]] for r in extra}
    assert len(extra) == 300 and len({r.id for r in extra}) == 300
    assert used == set(TEMPLATES) - eval_templates  # every train template, no held-out one


def test_self_written_prompts_start_from_an_empty_user_turn_drop_cut_and_repeated_ones_and_are_cached(
    tmp_path, monkeypatch
):
    from checks_fixtures import tiny_tokenizer

    tokenizer = tiny_tokenizer(["user:", "hello", "how", "are", "you", "?", "tell", "me", "a", "joke"])
    template = "{% for m in messages %}<s> user: {{ m['content'] }} </s>{% endfor %}"
    ids = {
        w: tokenizer.convert_tokens_to_ids(w) for w in ["hello", "how", "are", "you", "?", "tell", "me", "a", "joke"]
    }
    outputs = [
        [ids["how"], ids["are"], ids["you"], ids["?"], 2],  # finished question
        [ids["how"], ids["are"], ids["you"], ids["?"], 2],  # repeated: dropped
        [ids["tell"], ids["me"], ids["a"]],  # cut by the length limit: dropped
        [2],  # empty: dropped
        [ids["tell"], ids["me"], ids["a"], ids["joke"], 2],
    ]
    seen_prompts = []

    def fake_generate(model, prompts, **kwargs):
        seen_prompts.extend(prompts)
        assert kwargs["temperature"] > 0
        return outputs[: len(prompts)]

    monkeypatch.setattr(training_data, "generate_greedy_batch", fake_generate)
    cache = tmp_path / "prompts.jsonl"
    kwargs = dict(
        cache_path=cache, cache_key={"target": "t"}, stop_ids=frozenset({2}), chat_template=template, batch_size=5
    )
    requests = training.self_written_prompts(None, tokenizer, 2, **kwargs)
    assert [r.messages[0]["content"] for r in requests] == ["how are you ?", "tell me a joke"]
    assert {r.request_class for r in requests} == {"chat"}
    assert (
        seen_prompts[0] == tokenizer("<s> user:", add_special_tokens=False)["input_ids"]
    )  # the template up to the content
    seen_prompts.clear()
    assert (
        training.self_written_prompts(None, tokenizer, 2, **kwargs) == requests and not seen_prompts
    )  # read from the cache


def test_precomputed_features_train_the_same_draft_as_extracting_them():
    """Ablation rows share one frozen-target pass: given features (a row too short to train on included,
    so the filter must keep them aligned) give the very weights the run's own extraction gives."""
    target_model = markov_target()
    prompts = random_prompts(12, seed=4)
    responses = generate_greedy_batch(target_model, prompts, max_new_tokens=10, stop_ids=STOP_IDS)
    sequences = [p + r for p, r in zip(prompts, responses)] + [prompts[0][:3]]
    prompt_lengths = [len(p) for p in prompts] + [3]  # no response token: dropped before training
    initial = tiny_dflash(target_model, block_size=6, layer_ids=(0, 2))
    config = TrainConfig(steps=6, batch_size=4, anchors_per_sequence=4, lr=3e-3, log_every=2)
    features = training.extract_features(target_model, sequences, initial.hidden_state_indices)
    own = train_dflash_draft(target_model, sequences, prompt_lengths, config, copy.deepcopy(initial))
    shared = train_dflash_draft(
        target_model, sequences, prompt_lengths, config, copy.deepcopy(initial), features=features
    )
    assert own.num_sequences == shared.num_sequences == sum(len(r) >= 2 for r in responses)
    for name, tensor in own.draft.state_dict().items():
        assert torch.equal(tensor, shared.draft.state_dict()[name]), name
    blind = train_dflash_draft(
        target_model,
        sequences,
        prompt_lengths,
        config,
        copy.deepcopy(initial),
        features=[torch.zeros_like(f) for f in features],
    )
    assert not torch.equal(blind.draft.fc.weight, own.draft.fc.weight)  # the given features are the ones trained on
    with pytest.raises(ValueError, match="feature tensors"):
        train_dflash_draft(
            target_model, sequences, prompt_lengths, config, copy.deepcopy(initial), features=features[:-1]
        )


def test_features_are_the_hidden_states_of_the_tapped_layers():
    """The taps recorded by hooks are what ``output_hidden_states`` gives at those indices (the first layer's
    input, a middle layer's output, the decoder's normed output): exactly one sequence at a time, and to
    float32 rounding for sequences of unequal length batched together with right padding."""
    target_model = tiny_target()
    sequences = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [16, 17]]
    taps = (0, 2, target_model.config.num_hidden_layers)
    one_by_one = training.extract_features(target_model, sequences, taps, batch_size=1)
    batched = training.extract_features(target_model, sequences, taps, batch_size=3)
    for sequence, alone, padded in zip(sequences, one_by_one, batched):
        with torch.no_grad():
            hidden = target_model(input_ids=torch.tensor([sequence]), output_hidden_states=True).hidden_states
        expected = torch.cat([hidden[i][0] for i in taps], dim=-1)
        assert torch.equal(alone, expected)
        torch.testing.assert_close(padded, expected, rtol=1e-4, atol=1e-4)


def _train_draft(target_and_workload, out, *args):
    target, workload = target_and_workload
    return CliRunner().invoke(
        app,
        [
            "train-draft",
            "--target",
            str(target),
            "--workload",
            str(workload),
            "--device",
            "cpu",
            "--num-layers",
            "1",
            "--batch-size",
            "4",
            "--anchors-per-sequence",
            "4",
            "--max-new-tokens",
            "8",
            "--eval-requests",
            "0",
            "--checkpoint-every",
            "2",
            "--out",
            str(out),
            *args,
        ],
    )


def test_a_longer_run_continues_a_finished_draft_through_init_from_and_not_by_stretching_steps(
    target_and_workload, tmp_path
):
    """--steps is the cosine schedule's length: a finished run asked for more steps is refused (exit 2, one
    sentence saying what to do), and --init-from its folder starts a new run from its weights."""
    from dflash_doctor.models.loading import weights_fingerprint

    first = _train_draft(target_and_workload, tmp_path / "first", "--steps", "4")
    assert first.exit_code == 0, first.output
    longer = _train_draft(target_and_workload, tmp_path / "first", "--steps", "8")
    assert longer.exit_code == 2 and "Traceback" not in longer.output
    assert "steps 4 there, 8 now" in " ".join(longer.output.split()) and "--init-from" in longer.output

    second = _train_draft(
        target_and_workload,
        tmp_path / "second",
        "--steps",
        "4",
        "--init-from",
        str(tmp_path / "first"),
        "--batch-seed",
        "1",
    )
    assert second.exit_code == 0, second.output
    state = json.loads((tmp_path / "second" / "checkpoint" / training.TRAINING_STATE_FILE).read_text())
    assert state["identity"]["init"] == weights_fingerprint(load_dflash_draft(tmp_path / "first"))
    facts = json.loads((tmp_path / "second" / "training_log.json").read_text())
    assert state["step"] == 4 and facts["init_from"] == str(tmp_path / "first") and facts["train_config"]["seed"] == 1
    # --batch-seed draws other batches from the same data: the answers (seeded by --seed) are the first run's
    assert (tmp_path / "second" / training.SEQUENCES_FILE).read_text() == (
        tmp_path / "first" / training.SEQUENCES_FILE
    ).read_text()
    assert not torch.equal(
        load_dflash_draft(tmp_path / "second").fc.weight, load_dflash_draft(tmp_path / "first").fc.weight
    )


def test_cli_refuses_a_cut_short_checkpoint_piece_with_exit_2(target_and_workload, tmp_path):
    assert _train_draft(target_and_workload, tmp_path / "run", "--steps", "4").exit_code == 0
    piece = next((tmp_path / "run" / "checkpoint").glob("optimizer/*.safetensors"))
    piece.write_bytes(piece.read_bytes()[:100])
    result = _train_draft(target_and_workload, tmp_path / "run", "--steps", "4")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "bytes instead of" in " ".join(result.output.split())


def test_cli_refuses_a_checkpoint_that_claims_a_step_beyond_steps_with_exit_2(target_and_workload, tmp_path):
    assert _train_draft(target_and_workload, tmp_path / "run", "--steps", "4").exit_code == 0
    _edit_state(tmp_path / "run" / "checkpoint", step=99_999)
    result = _train_draft(target_and_workload, tmp_path / "run", "--steps", "4")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    said = "".join(result.output.split())  # the terminal wraps long paths anywhere
    assert "claimsstep99999ofa4-steprun" in said and "".join(str(tmp_path / "run" / "checkpoint").split()) in said


def test_cached_data_only_trains_on_carried_caches_and_refuses_to_generate(target_and_workload, tmp_path):
    """A GPU segment carries the answers in and must not spend its minutes regenerating them: with
    --cached-data-only, caches under the run's key are used, anything missing is a one-sentence refusal
    that leaves the carried files as they were."""
    assert _train_draft(target_and_workload, tmp_path / "made", "--steps", "2").exit_code == 0
    carried = tmp_path / "carried"
    carried.mkdir()
    shutil.copyfile(tmp_path / "made" / training.SEQUENCES_FILE, carried / training.SEQUENCES_FILE)
    assert _train_draft(target_and_workload, carried, "--steps", "2", "--cached-data-only").exit_code == 0

    before = (carried / training.SEQUENCES_FILE).read_text()
    other_key = _train_draft(
        target_and_workload, carried, "--steps", "2", "--cached-data-only", "--max-new-tokens", "9"
    )
    assert other_key.exit_code == 2 and "Traceback" not in other_key.output
    assert "lacks 12 of the 12 answers" in " ".join(other_key.output.split())
    assert (carried / training.SEQUENCES_FILE).read_text() == before
    nothing = _train_draft(target_and_workload, tmp_path / "empty", "--steps", "2", "--cached-data-only")
    assert nothing.exit_code == 2 and "--cached-data-only" in nothing.output


def test_time_limit_stops_training_cleanly_and_the_same_command_finishes_it(target_and_workload, tmp_path):
    stopped = _train_draft(target_and_workload, tmp_path / "run", "--steps", "12", "--time-limit", "0.001")
    assert stopped.exit_code == 0, stopped.output
    facts = json.loads((tmp_path / "run" / "training_log.json").read_text())
    assert (
        facts["final_step"] == 10
        and "Stopped by --time-limit at step 10 of 12" in (tmp_path / "run" / "README.md").read_text()
    )
    assert "run the same command again" in " ".join(stopped.output.split())
    finished = _train_draft(target_and_workload, tmp_path / "run", "--steps", "12")
    assert finished.exit_code == 0, finished.output
    facts = json.loads((tmp_path / "run" / "training_log.json").read_text())
    assert facts["final_step"] == 12 and facts["resumed_from_step"] == 10
    assert "Stopped by" not in (tmp_path / "run" / "README.md").read_text()
