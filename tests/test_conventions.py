"""What users expect of a pip-installed command-line tool: ``--version`` from the installed metadata,
``--json`` on stdout, choices, defaults and examples in ``--help``, shell completion, config discovery
with its precedence (flag > DFLASH_DOCTOR_* variable > file > defaults)."""

from __future__ import annotations

import json
import logging
import re
import shlex
import subprocess
import sys
import warnings
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

import huggingface_hub.utils as hub_utils
import transformers.utils.logging as transformers_logging

import pytest
import click
import typer
from typer.testing import CliRunner

import dflash_doctor
from dflash_doctor.cli import app
from dflash_doctor.cli.log_setup import LIBRARIES, configure_logging, progress_shown
from dflash_doctor.cli.options import config_command
from dflash_doctor.stages import on_stage
from dflash_doctor.inputs.config import DoctorConfig, discover_config_file
from dflash_doctor.telemetry.watch_record import read_windows
from fixture_runs import make_fixture_run
from telemetry_fixtures import DATA, MetricsExporter
from cli_helpers import pair_args
from replay_server import ReplayServer


def test_version_flag_prints_the_installed_distribution_version_and_runs_no_command():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"dflash-doctor {version('dflash-doctor')}\n"
    assert dflash_doctor.__version__ == version("dflash-doctor")


def test_without_version_the_tool_still_lists_its_commands():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0 and "--version" in result.output and "check" in result.output


# ---------------------------------------------------------------------------------------------------- --json

USER_GUIDE = Path(__file__).resolve().parents[1] / "docs" / "user-guide.md"


def assert_documented(payload: dict) -> None:
    """Every top-level key of a --json payload is named in
    docs/user-guide.md "Machine-readable output" (the contract)."""
    text = USER_GUIDE.read_text(encoding="utf-8")
    section = text[text.index("## Machine-readable output") :]
    section = section[: section.index("\n## ")]
    assert not [key for key in payload if f"`{key}`" not in section]


def test_check_json_is_report_json_plus_run_dir_and_exit_code_and_alone_on_stdout(tmp_path):
    with ReplayServer() as server:
        result = CliRunner().invoke(
            app,
            [
                "check",
                "--engine",
                server.url,
                "--workload",
                "demo",
                "--max-requests",
                "2",
                "--classes",
                "math",
                "--max-new-tokens",
                "96",
                "--out",
                str(tmp_path / "run"),
                "--json",
            ],
        )
    assert result.exit_code in (0, 1), result.output
    payload = json.loads(result.stdout)  # nothing but the object on stdout: the tables went to stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert {key: payload[key] for key in report} == report
    assert payload["run_dir"] == str(tmp_path / "run") and payload["exit_code"] == result.exit_code
    assert payload["verdict"] in ("pass", "warn", "fail", "error") and payload["checks"]
    assert_documented(payload)
    assert "run directory and reports" in result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    return {
        "base": make_fixture_run(root / "base", seed=0),
        "degraded": make_fixture_run(root / "degraded", seed=0, degrade=0.4),
    }


def test_compare_json_names_each_regression_and_the_exit_code(runs, tmp_path):
    result = CliRunner().invoke(
        app, ["compare", str(runs["base"]), str(runs["degraded"]), "--out", str(tmp_path), "--json"]
    )
    assert result.exit_code == 1, result.output
    payload = json.loads(result.stdout)
    assert payload["compare_json_version"] == 1 and payload["regression"] is True and payload["exit_code"] == 1
    assert payload["regressions"] and all(row["regression"] for row in payload["regressions"])
    assert {"class", "metric", "slot", "base", "new", "delta", "threshold"} <= set(payload["regressions"][0])
    assert payload["reports"] == [str(tmp_path / "compare.html"), str(tmp_path / "compare.md")]
    assert "REGRESSION" in result.stderr and "REGRESSION" not in result.stdout
    assert_documented(payload)
    assert_documented(payload["regressions"][0])


def test_watch_once_json_holds_one_windows_row_per_series(tmp_path):
    text = (DATA / "vllm_metrics_good.txt").read_text()
    with MetricsExporter(text) as exporter:
        result = CliRunner().invoke(
            app, ["watch", exporter.url, "--once", "--baseline", "1.5", "--out", str(tmp_path / "run"), "--json"]
        )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    (series,) = payload["series"]
    (row,) = read_windows(tmp_path / "run").to_dict("records")
    assert (
        series["mean_acceptance_length"] == pytest.approx(row["mean_acceptance_length"])
        and series["model"] == row["model"]
    )
    assert payload["verdict"] == "ok" and payload["exit_code"] == 0 and payload["run_dir"] == str(tmp_path / "run")
    assert payload["watch_json_version"] == 1
    assert_documented(payload)
    assert_documented(series)


