"""The house plan (docs/architecture.md) held by the import graph, read with ``ast`` (nothing is imported).

* No import circle between modules: a circle makes the import order decide what works.
* Rooms import downwards only (:data:`LAYERS`, lowest first; modules of one layer may import each other,
  without circles).
* No function-local import of the project's own modules: such an import exists only to dodge a circle
  or a layer, which the two rules above forbid. Third-party imports may stay local (torch, transformers,
  accelerate, streamlit ... are heavy, and some are optional); :data:`LAZY_IMPORTS` lists the exceptions
  among our own modules, each with its reason.
* pyproject.toml lists every package of the tree, so a new room cannot silently drop out of an install.
* What differs between draft kinds is declared in the kind registry (models/draft_kinds.py, and its
  torch-free serving half models/kind_serving.py): no module outside it branches on a kind's name
  (``if draft_kind == "eagle3"``) or keeps a table keyed by kind names (``{"dflash": ..., "eagle3": ...}``),
  so a new kind is one entry. The kind names are read from the registry (the one import of this file);
  :data:`KIND_BRANCHES_STANDING` and :data:`KIND_TABLES_STANDING` list what stands for now, each with its reason.

``if TYPE_CHECKING:`` imports count as module-level imports: an annotation pointing upwards is a layer
crossed all the same.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "dflash_doctor"

# (layer name, module prefixes), lowest first. A module belongs to the layer of its longest prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("dflash_doctor", "dflash_doctor.errors")),
    ("engine", ("dflash_doctor.engine",)),
    # the typed run record and the run directory's tables and writer: what every room shares
    ("rundir", ("dflash_doctor.rundir",)),
    ("stats", ("dflash_doctor.stats",)),
    # loading a run that is still going summarises its finished requests (stats), so it sits on stats
    ("rundir.load", ("dflash_doctor.rundir.load",)),
    ("inputs", ("dflash_doctor.inputs",)),
    ("models", ("dflash_doctor.models",)),
    ("replay", ("dflash_doctor.replay",)),
    # producers of runs from a serving engine or production telemetry
    ("sources", ("dflash_doctor.serving", "dflash_doctor.telemetry")),
    ("report", ("dflash_doctor.report",)),
    ("checks", ("dflash_doctor.checks",)),
    ("pipeline", ("dflash_doctor.pipeline",)),
    # the step-up experiment on a serving engine: measures with serving/, predicts with pipeline's sweep
    ("tune", ("dflash_doctor.tune",)),
    ("interface", ("dflash_doctor.cli", "dflash_doctor.app", "dflash_doctor.__main__")),
]

# (importing module, imported module) -> why it may stay function-local. Keep this short.
LAZY_IMPORTS: dict[tuple[str, str], str] = {}

REGISTRY_MODULES = ("dflash_doctor.models.draft_kinds", "dflash_doctor.models.kind_serving")
# (module, the comparison as ast.unparse writes it) -> why it stands. Keep this short; remove an entry when it goes.
KIND_BRANCHES_STANDING: dict[tuple[str, str], str] = {
    (
        "dflash_doctor.checks.draft_facts",
        "ctx.draft_kind in ('dflash', 'autoregressive')",
    ): "a check context from before a pair was loaded names the kind or leaves it to the config's shape",
    ("dflash_doctor.checks.draft_facts", "ctx.draft_kind == 'dflash'"): "the same: the DFlash checks' scope",
    ("dflash_doctor.checks.mtp_config", "draft.kind != 'mtp'"): "the mtp-config check judges MTP heads only",
}
# (module, the table's keys as _kind_tables writes them) -> why it stands. Keep this short too.
KIND_TABLES_STANDING: dict[tuple[str, str], str] = {
    (
        "dflash_doctor.engine.dflash_model",
        "dflash, dflash2, dspark",
    ): "keyed by the DFlash variants speculators names (the engine's draft modules), one of them called like the kind",
}


def _package_dirs() -> dict[str, Path]:
    """pyproject's package-dir mapping: import package -> folder."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: REPO / folder for name, folder in setuptools["package-dir"].items()}


