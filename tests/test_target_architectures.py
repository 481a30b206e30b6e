"""The engine on today's DFlash target families: hybrids with gated-delta-net, Mamba2 or
short-convolution layers, attention sinks, sliding windows, MLA and MoE, each a tiny model built from
transformers' own config (tests/target_families.py), fp32 and seeded.

Per family: the live loop with a draft that both accepts and rejects equals transformers' own greedy
``generate`` token for token (so every rollback, including a hybrid's recurrent states, left the cache
exactly as plain decoding would), a self-draft accepts every token, teacher-forced replay walks the
live loop's steps exactly (sweep tau = replay tau at the same K), batched greedy decoding equals
``generate``, and a DFlash draft built for the target replays live = teacher-forced.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from dflash_doctor.checks import CheckContext, run_checks
from dflash_doctor.cli import app
from dflash_doctor.inputs.config import build_config
from dflash_doctor.engine.batched import generate_greedy_batch
from dflash_doctor.engine.cache import RollbackCache, has_recurrent_layers
from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel, attention_implementation
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, walk_schedule
from dflash_doctor.errors import UsageError
from dflash_doctor.models.loading import load_causal_lm, save_dflash_draft
from target_families import CONFIGS, tiny_family_target
from cli_helpers import assert_usage_error
from tiny_models import tiny_dflash, tiny_tokenizer, write_workload

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = list(CONFIGS)
HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "nemotron_h"]
PROMPTS = [[5, 17, 42, 8, 9, 33, 61], [11, 12, 13]]
MAX_NEW = 14
K = 3
STEP_KEYS = ("position", "num_drafted", "num_accepted", "bonus_token")


def _steps(steps):
    return [tuple(getattr(s, key) for key in STEP_KEYS) for s in steps]


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def _perturbed(model, scale: float):
    """A draft close to the target: accepted runs of several tokens AND rejections."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in draft.parameters():
            if parameter.dim() == 2:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return draft


def test_the_hybrid_families_keep_recurrent_state():
    """The families below exercise the recurrent rollback only if their caches really hold such states."""
    assert [family for family in FAMILIES if has_recurrent_layers(CONFIGS[family]())] == HYBRIDS


