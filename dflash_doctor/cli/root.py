"""The Typer app every command module registers on (``@app.command``), and the root group that loads those
modules. A module of its own so the commands import it without importing the package that runs it.

A command's module is imported only when that command runs or shows its own --help: the replaying,
checking and training commands import torch and transformers (seconds, and a monitoring install has
neither), the others pandas and pyarrow. ``dflash-doctor --help`` lists every command from
:data:`COMMANDS` (tests/test_light_install.py holds each summary equal to its command's docstring), so it
imports none of them, and ``watch``, ``compare``, ``report`` and the dashboard never import torch.
"""

from __future__ import annotations

import errno
import importlib
import os
import select
import sys
import traceback
from typing import NoReturn

import click
import typer
from typer.core import TyperGroup
from typer.main import get_command_from_info, get_command_name, get_group_from_info

from dflash_doctor import __version__
from dflash_doctor.cli.log_setup import configure_logging
from dflash_doctor.errors import UsageError
from dflash_doctor.processes import EXIT_CRASH, exit_code_of, stop_signals_raise

# what the CLI layer itself raises to end a command with a code or a message: never a crash
_ENDINGS: tuple[type[BaseException], ...] = tuple(
    {
        typer.Exit,
        typer.Abort,
        click.exceptions.Exit,
        click.exceptions.Abort,
        click.ClickException,
        *(base for base in typer.BadParameter.__mro__ if base.__name__ == "ClickException"),
    }
)

# command -> (its module, the first line of its docstring or its group's help), in --help order
COMMANDS: dict[str, tuple[str, str]] = {
    "check": (
        "dflash_doctor.cli.check",
        "Is the pair set up right, where does the draft lose, which "
        "K to serve? Exit 0 pass/warn, 1 fail or error, 2 bad input.",
    ),
    "replay": (
        "dflash_doctor.cli.replay",
        "Replay prompts through the live speculative loop (K = the largest --k) and write a run directory.",
    ),
    "sweep": (
        "dflash_doctor.cli.sweep",
        "Teacher-forced replay answering every K at once (default K "
        "= 1..block-1 or 1-8), net speedup per class, recommended K.",
    ),
    "train-draft": (
        "dflash_doctor.cli.train_draft",
        "Train or fine-tune a DFlash draft or an EAGLE-3 head "
        "against a target; writes the checkpoint and a model card.",
    ),
    "tokenizers": (
        "dflash_doctor.cli.single_checks",
        "Compare two tokenizers: ids over the whole vocabulary, special tokens, pipeline, corpus round-trip.",
    ),
    "templates": (
        "dflash_doctor.cli.single_checks",
        "Render canonical conversations with both chat templates and show the first differing bytes.",
    ),
    "env": (
        "dflash_doctor.cli.single_checks",
        "Show versions and hardware, and check them (and --engine-config) against known incompatibilities.",
    ),
    "compare": (
        "dflash_doctor.cli.compare",
        "Per-class regression gate: exit 1 when tau or a per-position rate drops past its threshold "
        "with separated 95% intervals; exit 2 when a run has no drafted steps (nothing to compare).",
    ),
    "report": (
        "dflash_doctor.cli.report",
        "Re-render a run as report.html, report.md, report.json and junit.xml (no model is loaded).",
    ),
    "dashboard": (
        "dflash_doctor.cli.dashboard",
        "Launch the interactive dashboard: rejection by class, positions, tokens, sweep and run comparison.",
    ),
    "watch": (
        "dflash_doctor.cli.watch",
        "Watch production acceptance: windowed tau per model/class, alerts vs a baseline, fallback advice.",
    ),
    "tune": (
        "dflash_doctor.cli.tune",
        "Measure K = 0 (off) and each K on your engine per class and load; "
        "fit its step costs, predict the rest, recommend its setting.",
    ),
    "workloads": (
        "dflash_doctor.cli.workloads",
        "List the built-in prompt sets with counts per class; `show NAME` prints a few requests.",
    ),
}


def registered_command_name(info: typer.models.CommandInfo) -> str:
    """The name Typer gives a registered command (its own, or the function's with dashes)."""
    return info.name or get_command_name(info.callback.__name__ if info.callback else "")


#: OSError numbers that say the machine's storage, not the doctor, failed: exit 2 with a sentence, not a crash
#: (70 asks a supervisor to restart, into the same full disk).
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def _crash() -> NoReturn:
    """An unexpected exception (a bug): its traceback and exit :data:`EXIT_CRASH`."""
    traceback.print_exc(file=sys.stderr)
    typer.echo(
        f"dflash-doctor crashed (an internal error, not your input): exit {EXIT_CRASH}; "
        "please report it with the traceback above.",
        err=True,
    )
    raise typer.Exit(EXIT_CRASH) from None


def _stdout_is_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone: poll reports an error on such a write end (Linux, the
    BSDs, macOS); False where it cannot tell (no file descriptor, no poll), so the error stays a crash."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
        return False


