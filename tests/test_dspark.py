"""DSpark drafts (speculators ``dspark``, sample_from_anchor false): the Markov walk and its teacher-forced replay.

Reference: the greedy chain of llama.cpp's ``build_dspark_markov_head`` (``src/models/dflash.cpp``,
llama-cpp-python 0.3.36 sdist, commit 0c1e570: ``col = base_i + markov_w2(markov_w1[prev])``, ``prev =
argmax(col)``, the anchor first) and the training layout of speculators' ``DSparkDraftModel``
(``src/speculators/models/dspark/core.py``, commit c05b95b3: with sample_from_anchor false slot k is biased
by the true token before it), written out here over the plain DFlash draft's logits.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tiny_models import PROMPT, first_block_logits, tiny_target

from dflash_doctor.engine.dflash_model import DFlashConfig, DFlashDraftModel
from dflash_doctor.engine.dspark_model import DSparkDraftModel
from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, walk_schedule
from dflash_doctor.errors import UsageError
from dflash_doctor.models.draft_formats import normalise_draft_config
from dflash_doctor.models.draft_kinds import detect_draft_kind
from dflash_doctor.inputs.validation import read_config_json
from dflash_doctor.models.loading import load_dflash_draft, save_dflash_draft


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _config(target, architecture: str) -> DFlashConfig:
    tc = target.config
    return DFlashConfig(
        hidden_size=tc.hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=2 * tc.hidden_size,
        vocab_size=tc.vocab_size,
        block_size=6,
        target_layer_ids=[0, 2],
        mask_token_id=3,
        num_target_layers=tc.num_hidden_layers,
        rope_theta=10000.0,
        architecture=architecture,
        markov_rank=4,
        confidence_head=True,
    )


@pytest.fixture(scope="module")
def dspark(target):
    torch.manual_seed(5)
    model = DSparkDraftModel(_config(target, "DSparkDraftModel"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 1.0 if name.startswith("markov_head") else 0.2)
    return model.eval()


def _speculators_dir(model, tmp_path, **overrides):
    cfg = model.config
    layer = {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
    }
    config = {
        "speculators_model_type": "dspark",
        "architectures": ["DSparkSpeculator"],
        "transformer_layer_config": layer,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "block_size": cfg.block_size,
        "draft_vocab_size": cfg.vocab_size,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "sample_from_anchor": False,
        **overrides,
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    return tmp_path


def _features(target_model, draft, prompt):
    wrapped = TargetModel(target_model, draft.hidden_state_indices)
    hidden = target_model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    return wrapped, torch.cat([hidden[i][0] for i in draft.hidden_state_indices], dim=-1)


@torch.no_grad()
def test_speculators_dspark_drafts_the_llama_cpp_markov_chain(dspark, target, tmp_path):
    spec_dir = _speculators_dir(dspark, tmp_path / "spec")
    assert detect_draft_kind(read_config_json(spec_dir)).name == "dflash"
    loaded = load_dflash_draft(spec_dir)
    assert (
        type(loaded) is DSparkDraftModel
        and loaded.draft_format is not None
        and loaded.draft_format["dialect"] == "speculators"
    )
    assert hasattr(loaded, "confidence_head")  # loaded, and not used (vLLM's DSpark proposer leaves it out too)
    base = DFlashDraftModel(_config(target, "DFlashDraftModel")).eval()
    base.load_state_dict(
        {k: v for k, v in dspark.state_dict().items() if not k.startswith(("markov_head", "confidence_head"))}
    )
    wrapped, features = _features(target, loaded, PROMPT)
    proposer = DFlashProposer(loaded, wrapped)
    proposer.start(torch.tensor(PROMPT), features)
    proposal = proposer.propose(PROMPT[-1], 5, 5)
    plain = DFlashProposer(base, wrapped)
    plain.start(torch.tensor(PROMPT), features)
    base_logits = plain.propose(PROMPT[-1], 5, 5).logits.float()
    w1, w2 = dspark.markov_head.markov_w1.weight, dspark.markov_head.markov_w2.weight
    previous, chain, columns = PROMPT[-1], [], []
    for slot in range(5):
        column = base_logits[slot] + w2 @ w1[previous]
        previous = int(column.argmax())
        chain.append(previous)
        columns.append(column)
    assert proposal.tokens.tolist() == chain
    torch.testing.assert_close(proposal.logits, torch.stack(columns), rtol=1e-5, atol=1e-5)
    assert chain != base_logits.argmax(-1).tolist()  # the Markov head changes the draft


def test_dspark_teacher_replay_equals_live(dspark, target):
    for prompt in ([5, 17, 42, 8, 9], [60, 61, 62, 63, 64, 65, 66, 67]):
        wrapped = TargetModel(target, dspark.hidden_state_indices)
        truth = plain_generate(wrapped, torch.tensor(prompt), max_new_tokens=30).output_ids
        for k in (5, 3):
            table, _ = slot_table(wrapped, DFlashProposer(dspark, wrapped), TeacherSequence(prompt, truth), k)
            live = speculative_generate(
                wrapped, DFlashProposer(dspark, wrapped), torch.tensor(prompt), k=k, max_new_tokens=30
            )
            assert live.output_ids == truth
            walked = walk_schedule(table.matches, truth, k, 30, frozenset())
            assert [(s.position, s.num_accepted) for s in walked] == [(s.position, s.num_accepted) for s in live.steps]


def test_our_dspark_layout_round_trips_and_states_its_layout(dspark, target, tmp_path):
    saved = save_dflash_draft(dspark, tmp_path / "saved")
    config = json.loads((saved / "config.json").read_text())
    assert config["dflash_config"]["sample_from_anchor"] is False and config["dflash_config"]["markov_rank"] == 4
    torch.testing.assert_close(
        first_block_logits(load_dflash_draft(saved), target), first_block_logits(dspark, target), rtol=0, atol=0
    )
    del config["dflash_config"]["sample_from_anchor"]
    with pytest.raises(UsageError, match="without sample_from_anchor = false is anchor-first"):
        normalise_draft_config(config)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sample_from_anchor": None}, r"sample_from_anchor = True \(its default\)"),
        ({"sample_from_anchor": True}, "the anchor-first layout this tool does not model"),
        ({"markov_head_type": "gated"}, "markov_head_type 'gated' is not the vanilla Markov head"),
        ({"draft_vocab_size": 32}, "over its own 32-token vocabulary is not modelled"),
    ],
)
def test_dspark_layouts_this_tool_does_not_model_are_refused(change, message, dspark, tmp_path):
    config = json.loads((_speculators_dir(dspark, tmp_path)).joinpath("config.json").read_text())
    config.update(change)
    if change.get("sample_from_anchor", False) is None:
        del config["sample_from_anchor"]
    with pytest.raises(UsageError, match=message):
        normalise_draft_config(config)
