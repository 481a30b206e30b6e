"""The training loop and the train-draft pipeline read as outlines; no function in them grows past one
screen (60 lines after its docstring), so a new step gets its own named function instead of lengthening one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCREEN = 60


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    has_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    start = (first.end_lineno or first.lineno) + 1 if has_docstring and len(node.body) > 1 else first.lineno
    return (node.end_lineno or start) - start + 1


@pytest.mark.parametrize("module", ["loop.py", "pipeline.py"])
def test_every_function_of_the_training_run_fits_on_one_screen(module):
    tree = ast.parse((REPO / "dflash_doctor" / "models" / "training" / module).read_text(encoding="utf-8"))
    lengths = {
        node.name: _body_lines(node)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    assert lengths and all(n <= SCREEN for n in lengths.values()), {k: n for k, n in lengths.items() if n > SCREEN}
