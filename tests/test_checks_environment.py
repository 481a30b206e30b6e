"""environment: facts collection, engine-config parsing, and the rules in checks/rules.toml."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash_doctor.checks import CheckContext, run_checks
from dflash_doctor.inputs.server_config import parse_server_config, parse_server_config_text
from dflash_doctor.checks.environment import load_rules
from dflash_doctor.inputs.machine import collect_environment
from dflash_doctor.cli import app
from dflash_doctor.errors import UsageError

ENV = {"python": "3.11.7", "torch": "2.9.0", "transformers": "4.57.1", "tokenizers": "0.22.1"}
DFLASH_B16 = {
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "transformers_version": "4.57.1",
}


def _env_check(engine_text=None, environment=ENV, draft_config=DFLASH_B16):
    engine = parse_server_config_text(engine_text) if engine_text else None
    ctx = CheckContext(environment=environment, draft_config=draft_config, engine_config=engine)
    return run_checks(ctx, only=["environment"])[0]


def test_collect_environment_has_the_run_json_keys():
    environment = collect_environment(attn_implementation="sdpa")
    for key in ("python", "torch", "transformers", "tokenizers", "cuda", "gpu", "attn_implementation"):
        assert key in environment
    assert environment["attn_implementation"] == "sdpa"
    assert environment["transformers"].split(".")[0].isdigit()


def test_environment_pass_with_matching_flags():
    result = _env_check('{"method": "dflash", "num_speculative_tokens": 15, "model": "z-lab/x"}')
    assert result.status == "pass", [f.message for f in result.findings]
    assert result.metrics["matched_rules"] == []
    assert result.metrics["num_rules"] == len(load_rules()) >= 10


def test_environment_warn_sglang_vllm_convention_and_version_drift():
    result = _env_check(
        "python -m sglang.launch_server --speculative-algorithm DFLASH "
        "--speculative-num-draft-tokens 15 --attention-backend fa3",
        environment={**ENV, "transformers": "5.2.0"},
    )
    assert result.status == "warn"
    assert set(result.metrics["matched_rules"]) == {
        "sglang-dflash-draft-tokens-vllm-convention",
        "draft-transformers-version",
        "dflash-reference-transformers-pin",
    }
    fixes = [f.fix for f in result.findings]
    assert "launch with --speculative-num-draft-tokens 16" in fixes


def test_environment_warn_flashinfer_under_cuda_graphs():
    result = _env_check(
        json.dumps(
            {
                "speculative_config": {"method": "dflash", "num_speculative_tokens": 15},
                "attention_backend": "FLASHINFER",
            }
        )
    )
    assert result.metrics["matched_rules"] == ["vllm-dflash-flashinfer-cuda-graphs"]
    eager = _env_check(
        json.dumps(
            {
                "speculative_config": {"method": "dflash", "num_speculative_tokens": 15},
                "attention_backend": "FLASHINFER",
                "enforce_eager": True,
            }
        )
    )
    assert eager.status == "pass"


def test_environment_fail_trtllm_mha_draft_backend_for_sglang_dflash():
    result = _env_check(
        "--speculative-algorithm DFLASH --speculative-num-draft-tokens 16 "
        "--attention-backend fa3 --speculative-draft-attention-backend trtllm_mha"
    )
    assert result.status == "fail"
    assert result.summary == "SGLang draft attention backend trtllm_mha cannot run DFlash's non-causal block attention"


def test_environment_fail_vllm_k_in_sglang_convention():
    result = _env_check(
        'vllm serve Qwen/Qwen3-8B --speculative-config \'{"method": "dflash", "num_speculative_tokens": 16}\''
    )
    assert result.status == "fail"
    assert "equals the DFlash block size" in result.summary
    assert result.findings[0].fix == "set speculative_config.num_speculative_tokens to 15"


def test_environment_warn_llamacpp_default_n_max_uses_a_fifth_of_the_dflash_block():
    """llama-server flags without --spec-draft-n-max draft 3 tokens (its default); with 15 the rule is quiet."""
    result = _env_check("llama-server -m target.gguf -md draft.gguf --spec-type draft-dflash --metrics")
    assert result.metrics["matched_rules"] == ["llamacpp-dflash-n-max-below-block"]
    assert (
        result.summary
        == "llama.cpp drafts 3 of the 15 tokens a DFlash block proposes (--spec-draft-n-max defaults to 3)"
    )
    assert result.findings[0].fix.startswith("restart llama-server with --spec-draft-n-max 15")
    full = parse_server_config_text("--spec-type draft-dflash --spec-draft-n-max 15 --model-draft d.gguf")
    assert (full["engine"], full["method"], full["drafted_tokens"], full["draft_model"]) == (
        "llamacpp",
        "dflash",
        15,
        "d.gguf",
    )
    assert _env_check("--spec-type draft-dflash --spec-draft-n-max 15").status == "pass"


def test_engine_config_parsing_and_bad_input(tmp_path):
    sglang = parse_server_config_text(
        "--speculative-algorithm DFLASH --speculative-num-draft-tokens=16 --disable-cuda-graph"
    )
    assert (sglang["engine"], sglang["drafted_tokens"], sglang["cuda_graphs"]) == ("sglang", 15, False)
    nested = parse_server_config_text(
        json.dumps({"speculative_config": json.dumps({"method": "dflash", "num_speculative_tokens": 7})})
    )
    assert nested["num_speculative_tokens"] == 7
    with pytest.raises(UsageError, match="neither a vLLM speculative_config nor SGLang"):
        parse_server_config_text("--port 8000")
    with pytest.raises(UsageError, match="does not exist"):
        parse_server_config(tmp_path / "missing.json")
    with pytest.raises(UsageError, match="not an integer"):
        parse_server_config_text("--speculative-num-draft-tokens lots --speculative-algorithm DFLASH")


def test_bad_rules_file_is_a_usage_error(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text(
        '[[rule]]\nid = "x"\nseverity = "fatal"\nmessage = "m"\n'
        'fix = "f"\nsource = "s"\n[rule.when]\n"env.torch" = "1"\n'
    )
    with pytest.raises(UsageError, match="severity 'fatal'"):
        load_rules(rules)


def test_env_command_exit_codes(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(DFLASH_B16))
    flags = tmp_path / "sglang.txt"
    flags.write_text(
        "--speculative-algorithm DFLASH --speculative-num-draft-tokens "
        "16 --speculative-draft-attention-backend trtllm_mha"
    )
    runner = CliRunner()
    failing = runner.invoke(app, ["env", "--engine-config", str(flags), "--draft", str(draft)])
    assert failing.exit_code == 1, failing.output
    assert "trtllm_mha cannot run DFlash's non-causal block attention" in " ".join(failing.output.split())
    missing = runner.invoke(app, ["env", "--engine-config", str(tmp_path / "nope.json")])
    assert missing.exit_code == 2
