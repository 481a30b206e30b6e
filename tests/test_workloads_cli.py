"""`dflash-doctor workloads [show NAME]` through Typer's runner: output and exit codes."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.inputs.workloads import BUILTIN_NAMES, load_workload

WIDE = {"COLUMNS": "400"}  # rich wraps at the terminal width; keep each sentence on one line


def flat(text: str) -> str:
    """Output without rich's box drawing and line wrapping, for substring checks."""
    return " ".join(re.sub(r"[│╭╮╰╯─┃┏┓┗┛━┡┩┠┨╇╈┳┻]", " ", text).split())


def test_workloads_lists_every_builtin_set_with_counts_per_class():
    result = CliRunner().invoke(app, ["workloads"], env=WIDE)
    assert result.exit_code == 0, result.output
    output = flat(result.output)
    for name in BUILTIN_NAMES:
        assert name in output
    assert "code 164" in output and "chat 60, code 10, math 10" in output and "MIT" in output


def test_show_prints_a_few_requests_of_every_class(tmp_path):
    saved = tmp_path / "picked.jsonl"
    result = CliRunner().invoke(
        app, ["workloads", "show", "mix", "-n", "3", "--max-requests", "9", "--save", str(saved)], env=WIDE
    )
    assert result.exit_code == 0, result.output
    output = flat(result.output)
    assert "mix: 9 requests (chat 3, code 3, math 3)" in output
    assert len(re.findall(r"\b(chat|code|math)/\S+ \(\d turn", output)) == 3
    assert {r.request_class for r in load_workload(str(saved))} == {"chat", "code", "math"}


def test_show_marks_where_the_targets_own_answer_goes():
    result = CliRunner().invoke(app, ["workloads", "show", "mt-bench", "--classes", "writing", "-n", "1"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "assistant: <the target's own answer>" in flat(result.output)


def test_malformed_file_exits_2_with_one_sentence_naming_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n{"messages": [{"role": "user"}]}\n')
    result = CliRunner().invoke(app, ["workloads", "show", str(path)], env=WIDE)
    assert result.exit_code == 2, result.output
    assert f"{path}:2: a user message has no `content`; add the text." in flat(result.output)
    assert "Traceback" not in result.output


def test_unknown_workload_and_class_exit_2():
    for args, fragment in (
        (["workloads", "show", "mtbench"], "did you mean 'mt-bench'?"),
        (["workloads", "show", "demo", "--classes", "poetry"], "--classes poetry"),
    ):
        result = CliRunner().invoke(app, args, env=WIDE)
        assert result.exit_code == 2, result.output
        assert fragment in flat(result.output)
