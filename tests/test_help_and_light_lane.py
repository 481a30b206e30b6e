"""Help a newcomer can read, and a test lane a contributor can run after `pip install -e ".[test]"` alone.

Help: no command's --help imports torch (seconds on a small machine), the root text names every speculator kind,
command summaries are shown whole at the terminal's width, check's --draft is listed beside --target and path
options show as paths. The light lane: the suite collects with no error when the packages only
scripts/setup-dev.sh installs (the official dflash oracle, playwright, prometheus-client) are missing: their test
modules skip with a reason, and the one command CONTRIBUTING.md documents is the one run here.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_doctor.cli.root import COMMANDS
from dflash_doctor.models.draft_kinds import AUTO, kind_names

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
OPTIONAL = ("dflash", "playwright", "prometheus_client")  # installed by scripts/setup-dev.sh, not by ".[test]"
# the light lane's one command, as CONTRIBUTING.md writes it (held equal below)
LIGHT_LANE_MARKERS = "not integration and not browser and not vllm and not llamacpp and not gpu"


def _help(*args: str, columns: int = 120) -> subprocess.CompletedProcess:
    """``dflash-doctor ARGS`` in a fresh interpreter; prints
    which heavy modules --help imported on stderr's last line."""
    code = textwrap.dedent("""
        import sys
        from dflash_doctor.cli import main
        sys.argv[0] = "dflash-doctor"
        try:
            main()
        except SystemExit:
            pass
        print("imported:", sorted(m for m in ("torch", "transformers") if m in sys.modules), file=sys.stderr)
    """)
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize(
    "command",
    [
        "check",
        "sweep",
        "tune",
        "replay",
        "tokenizers",
        "templates",
        "env",
        "compare",
        "watch",
        "report",
        "workloads",
        "dashboard",
    ],
)
def test_no_commands_help_imports_torch(command):
    result = _help(command, "--help")
    assert "Usage: dflash-doctor" in result.stdout, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "imported: []", result.stderr


def test_the_root_help_names_every_speculator_kind_and_shows_whole_summaries():
    text = _help("--help").stdout
    flat = " ".join(text.split())
    for kind in [name for name in kind_names() if name != AUTO]:
        assert re.search(rf"\b{re.escape(kind)}\b", flat), kind
    assert "..." not in text.split("Commands:")[1]  # no summary cut short
    for name, (_, summary) in COMMANDS.items():
        assert " ".join(summary.split()) in flat, name  # whole, wrapped at the terminal's width
    assert max(len(line) for line in text.splitlines()) > 100  # laid out at 120 columns, not click's 80


def test_check_help_lists_draft_beside_target_and_paths_as_paths():
    text = _help("check", "--help").stdout
    options = re.findall(r"^  (--[a-z-]+)", text, flags=re.M)
    assert options[options.index("--target") + 1] == "--draft", options
    for option, metavar in (
        ("--target", "PATH|ORG/NAME"),
        ("--draft", "PATH|ORG/NAME|KIND"),
        ("--workload", "NAME|PATH"),
        ("--out", "DIR"),
        ("--chat-template", "PATH"),
        ("--cost-profile", "PATH"),
        ("--engine-config", "PATH"),
        ("--config", "PATH"),
    ):
        assert re.search(rf"^  {re.escape(option)} {re.escape(metavar)}\s", text, flags=re.M), option


def _top_level_imports(path: Path) -> set[str]:
    """The packages a module imports at its top level (not inside a function, a class or a try)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_module_imports_an_optional_package_at_its_top_level():
    """A missing optional package must skip its module
    (pytest.importorskip with a reason), never error its collection."""
    offenders = {path.name: sorted(_top_level_imports(path) & set(OPTIONAL)) for path in sorted(TESTS.glob("*.py"))}
    assert not {name: found for name, found in offenders.items() if found}


def test_contributing_documents_the_light_lane_command():
    text = " ".join((REPO / "CONTRIBUTING.md").read_text(encoding="utf-8").split())
    assert 'pip install -e ".[test]"' in text
    assert f'python -m pytest -m "{LIGHT_LANE_MARKERS}"' in text


def test_the_light_lane_collects_with_no_error_without_the_optional_packages():
    """The suite's collection in an interpreter where the optional packages are missing: zero errors, and each
    module that needs one is skipped with its reason."""
    code = textwrap.dedent(f"""
        import sys

        class NotInstalled:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {OPTIONAL!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (not in the light lane)", name=name)
                return None

        sys.meta_path.insert(0, NotInstalled())
        import pytest
        arguments = ["--collect-only", "-q", "-p", "no:cacheprovider", "-rs", "-m", {LIGHT_LANE_MARKERS!r}, "tests"]
        sys.exit(pytest.main(arguments))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " error" not in result.stdout.splitlines()[-1], result.stdout[-2000:]
    for reason in (
        "official dflash 0.1.0 oracle",
        "playwright is installed",
        "prometheus-client is the exporter extra",
    ):
        assert reason in result.stdout, reason