def _stdout_closed() -> NoReturn:
    """The reader of stdout went away (``| head -1``): end quietly with 0, as ``head`` users expect. Python's
    recipe (docs of the signal module, "Note on SIGPIPE"): stdout goes to devnull, so the interpreter's
    last flush of what is still buffered cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise typer.Exit(0) from None


class _CommandsOnDemand(TyperGroup):
    """The root group: each of :data:`COMMANDS` is imported when asked for, and listed by its summary.

    It also keeps the exit codes a contract (:mod:`dflash_doctor.processes`): while a command runs, SIGTERM
    and SIGHUP raise an interrupt as Ctrl-C does, so the command's cleanup runs (a launched server is
    stopped), and the command ends with 128 + the signal; an unexpected exception (a bug) prints its
    traceback and exits :data:`~dflash_doctor.processes.EXIT_CRASH` (70), never 1, which is a finding (a
    failed check, an alert), nor 2, which is bad input. A full disk or a read-only file system
    (:data:`ENVIRONMENT_ERRNOS`) is the user's environment: exit 2 with its own sentence. A closed stdout
    ends the command quietly with 0.
    """

    def invoke(self, ctx):
        with stop_signals_raise():
            try:
                return super().invoke(ctx)
            except _ENDINGS:
                raise
            except KeyboardInterrupt as exc:
                code = exit_code_of(exc)
                typer.echo(f"dflash-doctor: interrupted ({exc or 'SIGINT'}); exit {code}", err=True)
                raise typer.Exit(code) from None
            except SystemExit as exc:
                if isinstance(exc.__context__, BrokenPipeError):  # rich's Console exits 1 on a closed stdout
                    _stdout_closed()
                raise
            except OSError as exc:
                if isinstance(exc, BrokenPipeError) and _stdout_is_closed():  # not a server's socket closing
                    _stdout_closed()
                if exc.errno not in ENVIRONMENT_ERRNOS:
                    _crash()
                raise UsageError(
                    f"writing {exc.filename or 'the output'} failed ({exc.strerror}: the disk or quota is "
                    f"full, or the file system is read-only); free space or pass --out a folder on "
                    f"another disk."
                ) from None
            except Exception:
                _crash()

    def list_commands(self, ctx) -> list[str]:
        return [*COMMANDS, *(name for name in super().list_commands(ctx) if name not in COMMANDS)]

    def get_command(self, ctx, cmd_name: str):
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            importlib.import_module(COMMANDS[cmd_name][0])  # registers its command(s) on `app`
            for info in app.registered_commands:
                if registered_command_name(info) == cmd_name:
                    self.commands[cmd_name] = get_command_from_info(
                        info,
                        pretty_exceptions_short=app.pretty_exceptions_short,
                        rich_markup_mode=self.rich_markup_mode,
                    )
            for group in app.registered_groups:
                if group.name == cmd_name:
                    self.commands[cmd_name] = get_group_from_info(
                        group,
                        pretty_exceptions_short=app.pretty_exceptions_short,
                        suggest_commands=True,
                        rich_markup_mode=self.rich_markup_mode,
                    )
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx, formatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.commands.get(name) or click.Command(name, help=COMMANDS[name][1])
            if (
                not command.hidden
            ):  # the whole summary, wrapped by write_dl at the terminal's width: never cut with "..."
                rows.append((name, command.get_short_help_str(limit=sys.maxsize)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


app = typer.Typer(
    name="dflash-doctor",
    cls=_CommandsOnDemand,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Plain click errors: Typer's rich error panel cuts a long first word (a path) with an ellipsis and
    # can hide the rest of the sentence, which is where the fix is.
    rich_markup_mode=None,
    add_completion=True,
    # click lays help out at most 80 columns wide (and cut summaries near 45 characters): the terminal's width instead
    context_settings={"max_content_width": 240},
)


def _print_version(asked: bool) -> None:
    """Print ``dflash-doctor VERSION`` and stop before any command runs (eager, like ``pip --version``)."""
    if asked:
        typer.echo(f"dflash-doctor {__version__}")
        raise typer.Exit()


@app.callback(
    epilog="Example: dflash-doctor -v check --target ./target --draft ./draft --json > result.json\n\n"
    "Exit codes (every command): 0 done, 1 a finding (failed check, regression, alert), 2 bad input, "
    f"{EXIT_CRASH} a crash (a bug: restart or report it), 128+N ended by signal N (130 Ctrl-C, 143 SIGTERM)."
)
def _tool_options(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the installed version and exit."
    ),
    verbose: int = typer.Option(
        0,
        "--verbose",
        "-v",
        count=True,
        show_default=False,
        help="More on stderr: -v info and the warnings and download bars of transformers and "
        "huggingface_hub (hidden by default), -vv debug.",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Errors only: no progress bars, no warnings."),
) -> None:
    """Diagnose why a speculator is rejected and what to do about it: a DFlash draft (dflash), an EAGLE-3 head (eagle3),
    a target's own MTP head (mtp), n-gram prompt lookup (ngram), suffix decoding (suffix) or an autoregressive draft
    model (autoregressive); several of them head to head on the same prompts (check --draft A --draft B)."""
    if verbose and quiet:
        raise UsageError("-v and -q ask for opposite things; pass one of them.")
    configure_logging(-1 if quiet else verbose)
