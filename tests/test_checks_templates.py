"""chat-template-parity on hand-made templates and on the real Qwen3 / SmolLM2 / Llama-3.1 templates."""

from __future__ import annotations

from typer.testing import CliRunner

from checks_fixtures import tiny_tokenizer
from dflash_doctor.checks import CheckContext, run_checks
from dflash_doctor.cli import app

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a bot.<|im_end|>\n{% endif %}" + CHATML
)


def _parity(target_template, draft_template, params=None, **fields):
    ctx = CheckContext(target_template=target_template, draft_template=draft_template, **fields)
    return run_checks(ctx, only=["chat-template-parity"], params={"chat-template-parity": params or {}})[0]


def test_chat_template_parity_pass_identical_templates():
    result = _parity(CHATML, CHATML)
    assert result.status == "pass"
    assert result.metrics["comparisons"]["draft"]["num_different"] == 0
    assert result.metrics["comparisons"]["draft"]["num_cases"] == 6


def test_chat_template_parity_fail_injected_system_prompt_with_bytes():
    result = _parity(CHATML_DEFAULT_SYSTEM, CHATML)
    assert result.status == "fail"
    assert "differ in 4/6 renders (first: single-turn gen=True at byte 12)" in result.summary
    assert "'<|im_start|>system\\nYou are a bot." in result.findings[0].evidence
    injected = [f for f in result.findings if "injects a default system prompt" in f.message]
    assert [f.severity for f in injected] == ["warn"] and injected[0].message.startswith("served")


def test_chat_template_parity_warn_double_bos():
    template = "{{ bos_token }}" + CHATML
    tokenizer = tiny_tokenizer(["a"], add_bos=True)
    result = _parity(template, template, target_tokenizer=tokenizer, draft_tokenizer=tokenizer)
    assert result.status == "warn"
    assert "served template writes '<s>' and its tokenizer adds another: double BOS" in result.summary


def test_chat_template_parity_fail_qwen3_thinking_true_vs_false(qwen3_tokenizer):
    result = run_checks(
        CheckContext(target_tokenizer=qwen3_tokenizer, draft_training_template=qwen3_tokenizer.chat_template),
        only=["chat-template-parity"],
        params={"chat-template-parity": {"target_enable_thinking": False, "draft_enable_thinking": True}},
    )[0]
    assert result.status == "fail"
    difference = result.findings[0]
    assert "served and draft training templates differ" in difference.message
    assert (
        "served '>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' "
        "vs draft training '>\\n<|im_start|>assistant\\n'" in difference.evidence
    )
    assert any(f.message.startswith("thinking tags differ") for f in result.findings)


def test_chat_template_parity_pass_qwen3_against_itself_both_thinking_modes(qwen3_tokenizer):
    result = run_checks(
        CheckContext(target_tokenizer=qwen3_tokenizer, draft_tokenizer=qwen3_tokenizer), only=["chat-template-parity"]
    )[0]
    assert result.status == "pass"
    assert result.metrics["comparisons"]["draft"]["num_cases"] == 13  # 3 conversations x 2 gen x 2 thinking + tools


def test_chat_template_parity_fail_smollm2_vs_qwen3(smollm2_tokenizer, qwen3_tokenizer):
    result = run_checks(
        CheckContext(target_tokenizer=smollm2_tokenizer, draft_tokenizer=qwen3_tokenizer), only=["chat-template-parity"]
    )[0]
    assert result.status == "fail"
    messages = [f.message for f in result.findings]
    assert "served template injects a default system prompt when the conversation has none" in messages
    assert any("thinking tags differ" in m for m in messages)


def test_chat_template_parity_warn_llama31_double_bos(llama31_tokenizer):
    result = run_checks(
        CheckContext(target_tokenizer=llama31_tokenizer, draft_tokenizer=llama31_tokenizer),
        only=["chat-template-parity"],
    )[0]
    assert result.status == "warn"
    assert "'<|begin_of_text|>' and its tokenizer adds another: double BOS" in result.summary


def test_templates_command_with_jinja_file_and_thinking_pins(qwen3_dir, tmp_path):
    runner = CliRunner()
    (tmp_path / "chatml.jinja").write_text(CHATML, encoding="utf-8")
    same = runner.invoke(app, ["templates", str(tmp_path / "chatml.jinja"), str(tmp_path / "chatml.jinja")])
    assert same.exit_code == 0, same.output
    pinned = runner.invoke(
        app, ["templates", str(qwen3_dir), str(qwen3_dir), "--target-disable-thinking", "--draft-enable-thinking"]
    )
    assert pinned.exit_code == 1
    assert "<think>" in pinned.output
    bad = runner.invoke(app, ["templates", str(tmp_path / "missing.jinja"), str(qwen3_dir)])
    assert bad.exit_code == 2