def test_watch_json_without_once_is_refused():
    result = CliRunner().invoke(app, ["watch", "http://127.0.0.1:9/metrics", "--json"])
    assert result.exit_code == 2 and "--once" in result.output


# ---------------------------------------------------------------------------------------------------- discoverability


def _help(*command: str) -> str:
    return re.sub(r"\s+", " ", CliRunner().invoke(app, [*command, "--help"], terminal_width=200).output)


def test_choice_flags_list_their_choices_and_every_flag_its_real_default():
    text = _help("check")
    for choices in (
        "<float32|bfloat16|float16>",
        "<fail|warn>",
        "<vllm|llamacpp|official>",
        "<inline|cdn>",
        "dflash | eagle3 | autoregressive | auto",
    ):
        assert choices in text
    for default in ("default: (float32)", "default: (128)", "default: (cpu)", "default: (auto)", "default: (fail)"):
        assert default in text


def test_every_command_shows_an_example_of_itself():
    group = typer.main.get_command(app)  # commands load on demand (cli/root.py): ask the group for each
    context = click.Context(group)
    names = getattr(group, "list_commands")(context)
    assert len(names) > 10
    for name in names:
        command = getattr(group, "get_command")(context, name)
        assert f"dflash-doctor {name}" in (command.epilog or ""), name


def test_check_help_names_exit_1_for_a_failed_or_errored_check():
    assert "1 a check failed or errored" in _help("check")


