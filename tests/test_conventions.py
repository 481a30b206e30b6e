"""What users expect of a pip-installed command-line tool: ``--version`` from the installed metadata."""

from __future__ import annotations

from importlib.metadata import version

from typer.testing import CliRunner

import dflash_doctor
from dflash_doctor.cli import app


def test_version_flag_prints_the_installed_distribution_version_and_runs_no_command():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"dflash-doctor {version('dflash-doctor')}\n"
    assert dflash_doctor.__version__ == version("dflash-doctor")


def test_without_version_the_tool_still_lists_its_commands():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0 and "--version" in result.output and "check" in result.output
