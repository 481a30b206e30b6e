"""The CLI as the tests drive it: one call through Typer's runner, the tiny pair's arguments, and the one
shape every input error must have (exit 2, one sentence naming the input, no traceback)."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from dflash_doctor.cli import app


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def pair_args(tiny_dir: Path, draft: Path | str, *extra: str) -> list[str]:
    return [
        "--target",
        tiny_dir / "target",
        "--draft",
        draft,
        "--workload",
        tiny_dir / "workload.jsonl",
        "--max-new-tokens",
        "10",
        *extra,
    ]


def assert_usage_error(result, *fragments: str) -> None:
    """Exit 2, no traceback, and one sentence naming the input (the fragments)."""
    output = result.output
    assert result.exit_code == 2, output
    assert "Traceback" not in output
    message = " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())  # a rich error panel wraps lines
    message = message.split("Error", 1)[-1]
    assert message.rstrip().endswith("."), message
    assert not re.search(r"\.\s+[A-Z]", message), f"more than one sentence: {message}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def drafted_inside_the_answer(steps, max_new_tokens: int) -> int:
    """Drafted tokens at output positions inside the budget: the ones with a token record. Under the vllm
    end-of-request rule the last step drafts K past the end, counted in the step, with no output to compare."""
    return int((steps["num_drafted"].clip(upper=(max_new_tokens - steps["position"]).clip(lower=0))).sum())