def test_completion_completes_choice_flags():
    env = {"_DFLASH_DOCTOR_COMPLETE": "complete_bash", "COMP_WORDS": "dflash-doctor check --dtype ", "COMP_CWORD": "3"}
    result = CliRunner().invoke(app, [], env=env, prog_name="dflash-doctor")
    assert result.output.split() == ["float32", "bfloat16", "float16"]
    env["COMP_WORDS"] = "dflash-doctor sweep --draft-kind "
    assert CliRunner().invoke(app, [], env=env, prog_name="dflash-doctor").output.split() == [
        "dflash",
        "ngram",
        "suffix",
        "eagle3",
        "mtp",
        "autoregressive",
        "auto",
    ]
    # the script for the shell the user types in, found from the process tree, so run from a real bash (under a
    # runner started without one typer finds no shell and exits 1); `; exit $?` keeps bash from exec-ing the
    # command in its own place, which would leave no bash in the tree
    script = subprocess.run(
        ["bash", "-c", f"{shlex.quote(str(Path(sys.executable).parent / 'dflash-doctor'))} --show-completion; exit $?"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert script.returncode == 0 and "_DFLASH_DOCTOR_COMPLETE" in script.stdout, script.stderr


# ---------------------------------------------------------------------------------------------------- configuration


def _probe_app() -> tuple[typer.Typer, list[DoctorConfig]]:
    """A command declared like check's, recording the DoctorConfig it is handed."""
    seen: list[DoctorConfig] = []
    probe = typer.Typer()

    @probe.command()
    @config_command("dtype", "max_new_tokens", "device", "trust_remote_code")
    def run(config: DoctorConfig) -> None:
        seen.append(config)

    return probe, seen


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    """A working directory and user config folder of the test's own (no doctor.toml of the developer's)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "user-config"))
    for name in ("DFLASH_DOCTOR_DTYPE", "DFLASH_DOCTOR_DEVICE", "DFLASH_DOCTOR_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_a_config_file_value_wins_over_a_flags_shown_default_and_loses_to_the_flag(empty_home):
    (empty_home / "mine.toml").write_text('dtype = "bfloat16"\nmax_new_tokens = 7\ntrust_remote_code = false\n')
    probe, seen = _probe_app()
    assert CliRunner().invoke(probe, ["--config", "mine.toml"]).exit_code == 0
    assert (seen[-1].dtype, seen[-1].max_new_tokens, seen[-1].trust_remote_code) == ("bfloat16", 7, False)
    assert CliRunner().invoke(probe, ["--config", "mine.toml", "--trust-remote-code"]).exit_code == 0
    assert seen[-1].trust_remote_code is True  # the flag grants it
    assert CliRunner().invoke(probe, ["--config", "mine.toml", "--dtype", "float16"]).exit_code == 0
    assert (seen[-1].dtype, seen[-1].max_new_tokens) == ("float16", 7)
    assert CliRunner().invoke(probe, []).exit_code == 0
    assert (seen[-1].dtype, seen[-1].max_new_tokens, seen[-1].trust_remote_code) == (
        "float32",
        128,
        False,
    )  # DoctorConfig's defaults


def test_config_discovery_order_doctor_toml_then_pyproject_then_user_folder(empty_home):
    probe, seen = _probe_app()
    user = empty_home / "user-config" / "dflash-doctor"
    user.mkdir(parents=True)
    (user / "doctor.toml").write_text("max_new_tokens = 3\n")
    CliRunner().invoke(probe, [])
    assert seen[-1].max_new_tokens == 3
    (empty_home / "pyproject.toml").write_text('[project]\nname = "x"\n')  # no [tool.dflash-doctor]: passed over
    CliRunner().invoke(probe, [])
    assert seen[-1].max_new_tokens == 3
    (empty_home / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.dflash-doctor]\nmax_new_tokens = 2\n')
    CliRunner().invoke(probe, [])
    assert seen[-1].max_new_tokens == 2
    (empty_home / "doctor.toml").write_text("max_new_tokens = 1\n")
    CliRunner().invoke(probe, [])
    assert seen[-1].max_new_tokens == 1
    assert discover_config_file(empty_home) == empty_home / "doctor.toml"


def test_environment_variables_sit_between_the_flag_and_the_file(empty_home):
    (empty_home / "doctor.toml").write_text('dtype = "bfloat16"\ndevice = "cuda:3"\n')
    probe, seen = _probe_app()
    env = {"DFLASH_DOCTOR_DTYPE": "float16"}
    CliRunner().invoke(probe, [], env=env)
    assert (seen[-1].dtype, seen[-1].device) == ("float16", "cuda:3")
    CliRunner().invoke(probe, ["--dtype", "float32"], env=env)
    assert seen[-1].dtype == "float32"


def test_an_unknown_choice_is_refused_with_exit_2(empty_home):
    probe, _ = _probe_app()
    result = CliRunner().invoke(probe, ["--dtype", "fp8"])
    assert result.exit_code == 2 and "'fp8' is not one of 'float32', 'bfloat16', 'float16'" in result.output


# --------------------------------------------------------------------------------------------------- logging and stages


@pytest.fixture
def restored_logging():
    """configure_logging changes process-wide logging; put the levels, handlers and bars back after the test."""
    names = ["", "dflash_doctor", *LIBRARIES]
    saved = {
        name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers), logging.getLogger(name).propagate)
        for name in names
    }
    bars = (transformers_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled())
    yield
    for name, (level, handlers, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate = propagate
    (transformers_logging.enable_progress_bar if bars[0] else transformers_logging.disable_progress_bar)()
    (hub_utils.disable_progress_bars if bars[1] else hub_utils.enable_progress_bars)()


def _log_each(capsys, verbosity: int) -> str:
    """stderr after configuring ``verbosity`` and logging one record of each source."""
    with warnings.catch_warnings():  # pytest records warnings itself; here they must reach logging as in the CLI
        warnings.simplefilter("always")
        logging.captureWarnings(
            False
        )  # forget a capture an earlier CLI call in this process set up under pytest's recorder
        configure_logging(verbosity)
        logging.getLogger("dflash_doctor.replay").info("ours-info")
        logging.getLogger("dflash_doctor.models").warning("ours-warning")
        transformers_logging.get_logger("transformers.modeling_utils").warning("transformers-warning")
        logging.getLogger("huggingface_hub.file_download").warning("hub-warning")
        warnings.warn("python-warning", UserWarning, stacklevel=1)
        logging.captureWarnings(False)
    captured = capsys.readouterr()
    assert captured.out == ""  # logging never writes to stdout (--json owns it)
    return captured.err


def test_default_verbosity_hides_library_warnings_and_bars_and_shows_ours(restored_logging, capsys):
    err = _log_each(capsys, 0)
    assert "ours-warning" in err and "ours-info" not in err
    assert "transformers-warning" not in err and "hub-warning" not in err and "python-warning" not in err
    assert not transformers_logging.is_progress_bar_enabled() and hub_utils.are_progress_bars_disabled()
    assert progress_shown()


def test_verbose_routes_library_warnings_through_one_handler_once(restored_logging, capsys):
    err = _log_each(capsys, 1)
    unwrapped = "".join(err.split())  # the console wraps a long line (the warning's file path) at its width
    for text in ("ours-info", "ours-warning", "transformers-warning", "hub-warning", "UserWarning:python-warning"):
        assert unwrapped.count(text) == 1, text  # once: the libraries' own handlers no longer print a second copy
    assert transformers_logging.is_progress_bar_enabled() and not hub_utils.are_progress_bars_disabled()


def test_quiet_shows_errors_only_and_no_progress(restored_logging, capsys):
    assert "ours-warning" not in _log_each(capsys, -1)
    assert not progress_shown()


def test_verbose_and_quiet_together_are_refused(restored_logging):
    result = CliRunner().invoke(app, ["-v", "-q", "workloads"])
    assert result.exit_code == 2 and "-v and -q" in result.output


def test_sweep_announces_loading_and_pricing_as_stages(tiny_dir, tmp_path, restored_logging):
    seen: list[str] = []

    @contextmanager
    def record(description: str):
        seen.append(description)
        yield

    with on_stage(record):
        result = CliRunner().invoke(
            app, ["sweep", *map(str, pair_args(tiny_dir, tiny_dir / "dflash", "--k", "1-3", "--out", tmp_path / "run"))]
        )
    assert result.exit_code == 0, result.output
    assert [text.split(" ")[:3] for text in seen] == [
        ["loading", "the", "target"],
        ["loading", "the", "dflash"],
        ["pricing", "K", "1-3:"],
    ]
    assert "✓ loading the target target" in result.stderr  # the CLI's own indicator, ticked when done


def test_report_format_completes_the_last_item_of_its_list():
    env = {
        "_DFLASH_DOCTOR_COMPLETE": "complete_bash",
        "COMP_WORDS": "dflash-doctor report RUN --format html,j",
        "COMP_CWORD": "4",
    }
    assert CliRunner().invoke(app, [], env=env, prog_name="dflash-doctor").output.split() == ["html,json", "html,junit"]


def test_draft_kind_help_names_every_registered_kind():
    """--draft-kind's help is written out (the registry imports torch, which watch's flags must not); it
    must still name every kind the registry holds."""
    from dflash_doctor.cli.options import DraftKind
    from dflash_doctor.models.draft_kinds import kind_names

    help_text = DraftKind.__metadata__[0].help
    assert all(name in help_text for name in kind_names()), help_text


# A config file may not grant remote code: the doctor.toml or pyproject.toml of whatever folder the tool runs in
# (a cloned repository, a pull request's checkout) would otherwise make a model's own Python run with no flag.
_REMOTE_CODE_FILES = [
    ("doctor.toml", "trust_remote_code = true\n"),
    ("doctor.toml", "trust-remote-code = true\n"),
    ("pyproject.toml", "[tool.dflash-doctor]\ntrust_remote_code = true\n"),
    ("pyproject.toml", '[project]\nname = "x"\n[tool.dflash-doctor]\ndtype = "float32"\ntrust-remote-code = true\n'),
    ("user", "trust_remote_code = true\n"),
    ("explicit", "trust_remote_code = true\n"),
]


@pytest.mark.parametrize(("where", "text"), _REMOTE_CODE_FILES)
def test_a_config_file_cannot_turn_on_remote_code(empty_home, where, text):
    probe, seen = _probe_app()
    args: list[str] = []
    if where == "user":
        folder = empty_home / "user-config" / "dflash-doctor"
        folder.mkdir(parents=True)
        path = folder / "doctor.toml"
    elif where == "explicit":
        path = empty_home / "mine.toml"
        args = ["--config", "mine.toml"]
    else:
        path = empty_home / where
    path.write_text(text)
    for extra in ([], ["--trust-remote-code"]):  # refused even with the flag: the file's key must go
        result = CliRunner().invoke(probe, args + extra)
        assert result.exit_code == 2, result.output
        assert not seen
        # the error panel wraps at the terminal's width and may fold a long path anywhere: compare without the
        # panel's frame and without white space
        message = re.sub(r"[│╭╮╰╯─\s]", "", result.output)
        assert "--trust-remote-code" in message and path.name in message, result.output
        assert "Traceback" not in result.output