@pytest.mark.parametrize("rerun", ["mixers", "model"])
@pytest.mark.parametrize("family", HYBRIDS)
def test_rollback_leaves_the_states_of_the_kept_tokens(family, rerun):
    """Verify 5 tokens, keep 2: every layer's state equals that of a cache that only ever saw the kept
    tokens. Re-running the mixers calls no model forward; re-running the model calls one."""
    model = tiny_family_target(family)
    prompt, block = torch.tensor(PROMPTS[0]), torch.tensor([40, 41, 42, 43, 44])
    rolled, direct = RollbackCache(model, rerun), RollbackCache(model)
    rolled.forward(prompt)
    rolled.forward(block)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    rolled.crop(len(prompt) + 2)
    hook.remove()
    assert (rolled.length, len(forwards)) == (len(prompt) + 2, 0 if rerun == "mixers" else 1)
    direct.forward(prompt)
    direct.forward(block[:2])
    for mine, reference in zip(rolled.cache.layers, direct.cache.layers):
        for name in ("keys", "values"):
            if getattr(reference, name, None) is not None:
                torch.testing.assert_close(getattr(mine, name), getattr(reference, name))
        for name in ("conv_states", "recurrent_states"):
            for index, state in getattr(reference, name, {}).items():
                if state is not None:
                    torch.testing.assert_close(getattr(mine, name)[index], state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_equals_generate_and_sweep_equals_replay(family):
    model = tiny_family_target(family)
    draft = _perturbed(model, 0.05)
    truths = [_hf_greedy(model, prompt) for prompt in PROMPTS]
    partial = 0  # steps that kept some drafted tokens and rolled back others: a multi-token re-run on a hybrid
    for prompt, truth in zip(PROMPTS, truths):
        assert plain_generate(TargetModel(model), torch.tensor(prompt), max_new_tokens=MAX_NEW).output_ids == truth
        live = speculative_generate(
            TargetModel(model), AutoregressiveProposer(draft), torch.tensor(prompt), k=K, max_new_tokens=MAX_NEW
        )
        assert live.output_ids == truth
        partial += sum(0 < s.num_accepted < s.num_drafted for s in live.steps)
        table, _ = slot_table(TargetModel(model), AutoregressiveProposer(draft), TeacherSequence(prompt, truth), K)
        assert _steps(walk_schedule(table.matches, truth, K, MAX_NEW, frozenset())) == _steps(live.steps)
        itself = speculative_generate(
            TargetModel(model),
            AutoregressiveProposer(copy.deepcopy(model)),
            torch.tensor(prompt),
            k=K,
            max_new_tokens=MAX_NEW,
        )
        assert itself.output_ids == truth
        assert all(s.num_accepted == s.num_drafted for s in itself.steps)
    assert partial, "the draft never accepted part of a block: the rollback of kept tokens went untested"
    assert generate_greedy_batch(model, PROMPTS, max_new_tokens=MAX_NEW, stop_ids=frozenset()) == truths


@pytest.mark.parametrize("family", FAMILIES)
def test_dflash_draft_replays_live_equal_to_teacher_forced(family):
    model = tiny_family_target(family)
    draft = tiny_dflash(model, block_size=K + 1, layer_ids=(0, 2))
    target = TargetModel(model, draft.hidden_state_indices)
    for prompt in PROMPTS:
        truth = plain_generate(target, torch.tensor(prompt), max_new_tokens=MAX_NEW).output_ids
        live = speculative_generate(
            target, DFlashProposer(draft, target), torch.tensor(prompt), k=K, max_new_tokens=MAX_NEW
        )
        assert live.output_ids == truth
        table, _ = slot_table(target, DFlashProposer(draft, target), TeacherSequence(prompt, truth), K)
        assert _steps(walk_schedule(table.matches, truth, K, MAX_NEW, frozenset())) == _steps(live.steps)


@pytest.mark.parametrize("family", FAMILIES)
def test_taps_read_the_stream_after_each_decoder_layer(family):
    """A DFlash layer id l is the residual stream after decoder layer l on every family, as vLLM taps it:
    aux layer l + 1 (vllm 0.32.0 v1/worker/gpu_model_runner.py, "Add 1 to convert DFlash's aux layer id
    semantics"), read before layer l + 1 by ``_maybe_add_hidden_state`` in qwen3_next.py (which
    Qwen3.5 subclasses) and gpt_oss.py, whatever the layer's kind. The last layer is left out: HF's last
    hidden state is after the final norm."""
    model = tiny_family_target(family)
    layers = model.model.layers
    outputs: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_hook(
            lambda _m, _a, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i, layer in enumerate(layers)
    ]
    ids = list(range(len(layers) - 1))
    features = TargetModel(model).forward(torch.tensor(PROMPTS[0]), taps=tuple(i + 1 for i in ids)).features
    for hook in hooks:
        hook.remove()
    assert features is not None
    assert torch.equal(features, torch.cat([outputs[i][0] for i in ids], dim=-1))


def test_attention_kernel_per_architecture_and_recorded(tmp_path):
    """gpt-oss's sinks have no SDPA path: eager, chosen at load; the others keep SDPA."""
    assert {family: attention_implementation(CONFIGS[family]()) for family in ("gpt_oss", "qwen3_5", "llama")} == {
        "gpt_oss": "eager",
        "qwen3_5": "sdpa",
        "llama": "sdpa",
    }
    tiny_family_target("gpt_oss").save_pretrained(tmp_path)
    assert load_causal_lm(tmp_path).config._attn_implementation == "eager"


def test_unrollbackable_cache_is_refused_before_any_work(tmp_path):
    """Falcon-H1 keeps attention rows and a Mamba state in one cache layer: refused by its config alone
    (no weights are read), one sentence naming the architecture and the layer kind."""
    falcon = torch.nn.Module()
    falcon.config = __import__("transformers").FalconH1Config()
    with pytest.raises(UsageError, match="falcon_h1 targets keep LinearAttentionAndFullAttentionLayer cache layers"):
        TargetModel(falcon)  # type: ignore[arg-type]
    (tmp_path / "falcon").mkdir()
    (tmp_path / "falcon" / "config.json").write_text(json.dumps({"model_type": "falcon_h1"}))
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps({"model_type": "mamba9000"}))
    for folder, fragments in (
        ("falcon", ("falcon_h1", "LinearAttentionAndFullAttentionLayer")),
        ("unknown", ("mamba9000",)),
    ):
        with pytest.raises(UsageError) as refused:
            load_causal_lm(tmp_path / folder)
        assert all(fragment in str(refused.value) for fragment in fragments)


