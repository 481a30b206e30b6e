"""A monitoring install: `--help`, `watch`, `compare`, `report` and the dashboard without torch and transformers.

Each runs in a subprocess whose import system refuses the model stack (torch, transformers and the packages
only the model commands need: docs/production.md's light install leaves them out), on fixture runs written here.
Every command's module is loaded only when it runs (cli/root.py COMMANDS); their summaries in
`dflash-doctor --help` are held equal to their docstrings.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from dflash_doctor.cli import app
from dflash_doctor.cli.root import COMMANDS, registered_command_name
from fixture_runs import make_fixture_run
from telemetry_fixtures import DATA, write_watch
from tune_fixtures import write_tune_run

REPO = Path(__file__).resolve().parents[1]
# What the light install of docs/production.md leaves out (pyproject's dependencies minus that page's line).
MODEL_STACK = ("torch", "transformers", "tokenizers", "safetensors", "gguf", "accelerate", "huggingface_hub")

BLOCKER = textwrap.dedent(f"""
    import sys

    class NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {MODEL_STACK!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: a monitoring install)", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
""")


def without_model_stack(code: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return without_model_stack(
        "from dflash_doctor.cli import main\nsys.argv[0] = 'dflash-doctor'\nmain()", *args, cwd=cwd
    )


def test_the_blocker_blocks():
    result = without_model_stack("import torch")
    assert result.returncode == 1 and "blocked: a monitoring install" in result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {
        "root": root,
        "base": make_fixture_run(root / "base", seed=0, num_requests=9),
        "new": make_fixture_run(root / "new", seed=1, num_requests=9, degrade=0.35),
        "watch": write_watch(root / "watch", [0.8, 0.6, 0.4, 0.2]),
        "tune": write_tune_run(root / "tuning"),
    }


def test_help_watch_compare_and_report_run_without_the_model_stack(runs, tmp_path):
    helped = cli("--help")
    assert helped.returncode == 0, helped.stderr
    assert all(name in helped.stdout for name in ["check", "watch", "compare", "report", "dashboard"])
    watched = cli("watch", str(DATA / "vllm_server_good.log"), "--once", "--out", str(tmp_path / "watch"))
    assert watched.returncode == 0, watched.stderr + watched.stdout
    assert "tau" in watched.stdout and (tmp_path / "watch" / "windows.parquet").is_file()
    compared = cli("compare", str(runs["base"]), str(runs["new"]), "--out", str(tmp_path / "compare"))
    assert compared.returncode == 1, compared.stderr + compared.stdout  # the degraded run is a regression
    assert (tmp_path / "compare" / "compare.html").is_file()
    for run in ("base", "watch"):
        reported = cli("report", str(runs[run]), "--out", str(tmp_path / f"report-{run}"))
        assert reported.returncode == 0, reported.stderr + reported.stdout
        assert (tmp_path / f"report-{run}" / "report.html").is_file()


def test_a_model_command_without_the_model_stack_fails_on_its_import_when_it_runs(runs, tmp_path):
    """Its --help needs no model stack (tests/test_help_and_light_lane.py); running it does, and says so."""
    result = cli("check", "--max-requests", "1", "--out", str(tmp_path / "check"))
    assert result.returncode != 0 and "blocked: a monitoring install" in result.stderr


def test_the_dashboard_runs_without_the_model_stack(runs):
    code = f"""
        import os
        from streamlit.testing.v1 import AppTest
        from dflash_doctor.app import RUNS_DIR_ENV
        os.environ[RUNS_DIR_ENV] = {str(runs["root"])!r}
        base_pages = ("rejection", "positions", "tokens", "deviations", "sweep", "compare")
        for run, pages in (({str(runs["base"])!r}, base_pages), ({str(runs["watch"])!r}, ("production",))):
            at = AppTest.from_file({str(REPO / "app" / "main.py")!r}, default_timeout=120)
            at.session_state["run_path"] = run
            at.run()
            assert not at.exception, [e.value for e in at.exception]
            for page in pages:
                at.switch_page(f"views/{{page}}.py").run()
                assert not at.exception, (page, [e.value for e in at.exception])
        at.switch_page("views/tune.py").run()
        assert not at.exception, ("tune", [e.value for e in at.exception])
        assert any("--speculative-config" in str(c.value) for c in at.code)  # it drew the tune run's advice (as code)
        print("pages ok", "torch" in sys.modules)
    """
    result = without_model_stack(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pages ok False" in result.stdout


def test_the_command_summaries_of_the_root_help_are_the_commands_docstrings():
    for module, _ in COMMANDS.values():
        __import__(module)
    docs = {registered_command_name(info): info.callback.__doc__ for info in app.registered_commands if info.callback}
    docs.update({group.name: group.typer_instance.info.help for group in app.registered_groups})
    assert {name: summary for name, (_, summary) in COMMANDS.items()} == {
        name: _first_paragraph(docs[name]) for name in COMMANDS
    }


def _first_paragraph(doc: str) -> str:
    """The summary click shows for a command: its docstring's first paragraph, its lines joined."""
    return " ".join(line.strip() for line in doc.strip().split("\n\n")[0].splitlines())


def test_the_documented_light_install_is_pyprojects_dependencies_without_the_model_stack():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=\[ ]", d)[0].lower().replace("_", "-") for d in dependencies}
    page = (REPO / "docs" / "production.md").read_text()
    line = next(line for line in page.splitlines() if "pip install --no-deps dflash-doctor" in line)
    listed = {re.split(r"[<>=\[ ]", word.strip("'\""))[0].lower() for word in line.split("&&")[1].split()[2:]}
    assert listed - {"prometheus-client"} == names - {m.replace("_", "-") for m in MODEL_STACK} - {"filelock"}
