"""The mtp speculator: a target's own MTP head, drafted as vLLM drafts with it, against the independent
reference of tests/mtp_targets.py (vLLM's rule without a cache), on tiny Qwen3.5, DeepSeek-V3 and GLM
targets whose MTP weights are written into their safetensors; and the mtp-config check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from cli_helpers import assert_usage_error, invoke
from dflash_doctor.engine import mtp_model
from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.mtp_model import build_mtp_head
from dflash_doctor.engine.proposers.mtp import MtpSettings
from dflash_doctor.engine.target import PRE_FINAL_NORM, TapRecorder, TargetModel, tap_points
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, walk_schedule
from dflash_doctor.models.draft_kinds import LoadOptions, weightless_kind
from dflash_doctor.errors import UsageError
from dflash_doctor.models.loading import load_causal_lm
from dflash_doctor.models.mtp_format import read_mtp_checkpoint
from mtp_targets import MAX_NEW, PROMPTS, reference_steps, write_mtp_target
from tiny_models import tiny_target, tiny_tokenizer, torch_threads, write_workload


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def built_targets(tmp_path_factory):
    """Each family's MTP target, written and fit once for the module (family -> folder, target, layers)."""
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            cache[family] = (folder, *write_mtp_target(family, folder))
        return cache[family]

    return get


@pytest.fixture(params=["qwen3_5", "deepseek_v3"])
def mtp_target(request, built_targets):
    return (request.param, *built_targets(request.param))


def load(folder: Path, spec: str = "mtp"):
    model = load_causal_lm(folder)
    kind, settings = weightless_kind(spec)
    draft = kind.from_spec(settings, folder, model.config, LoadOptions(dtype="float32", device="cpu"))
    target = TargetModel(model)
    return target, lambda: kind.build(draft, target, None), kind.facts(draft)


# ------------------------------------------------------------------------------------------- the tests