def _modules() -> dict[str, Path]:
    """Every module of the package (by its import name) and its file."""
    dirs = _package_dirs()
    modules: dict[str, Path] = {}
    for package, folder in sorted(dirs.items(), key=lambda item: len(item[0])):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            # a folder mapped by a longer package-dir entry belongs to that entry (engine/ lives at the root)
            owner = max((p for p, d in dirs.items() if path.is_relative_to(d)), key=lambda p: len(str(dirs[p])))
            if owner == package:
                modules[name] = path
    return modules


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    local: bool  # inside a function (or a class body), not at module level


def _type_checking_block(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_nodes(tree: ast.Module) -> set[int]:
    """ids of the import nodes that run at import time: top level, and inside top-level if/try blocks."""
    found: set[int] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.add(id(node))
        elif isinstance(node, ast.If):
            pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return found


def _edges(modules: dict[str, Path]) -> list[Edge]:
    edges = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        module_level = _module_level_nodes(tree)
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from package import module` imports the module; `from module import name` the module
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            for target in targets:
                if target.split(".")[0] == PACKAGE and target in modules and target != name:
                    edges.append(Edge(name, target, node.lineno, id(node) not in module_level))
    return edges


def _layer(module: str) -> int:
    best = max(
        (
            (index, prefix)
            for index, (_, prefixes) in enumerate(LAYERS)
            for prefix in prefixes
            if module == prefix or module.startswith(prefix + ".")
        ),
        key=lambda item: len(item[1]),
    )
    return best[0]


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], list[Edge]]:
    modules = _modules()
    return modules, _edges(modules)


def _cycles(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    successors: dict[str, set[str]] = {n: set() for n in nodes}
    for edge in edges:
        successors[edge.source].add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(successors[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer(graph):
    modules, _ = graph
    assert (
        "dflash_doctor.rundir.run_record" in modules and "dflash_doctor.engine.schedule" in modules
    )  # the walk finds the rooms
    for module in modules:
        _layer(module)  # raises on a module no prefix covers


def test_no_import_circle(graph):
    modules, edges = graph
    assert _cycles(list(modules), edges) == []


def test_rooms_import_downwards_only(graph):
    _, edges = graph
    upward = [
        f"{e.source}:{e.line} imports {e.target} ({LAYERS[_layer(e.source)][0]} -> {LAYERS[_layer(e.target)][0]})"
        for e in edges
        if _layer(e.target) > _layer(e.source)
    ]
    assert upward == []


# The command modules import their work inside the command: `dflash-doctor check --help` must answer without
# importing torch (tests/test_help_and_light_lane.py), and every heavy import path starts in pipeline or below.
LAZY_IMPORTERS = ("dflash_doctor.cli.",)


def test_no_function_local_import_of_our_own_modules(graph):
    _, edges = graph
    local = [
        f"{e.source}:{e.line} imports {e.target} inside a function"
        for e in edges
        if e.local and (e.source, e.target) not in LAZY_IMPORTS and not e.source.startswith(LAZY_IMPORTERS)
    ]
    assert local == []


def test_the_checker_sees_a_circle_an_upward_import_and_a_local_import(tmp_path):
    """The rules above would pass on an empty graph too: show they catch each kind of offence."""
    edges = [
        Edge("dflash_doctor.stats.metrics", "dflash_doctor.stats.gate", 1, False),
        Edge("dflash_doctor.stats.gate", "dflash_doctor.stats.metrics", 1, False),
    ]
    assert _cycles(["dflash_doctor.stats.metrics", "dflash_doctor.stats.gate"], edges) == [
        ["dflash_doctor.stats.gate", "dflash_doctor.stats.metrics"]
    ]
    assert (
        _layer("dflash_doctor.rundir.load")
        > _layer("dflash_doctor.stats.metrics")
        > _layer("dflash_doctor.rundir.run_record")
    )
    assert _layer("dflash_doctor.pipeline") > _layer("dflash_doctor.checks.base") > _layer("dflash_doctor.models.pair")
    source = tmp_path / "mod.py"
    source.write_text(
        "import os\nfrom dflash_doctor import errors\n\ndef f():\n    from dflash_doctor.stats import metrics\n"
    )
    nodes = _module_level_nodes(ast.parse(source.read_text()))
    assert len(nodes) == 2  # the function's import is not module level


def test_pyproject_lists_every_package_of_the_tree(graph):
    modules, _ = graph
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert listed == packages


def _kind_branches(source: str, names: set[str]) -> list[tuple[int, str]]:
    """Comparisons of a kind variable (an expression whose text names a kind: ``draft_kind``, ``kind.name``,
    ``ctx.draft_kind``) with a registered kind's name, alone or in a tuple/list/set: (line, comparison)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        literals = [s for s in sides if isinstance(s, ast.Constant)]
        literals += [
            e
            for s in sides
            if isinstance(s, (ast.Tuple, ast.List, ast.Set))
            for e in s.elts
            if isinstance(e, ast.Constant)
        ]
        variables = [s for s in sides if not isinstance(s, (ast.Constant, ast.Tuple, ast.List, ast.Set))]
        if any(c.value in names for c in literals) and any("kind" in ast.unparse(v).lower() for v in variables):
            found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.fixture(scope="module")
def kind_names() -> set[str]:
    from dflash_doctor.models.draft_kinds import AUTO, kind_names

    return set(kind_names()) - {AUTO}


def test_no_branch_on_a_kind_name_outside_the_registry(graph, kind_names):
    modules, _ = graph
    assert {"dflash", "eagle3"} <= kind_names
    branches = {
        (name, text): line
        for name, path in modules.items()
        if name not in REGISTRY_MODULES
        for line, text in _kind_branches(path.read_text(encoding="utf-8"), kind_names)
    }
    offending = [
        f"{name}:{line}: {text} (declare the difference in the kind's registry entry)"
        for (name, text), line in branches.items()
        if (name, text) not in KIND_BRANCHES_STANDING
    ]
    assert offending == []
    assert sorted(set(KIND_BRANCHES_STANDING) - set(branches)) == []  # an entry whose branch went is removed


def test_the_registry_rule_sees_a_branch_on_a_kind_name(kind_names):
    """The rule above would pass on a tree with no kind names; show it catches each form of the branch."""
    source = (
        "def f(draft_kind, kind, ctx, config):\n"
        "    if draft_kind == 'eagle3': pass\n"
        "    if 'dflash' != kind.name: pass\n"
        "    if ctx.draft_kind in ('ngram', 'suffix'): pass\n"
        "    if config.get('model_type') == 'eagle3': pass\n"  # a config value, not a kind variable
        "    if draft_kind == 'auto': pass\n"
    )  # not a kind: the detection order
    assert [line for line, _ in _kind_branches(source, kind_names)] == [2, 3, 4]


def _kind_tables(source: str, names: set[str]) -> list[tuple[int, str]]:
    """Tables keyed by a registered kind's name: a dict literal with such a key (``{"dflash": ..., **more}``)
    or a ``dict(...)`` call with such a keyword: (line, its literal keys sorted, comma-separated)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            keys = [keyword.arg for keyword in node.keywords if keyword.arg is not None]
        else:
            continue
        if names & set(keys):
            found.append((node.lineno, ", ".join(sorted(keys))))
    return sorted(found)


def test_no_table_keyed_by_kind_names_outside_the_registry(graph, kind_names):
    modules, _ = graph
    tables = {
        (name, keys): line
        for name, path in modules.items()
        if name not in REGISTRY_MODULES
        for line, keys in _kind_tables(path.read_text(encoding="utf-8"), kind_names)
    }
    offending = [
        f"{name}:{line}: a table keyed by {keys} (declare it in the kind's registry entry or its KindServing)"
        for (name, keys), line in tables.items()
        if (name, keys) not in KIND_TABLES_STANDING
    ]
    assert offending == []
    assert sorted(set(KIND_TABLES_STANDING) - set(tables)) == []  # an entry whose table went is removed


def test_the_registry_rule_sees_a_table_keyed_by_kind_names(kind_names):
    """The rule above would pass on a tree with no kind names; show it catches each form of the table."""
    source = (
        "METHODS = {'dflash': 'dflash', 'autoregressive': 'draft_model'}\n"
        "def f(kind, k, more):\n"
        "    flags = dict(eagle3=f'--steps {k}', ngram='')\n"
        "    table = {**more, 'mtp': 2}\n"
        "    spec = {'method': 'dflash', 'model': 'DRAFT'}\n"  # a kind's name as a value: not a table of kinds
        "    order = {'auto': 0}\n"  # not a kind: the detection order
        "    return {\n"
        "        'suffix': 1,\n"
        "    }.get(kind)\n"
    )
    assert _kind_tables(source, kind_names) == [
        (1, "autoregressive, dflash"),
        (3, "eagle3, ngram"),
        (4, "mtp"),
        (7, "suffix"),
    ]
