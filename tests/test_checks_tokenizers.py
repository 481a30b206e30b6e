"""tokenizer-parity on hand-made word-level tokenizers and on real ones (SmolLM2, Qwen3, Llama-3.1)."""

from __future__ import annotations

from typer.testing import CliRunner

from checks_fixtures import tiny_tokenizer
from dflash_doctor.checks import CheckContext, run_checks
from dflash_doctor.cli import app

WORDS = ["the", "cat", "sat", "on", "mat", "1", "2", "3"]


def _parity(target, draft=None, **ctx_fields):
    return run_checks(
        CheckContext(target_tokenizer=target, draft_tokenizer=draft, **ctx_fields), only=["tokenizer-parity"]
    )[0]


def _messages(result, severity):
    return [f.message for f in result.findings if f.severity == severity]


def test_tokenizer_parity_pass_on_identical_handmade_tokenizers():
    result = _parity(tiny_tokenizer(WORDS), tiny_tokenizer(WORDS), corpus=["the cat sat on the mat"])
    assert result.status == "pass", result.findings
    assert result.metrics["round_trip"]["identical_share"] == 1.0
    assert result.metrics["vocab_identity"]["num_different_id"] == 0


def test_tokenizer_parity_warn_on_extra_token_and_add_bos():
    result = _parity(tiny_tokenizer(WORDS), tiny_tokenizer(WORDS + ["dog"], add_bos=True))
    assert result.status == "warn"
    warnings = " | ".join(_messages(result, "warn"))
    assert "1 tokens exist only in the draft tokenizer" in warnings
    assert "add_bos differs: target False vs draft True" in warnings
    assert "post_processor" in warnings


def test_tokenizer_parity_fail_on_swapped_ids_with_examples():
    swapped = ["cat", "the", *WORDS[2:]]
    result = _parity(tiny_tokenizer(WORDS), tiny_tokenizer(swapped), corpus=["the cat"])
    assert result.status == "fail"
    assert "2 of 11 shared token strings map to different ids" in result.summary
    assert "'the': target 3 vs draft 4" in result.findings[0].evidence or any(
        "'the': target 3 vs draft 4" in f.evidence for f in result.findings
    )
    round_trip = next(f for f in result.findings if f.message.startswith("corpus round-trip"))
    assert round_trip.severity == "fail" and "'the cat'" in round_trip.evidence


def test_tokenizer_parity_fail_when_tokenizer_exceeds_embedding_and_explains_padding():
    tok = tiny_tokenizer(WORDS)
    result = _parity(tok, tok, target_config={"vocab_size": 8}, draft_config={"vocab_size": 128})
    assert result.status == "fail"
    assert "target tokenizer has 11 tokens but its model has only 8 embedding rows" in _messages(result, "fail")
    assert any(
        "draft embedding has 117 rows the tokenizer never produces, padded to a multiple of 128" in m
        for m in _messages(result, "info")
    )


def test_tokenizer_parity_pass_smollm2_against_itself(smollm2_tokenizer):
    result = _parity(smollm2_tokenizer, smollm2_tokenizer)
    assert result.status == "pass", result.summary
    assert result.metrics["vocab_identity"]["num_shared"] == len(smollm2_tokenizer) == 49152


def test_tokenizer_parity_fail_smollm2_against_qwen3_with_reasons(smollm2_tokenizer, qwen3_tokenizer):
    result = _parity(smollm2_tokenizer, qwen3_tokenizer)
    assert result.status == "fail"
    failures = " | ".join(_messages(result, "fail"))
    assert "shared token strings map to different ids" in failures
    assert "eos token differs: target 2 ('<|im_end|>') vs draft 151645" in failures
    assert "corpus round-trip" in failures
    assert "tokenizer pre_tokenizer differs" in _messages(result, "warn")


def test_tokenizer_parity_fail_smollm2_against_llama31_add_bos(smollm2_tokenizer, llama31_tokenizer):
    result = _parity(smollm2_tokenizer, llama31_tokenizer)
    assert result.status == "fail"
    assert "add_bos differs: target False vs draft True" in _messages(result, "warn")
    assert result.metrics["special_tokens"]["draft"]["added_prefix"] == [128000]


def test_tokenizer_parity_pass_dflash_mask_rows_of_real_tokenizers(qwen3_tokenizer, llama31_tokenizer):
    qwen = _parity(
        qwen3_tokenizer, draft_config={"dflash_config": {"mask_token_id": 151669}}, target_config={"vocab_size": 151936}
    )
    assert qwen.status == "pass" and "151669" in qwen.summary
    assert "mask token id 151669 is a padding row of the target embedding" in _messages(qwen, "info")
    llama = _parity(
        llama31_tokenizer,
        draft_config={"dflash_config": {"mask_token_id": 128002}},
        target_config={"vocab_size": 128256},
    )
    assert llama.status == "pass"
    assert "mask token id 128002 is the reserved special token '<|reserved_special_token_0|>'" in _messages(
        llama, "info"
    )


def test_tokenizer_parity_warn_dflash_mask_is_an_ordinary_token():
    result = _parity(tiny_tokenizer(WORDS), draft_config={"dflash_config": {"mask_token_id": 4}})
    assert result.status == "warn"
    assert "mask token id 4 is the ordinary token 'cat'" in result.summary


def test_tokenizer_parity_fail_dflash_mask_collisions():
    tok = tiny_tokenizer(WORDS)
    eos = _parity(tok, draft_config={"dflash_config": {"mask_token_id": 2}})
    assert eos.status == "fail" and "is the target's eos token" in eos.summary
    out_of_range = _parity(tok, draft_config={"dflash_config": {"mask_token_id": 11}})
    assert out_of_range.status == "fail" and "outside the target embedding (0..10)" in out_of_range.summary
    produced = _parity(
        tok,
        draft_config={"dflash_config": {"mask_token_id": 10}},
        output_token_ids_by_class={"chat": [3, 4], "code": [10]},
    )
    assert produced.status == "fail" and "was produced by the target" in produced.summary


def test_tokenizers_command_exit_codes(qwen3_dir, tmp_path):
    runner = CliRunner()
    same = runner.invoke(app, ["tokenizers", str(qwen3_dir), str(qwen3_dir / "tokenizer.json")])
    assert same.exit_code == 0, same.output
    assert "pass" in same.output and "tokenizer-parity" in same.output
    tiny_tokenizer(WORDS).save_pretrained(tmp_path / "a")
    tiny_tokenizer(["cat", "the", *WORDS[2:]]).save_pretrained(tmp_path / "b")
    different = runner.invoke(app, ["tokenizers", str(tmp_path / "a"), str(tmp_path / "b")])
    assert different.exit_code == 1
    assert "2 of 11 shared token strings map to different ids" in " ".join(different.output.split())
    missing = runner.invoke(app, ["tokenizers", str(tmp_path / "nope"), str(tmp_path / "a")])
    assert missing.exit_code == 2
    assert "does not exist" in " ".join(missing.output.split())