def test_pre_norm_tap_is_the_last_layers_output_before_the_final_norm():
    model = tiny_target()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.3, 2.5)
    ids = torch.tensor([[5, 17, 42, 8, 9]])
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, a, out: captured.update(out=out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad(), TapRecorder(tap_points(model), (PRE_FINAL_NORM, -1)) as recorder:
        hidden = model(ids, output_hidden_states=True).hidden_states
    hook.remove()
    pre, post = recorder.features("cpu").split(model.config.hidden_size, dim=-1)
    torch.testing.assert_close(pre, captured["out"])
    torch.testing.assert_close(post, hidden[-1])
    torch.testing.assert_close(model.model.norm(pre), post)
    assert (pre - post).abs().max() > 0.1


@pytest.mark.parametrize("k", [1, 3])
def test_live_loop_and_teacher_equal_the_reference(mtp_target, k):
    family, folder, model, layers = mtp_target
    target, build, facts = load(folder)
    assert (
        facts["n_predict"] == 1
        and facts["hidden_state"] == facts["carried_state"] == "post-norm"
        and facts["lm_head"] == "the target's"
    )
    accepted = 0
    for prompt in PROMPTS:
        generated = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        live = speculative_generate(target, build(), torch.tensor(prompt), k=k, max_new_tokens=MAX_NEW)
        assert live.output_ids == generated  # lossless: the target's own greedy text
        expected = reference_steps(layers, model, prompt, generated, k, zero_first=family != "qwen3_5")
        drafts = [[r.draft_token for r in live.tokens if r.step == s.step] for s in live.steps]
        assert [(s.position, d, s.num_accepted) for s, d in zip(live.steps, drafts)] == expected, (family, prompt)
        table, _ = slot_table(target, build(), TeacherSequence(prompt, generated), k)
        walked = walk_schedule(table.matches[:, :k], generated, k, MAX_NEW, frozenset())
        assert [(s.position, s.num_drafted, s.num_accepted) for s in walked] == [
            (s.position, s.num_drafted, s.num_accepted) for s in live.steps
        ]
        accepted += sum(s.num_accepted for s in live.steps)
    assert accepted >= 10  # the fit head agrees with its target often: acceptance is not all zero


def test_the_pre_norm_side_changes_drafts_and_lowers_acceptance(mtp_target):
    family, folder, model, layers = mtp_target
    rates = {}
    for spec, sides in (
        ("mtp", {}),
        ("mtp:hidden_state=pre-norm,carried_state=pre-norm", {"hidden": "pre-norm", "carried": "pre-norm"}),
        ("mtp:carried_state=pre-norm", {"carried": "pre-norm"}),
    ):
        target, build, facts = load(folder, spec)
        drafted = accepted = 0
        for prompt in PROMPTS:
            truth = plain_generate(target, torch.tensor(prompt), max_new_tokens=MAX_NEW).output_ids
            live = speculative_generate(target, build(), torch.tensor(prompt), k=3, max_new_tokens=MAX_NEW)
            expected = reference_steps(layers, model, prompt, truth, 3, zero_first=family != "qwen3_5", **sides)
            assert [s.num_accepted for s in live.steps] == [n for _, _, n in expected]
            drafted += sum(s.num_drafted for s in live.steps)
            accepted += sum(s.num_accepted for s in live.steps)
        rates[spec] = accepted / drafted
    assert rates["mtp:hidden_state=pre-norm,carried_state=pre-norm"] < rates["mtp"], rates
    assert rates["mtp:carried_state=pre-norm"] <= rates["mtp"], rates


def test_k_above_n_predict_cycles_the_layers_and_must_be_a_multiple(tmp_path):
    model, layers = write_mtp_target("deepseek_v3", tmp_path, n_predict=2)
    target, build, facts = load(tmp_path)
    assert facts["n_predict"] == 2 and facts["mtp_layer_indices"] == [4, 5]
    prompt = PROMPTS[0]
    truth = plain_generate(target, torch.tensor(prompt), max_new_tokens=MAX_NEW).output_ids
    live = speculative_generate(target, build(), torch.tensor(prompt), k=4, max_new_tokens=MAX_NEW)
    drafts = [[r.draft_token for r in live.tokens if r.step == s.step] for s in live.steps]
    expected = reference_steps(layers, model, prompt, truth, 4, zero_first=True)
    assert [(s.position, d, s.num_accepted) for s, d in zip(live.steps, drafts)] == expected
    only_first = reference_steps(layers[:1], model, prompt, truth, 4, zero_first=True)
    assert [d for _, d, _ in only_first] != [d for _, d, _ in expected]  # slot 2 really ran the second layer
    table, _ = slot_table(target, build(), TeacherSequence(prompt, truth), 4)
    walked = walk_schedule(table.matches[:, :4], truth, 4, MAX_NEW, frozenset())
    assert [(s.position, s.num_accepted) for s in walked] == [(s.position, s.num_accepted) for s in live.steps]
    write_workload(tmp_path / "w.jsonl", per_class=1)
    result = invoke(
        "replay",
        "--target",
        tmp_path,
        "--draft",
        "mtp",
        "--workload",
        tmp_path / "w.jsonl",
        "--k",
        "3",
        "--max-new-tokens",
        "8",
        "--out",
        tmp_path / "run",
    )
    assert_usage_error(result, "--k 3", "multiple", "2 MTP layers")


def test_a_target_without_an_mtp_head_is_one_sentence(tmp_path):
    tiny_target().save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    write_workload(tmp_path / "w.jsonl", per_class=1)
    result = invoke(
        "replay",
        "--target",
        tmp_path / "target",
        "--draft",
        "mtp",
        "--workload",
        tmp_path / "w.jsonl",
        "--max-new-tokens",
        "8",
        "--out",
        tmp_path / "run",
    )
    assert_usage_error(result, "the target target has no MTP head", "num_nextn_predict_layers", "mtp_num_hidden_layers")
    result = invoke(
        "replay",
        "--target",
        tmp_path / "target",
        "--draft",
        "mtp:hidden_state=middle",
        "--workload",
        tmp_path / "w.jsonl",
        "--out",
        tmp_path / "run2",
    )
    assert_usage_error(result, "hidden_state='middle'", "post-norm or pre-norm")


def _checkpoint(folder: Path):
    config_json = json.loads((folder / "config.json").read_text())
    return read_mtp_checkpoint(folder, config_json, folder.name), AutoConfig.from_pretrained(folder)


def test_the_head_takes_the_checkpoints_tensors_without_building_random_weights_first(built_targets, monkeypatch):
    """Built on the meta device: every parameter is the checkpoint's own tensor (no copy in float32 on the CPU),
    and the weight initialisers only ever see meta tensors (a DeepSeek-V3 MTP block has 11B parameters)."""
    folder = built_targets("deepseek_v3")[0]
    checkpoint, config = _checkpoint(folder)
    initialised_on_meta = []
    monkeypatch.setattr(
        torch.nn.Linear, "reset_parameters", lambda module: initialised_on_meta.append(module.weight.is_meta)
    )
    head = build_mtp_head(checkpoint, config, dtype=torch.float32, device="cpu", target_name="t")
    assert initialised_on_meta and all(initialised_on_meta)
    tensors = checkpoint.layers[0]
    shared = [
        name
        for name, parameter in head.layers[0].named_parameters()
        if name in tensors and parameter.data_ptr() == tensors[name].data_ptr()
    ]
    assert "proj.weight" in shared and "block.self_attn.o_proj.weight" in shared
    assert not any(t.is_meta for t in head.parameters()) and not any(t.is_meta for t in head.buffers())


def test_a_block_that_computes_a_buffer_when_built_is_refused_in_one_sentence(built_targets, monkeypatch):
    folder = built_targets("deepseek_v3")[0]
    checkpoint, config = _checkpoint(folder)
    real_class = mtp_model.decoder_layer_class(config)

    class WithComputedBuffer(real_class):  # type: ignore[misc, valid-type]
        def __init__(self, *args):
            super().__init__(*args)
            self.register_buffer("table", torch.arange(4.0), persistent=False)

    monkeypatch.setattr(mtp_model, "decoder_layer_class", lambda _config: WithComputedBuffer)
    with pytest.raises(UsageError, match="computes its buffer block.table when built"):
        build_mtp_head(checkpoint, config, dtype=torch.float32, device="cpu", target_name="t")


def test_check_end_to_end_records_the_kind_and_names_the_side(built_targets, tmp_path):
    folder, *_ = built_targets("deepseek_v3")  # one end-to-end check; the DeepSeek target is the faster one
    write_workload(tmp_path / "w.jsonl", per_class=1)
    result = invoke(
        "check",
        "--target",
        folder,
        "--draft",
        "mtp:hidden_state=pre-norm",
        "--workload",
        tmp_path / "w.jsonl",
        "--k",
        "1-2",
        "--max-new-tokens",
        "10",
        "--out",
        tmp_path / "run",
    )
    assert result.exit_code in (0, 1), result.output
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    draft = run["models"]["draft"]
    assert draft["kind"] == "mtp" and draft["n_predict"] == 1 and draft["hidden_state"] == "pre-norm"
    checks = {c["id"]: c for c in run["checks"]}
    assert checks["mtp-config"]["status"] == "warn" and "post-norm" in json.dumps(checks["mtp-config"])
    for skipped in ("draft-config", "tokenizer-parity", "chat-template-parity", "target-identity"):
        assert checks[skipped]["status"] == "skip", skipped


# ------------------------------------------------------------------------------------------- the mtp-config check


def mtp_config_result(engine: dict | None = None, ks: tuple[int, ...] = (2,), **facts):
    """The mtp-config check's result for a run whose draft facts are ``facts`` over the defaults."""
    from types import SimpleNamespace

    from dflash_doctor.checks import CheckContext, run_checks
    from dflash_doctor.rundir.run_record import ModelInfo

    facts = {
        "n_predict": 1,
        "hidden_state": "post-norm",
        "carried_state": "post-norm",
        "architecture": "deepseek_v3",
        "engine_sides": {"vllm": {"hidden_state": "post-norm", "carried_state": "post-norm"}},
        **facts,
    }
    draft = ModelInfo(id="mtp", revision_or_hash="mtp", dtype="float32", device="cpu", kind="mtp", facts=facts)
    ctx = CheckContext(
        record=SimpleNamespace(models={"draft": draft}),
        engine_config=engine,  # pyright: ignore
        config=SimpleNamespace(k=list(ks)),
    )
    (result,) = run_checks(ctx, only=["mtp-config"])
    return result


def test_mtp_config_pass_on_the_post_norm_side_with_a_servable_k():
    result = mtp_config_result(engine={"engine": "vllm", "drafted_tokens": 3})
    assert result.status == "pass" and "post-norm" in result.summary and "vllm: post-norm / post-norm" in result.summary


def test_mtp_config_warn_on_the_pre_norm_side_and_on_a_side_the_engine_does_not_pass():
    carried = mtp_config_result(carried_state="pre-norm")
    assert carried.status == "warn" and "the head's state carried between slots" in carried.summary
    served = mtp_config_result(engine={"engine": "vllm", "drafted_tokens": 2}, hidden_state="pre-norm")
    assert served.status == "warn"
    assert any(f.fix == "replay with --draft mtp:hidden_state=post-norm" for f in served.findings)


def test_mtp_config_judges_the_sides_the_engine_passes_for_the_architecture():
    """GLM's vLLM MTP model carries the pre-norm state: a replay
    carrying it passes, one carrying the normed state warns."""
    glm = {
        "architecture": "glm4_moe",
        "engine_sides": {"vllm": {"hidden_state": "post-norm", "carried_state": "pre-norm"}},
    }
    matched = mtp_config_result(engine={"engine": "vllm", "drafted_tokens": 2}, carried_state="pre-norm", **glm)
    assert (
        matched.status == "pass" and "glm4_moe" in matched.summary and "vllm: post-norm / pre-norm" in matched.summary
    )
    normed = mtp_config_result(engine={"engine": "vllm", "drafted_tokens": 2}, **glm)
    assert normed.status == "warn" and any(
        f.fix == "replay with --draft mtp:carried_state=pre-norm" for f in normed.findings
    )


def test_default_sides_follow_the_architecture_vllm_runs():
    """vLLM's Glm4MoeMTPModel carries residual + hidden_states (before the norm), its DeepSeek MTP layer the normed
    shared_head output, its Qwen3-Next/Qwen3.5 predictors the normed
    state; an unread architecture is post-norm, unverified."""
    from dflash_doctor.engine.proposers.mtp import default_mtp_settings, engine_sides

    for architecture in ("glm4_moe", "glm4_moe_lite"):
        assert default_mtp_settings(architecture) == MtpSettings(hidden_state="post-norm", carried_state="pre-norm")
    for architecture in ("deepseek_v3", "glm_moe_dsa", "qwen3_next", "qwen3_5_text", "qwen3_5_moe"):
        assert default_mtp_settings(architecture) == MtpSettings(hidden_state="post-norm", carried_state="post-norm")
        assert engine_sides("vllm", architecture).verified
    assert default_mtp_settings("llama") == MtpSettings() and not engine_sides("vllm", "llama").verified


def test_the_default_glm_replay_carries_the_pre_norm_state_and_an_explicit_side_wins(tmp_path):
    """A GLM target's default replay is vLLM's: the pre-norm state carried (drafts equal the reference's on that
    side), recorded with why; ``mtp:carried_state=post-norm`` still wins. DeepSeek's default stays post-norm."""
    model, layers = write_mtp_target("glm4_moe", tmp_path)
    target, build, facts = load(tmp_path)
    assert facts["architecture"] == "glm4_moe" and (facts["hidden_state"], facts["carried_state"]) == (
        "post-norm",
        "pre-norm",
    )
    assert (
        facts["engine_sides"]["vllm"]["carried_state"] == "pre-norm"
        and "Glm4MoeMTPModel" in facts["sides_from"]["carried_state"]
    )
    prompt = PROMPTS[0]
    truth = plain_generate(target, torch.tensor(prompt), max_new_tokens=MAX_NEW).output_ids
    live = speculative_generate(target, build(), torch.tensor(prompt), k=3, max_new_tokens=MAX_NEW)
    drafts = [[r.draft_token for r in live.tokens if r.step == s.step] for s in live.steps]
    expected = reference_steps(layers, model, prompt, truth, 3, zero_first=True, carried="pre-norm")
    assert [(s.position, d, s.num_accepted) for s, d in zip(live.steps, drafts)] == expected
    _, _, explicit = load(tmp_path, "mtp:carried_state=post-norm")
    assert explicit["carried_state"] == "post-norm" and explicit["sides_from"]["carried_state"].startswith("set:")


def test_mtp_config_fail_when_k_is_not_a_multiple_of_n_predict():
    result = mtp_config_result(ks=(2, 3), n_predict=2)
    assert result.status == "fail" and "K=3 is not a multiple" in result.summary
    assert result.findings[-1].fix == "serve num_speculative_tokens = 2"
    assert mtp_config_result(engine={"engine": "vllm", "drafted_tokens": 4}, ks=(3,), n_predict=2).status == "pass"
