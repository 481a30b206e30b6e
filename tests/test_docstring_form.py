"""The public functions of engine/ and stats/ state what they take and return in one form (CONTRIBUTING.md).

Google style: a first line that says what and why, optional prose, then an ``Args:`` section with one
``name: meaning`` entry per parameter (in the signature's order; ``*args`` and ``**kwargs`` with their
stars), ``Returns:`` unless the function returns None, ``Yields:`` instead for a generator, and
``Raises:`` naming :class:`UsageError` where the function raises it itself. A reader (and a reviewer)
then finds every parameter's meaning in one place, and a parameter added or renamed without its entry
fails here. Read with ``ast``: nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = (REPO / "engine", REPO / "dflash_doctor" / "stats")


SECTIONS = ("Args", "Returns", "Yields", "Raises")
_ENTRY = re.compile(r"^    (\*{0,2}[A-Za-z_]\w*): (\S.*)$")


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Every parameter's name as its ``Args:`` entry spells it, in the signature's order.

    Args:
        function: the parsed definition.

    Returns:
        The names, ``*`` before a variadic positional one and ``**`` before a variadic keyword one.
    """
    arguments = function.args
    names = [a.arg for a in arguments.posonlyargs + arguments.args]
    if arguments.vararg is not None:
        names.append("*" + arguments.vararg.arg)
    names += [a.arg for a in arguments.kwonlyargs]
    if arguments.kwarg is not None:
        names.append("**" + arguments.kwarg.arg)
    return names  # module-level functions only: a parameter named ``cls`` (a class's name) is a real one


def _own_nodes(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST]:
    """The nodes of ``function``'s own body, not those of functions, lambdas or classes defined in it.

    Args:
        function: the parsed definition.

    Returns:
        The nodes, in no particular order.
    """
    nodes: list[ast.AST] = []
    pending: list[ast.AST] = list(function.body)
    while pending:
        node = pending.pop()
        nodes.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            pending.extend(ast.iter_child_nodes(node))
    return nodes


def _sections(docstring: str) -> list[tuple[str, list[str]]]:
    """The docstring's sections: each header line (``Args:`` at the left margin) and the lines under it.

    Args:
        docstring: the docstring as :func:`ast.get_docstring` cleans it (common indentation removed).

    Returns:
        (section name, its lines) in the docstring's order; a name twice when the docstring repeats it.
    """
    sections: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in docstring.splitlines():
        header = line.rstrip().removesuffix(":")
        if header in SECTIONS and line.rstrip().endswith(":"):
            current = []
            sections.append((header, current))
        elif current is not None and line.strip() and not line.startswith(" "):
            current = None  # prose after a section ends it
        elif current is not None:
            current.append(line)
    return sections


def form_problems(source: str) -> list[str]:
    """What breaks the form in the public module-level functions of one module's source.

    Args:
        source: the module's Python source.

    Returns:
        One sentence per problem, naming the function; empty when every function keeps the form.
    """
    problems: list[str] = []
    for function in ast.parse(source).body:
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or function.name.startswith("_"):
            continue
        name = function.name
        docstring = ast.get_docstring(function)
        if not docstring or not docstring.splitlines()[0].strip():
            problems.append(f"{name}: no docstring, or no first line saying what it does")
            continue
        found = _sections(docstring)
        order = [section for section, _ in found]
        sections = dict(found)
        for section in sorted(set(order)):
            if order.count(section) > 1:
                problems.append(f"{name}: more than one {section}: section")
        if order != sorted(order, key=SECTIONS.index):
            problems.append(f"{name}: sections out of order ({', '.join(order)}; the order is {', '.join(SECTIONS)})")

        expected = _parameters(function)
        entries = [m.groups() for line in sections.get("Args", []) if (m := _ENTRY.match(line))]
        documented = [entry for entry, _ in entries]
        if documented != expected:
            problems.append(f"{name}: Args: names {documented}, the signature takes {expected}")
        for entry, meaning in entries:
            if re.sub(r"\W", "", meaning.lower()) == re.sub(r"\W", "", entry.lower()):
                problems.append(f"{name}: Args: entry {entry} only repeats its name; say what it means")

        own = _own_nodes(function)
        generator = any(isinstance(node, (ast.Yield, ast.YieldFrom)) for node in own)
        returns_none = isinstance(function.returns, ast.Constant) and function.returns.value is None
        wanted = "Yields" if generator else None if returns_none else "Returns"
        for section in ("Returns", "Yields"):
            if section == wanted and not sections.get(section):
                problems.append(f"{name}: no {section}: section")
            if section != wanted and section in sections:
                problems.append(f"{name}: a {section}: section, but it {'yields' if generator else 'returns None'}")

        raises_usage_error = any(
            isinstance(node, ast.Raise)
            and node.exc is not None
            and "UsageError" in ast.unparse(node.exc.func if isinstance(node.exc, ast.Call) else node.exc)
            for node in own
        )
        if raises_usage_error and not any(
            line.strip().startswith("UsageError:") for line in sections.get("Raises", [])
        ):
            problems.append(f"{name}: raises UsageError, but Raises: does not say when")
    return problems