def test_draft_config_validates_layer_ids_against_a_nested_hybrid_target():
    """A Qwen3.5 checkpoint nests its layers under text_config: ids are checked against its 4 layers, and
    the kinds of the tapped layers are reported."""
    text = CONFIGS["qwen3_5"]().to_dict()
    target = {"model_type": "qwen3_5", "text_config": text}
    draft = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": text["hidden_size"],
        "num_target_layers": 4,
        "block_size": 4,
        "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 3]},
    }
    ctx = CheckContext(draft_config=draft, target_config=target, config=build_config(k="3"))
    result = run_checks(ctx, only=["draft-config"])[0]
    assert "target_layer_ids tap layers 0 (linear_attention), 3 (full_attention) of a hybrid target" in [
        f.message for f in result.findings
    ]
    draft["dflash_config"]["target_layer_ids"] = [0, 4]
    result = run_checks(ctx, only=["draft-config"])[0]
    assert result.status == "fail"
    assert "target_layer_ids [4] are outside the target's 4 layers" in [f.message for f in result.findings]


def test_check_end_to_end_on_a_hybrid_target(tmp_path):
    target = tiny_family_target("qwen3_5")
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    save_dflash_draft(tiny_dflash(target, block_size=K + 1, layer_ids=(0, 2)), tmp_path / "dflash")
    write_workload(tmp_path / "workload.jsonl", per_class=1)
    out = tmp_path / "check"
    args = [
        "check",
        "--target",
        tmp_path / "target",
        "--draft",
        tmp_path / "dflash",
        "--workload",
        tmp_path / "workload.jsonl",
        "--max-new-tokens",
        "8",
        "--k",
        str(K),
        "--out",
        out,
    ]
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code in (0, 1), result.output  # 1 = a check failed on random weights; never a crash or a refusal
    run = json.loads((out / "run.json").read_text())
    facts = run["models"]["target"]  # a model's facts are stored flat
    assert (facts["attn_implementation"], facts["cache_rollback"]) == (
        "sdpa",
        "restore recurrent states, re-run kept tokens",
    )
    lossless = next(c for c in run["checks"] if c["id"] == "lossless")
    assert lossless["status"] == "pass", lossless


def test_replay_refuses_an_unrollbackable_target_in_one_sentence(tmp_path):
    (tmp_path / "falcon").mkdir()
    (tmp_path / "falcon" / "config.json").write_text(json.dumps({"model_type": "falcon_h1"}))
    tiny_family_target("qwen3").save_pretrained(tmp_path / "draft")
    tiny_tokenizer().save_pretrained(tmp_path / "draft")
    write_workload(tmp_path / "workload.jsonl", per_class=1)
    result = CliRunner().invoke(
        app,
        [
            "replay",
            "--target",
            str(tmp_path / "falcon"),
            "--draft",
            str(tmp_path / "draft"),
            "--workload",
            str(tmp_path / "workload.jsonl"),
            "--out",
            str(tmp_path / "run"),
        ],
    )
    assert_usage_error(result, "falcon_h1", "cannot roll back")