def _modules() -> list[Path]:
    return sorted(path for root in ROOTS for path in root.rglob("*.py"))


def _relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


@pytest.mark.parametrize("path", _modules(), ids=_relative)
def test_public_functions_keep_the_docstring_form(path):
    assert form_problems(path.read_text()) == []


GOOD = '''
def scale(tokens: int, factor: float = 1.0, *rest: int, unit: str, **extra: str) -> float:
    """Tokens in the caller's unit: the why goes here.

    Args:
        tokens: how many tokens, >= 0.
        factor: the multiplier per token
            (a continuation line).
        *rest: more token counts, added first.
        unit: "s" or "ms".
        **extra: ignored labels.

    Returns:
        The scaled count in ``unit``.
    """
    return tokens * factor


def walk(n: int):
    """Each index below ``n``.

    Args:
        n: how many indices.

    Yields:
        0, 1, ..., n - 1.
    """
    yield from range(n)


def store(path: str) -> None:
    """Write the record at ``path``.

    Args:
        path: the file to write, replaced if present.

    Raises:
        UsageError: when ``path`` is a folder.
    """
    if path.endswith("/"):
        raise UsageError(f"{path} is a folder; pass a file path.")
'''


def test_the_form_is_recognised():
    assert form_problems(GOOD) == []


@pytest.mark.parametrize(
    "old, new, problem",
    [
        (
            "        factor: the multiplier per token\n            (a continuation line).\n",
            "",
            "scale: Args: names ['tokens', '*rest', 'unit', '**extra'], "
            "the signature takes ['tokens', 'factor', '*rest', 'unit', '**extra']",
        ),
        (
            "        n: how many indices.\n",
            "        n: how many indices.\n        step: the stride.\n",
            "walk: Args: names ['n', 'step'], the signature takes ['n']",
        ),
        ("    Returns:\n        The scaled count in ``unit``.\n", "", "scale: no Returns: section"),
        (
            '        unit: "s" or "ms".\n',
            "",
            "scale: Args: names ['tokens', 'factor', '*rest', '**extra'], "
            "the signature takes ['tokens', 'factor', '*rest', 'unit', '**extra']",
        ),
        (
            "        tokens: how many tokens, >= 0.\n        factor: the multiplier per token\n",
            "        factor: the multiplier per token\n        tokens: how many tokens, >= 0.\n",
            "scale: Args: names ['factor', 'tokens', '*rest', 'unit', '**extra'], "
            "the signature takes ['tokens', 'factor', '*rest', 'unit', '**extra']",
        ),
        ("    Yields:\n", "    Returns:\n", "walk: no Yields: section"),
        (
            "    Args:\n        n: how many indices.\n\n    Yields:\n        0, 1, ..., n - 1.\n",
            "    Yields:\n        0, 1, ..., n - 1.\n\n    Args:\n        n: how many indices.\n",
            "walk: sections out of order (Yields, Args; the order is Args, Returns, Yields, Raises)",
        ),
        (
            "    Raises:\n",
            "    Returns:\n        Nothing.\n\n    Raises:\n",
            "store: a Returns: section, but it returns None",
        ),
        (
            "        n: how many indices.",
            "        n: n.",
            "walk: Args: entry n only repeats its name; say what it means",
        ),
        (
            "    Raises:\n        UsageError: when",
            "    When",
            "store: raises UsageError, but Raises: does not say when",
        ),
    ],
    ids=[
        "missing parameter",
        "extra parameter",
        "missing Returns",
        "missing keyword-only parameter",
        "parameters out of order",
        "generator without Yields",
        "sections out of order",
        "Returns on a None function",
        "entry restating its name",
        "undocumented UsageError",
    ],
)
def test_the_rule_catches(old, new, problem):
    assert old in GOOD
    assert problem in form_problems(GOOD.replace(old, new, 1))
