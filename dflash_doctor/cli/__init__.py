"""The ``dflash-doctor`` command line.

One Typer app; each command lives in its own module under ``dflash_doctor/cli/`` and registers itself
on :data:`app` when imported below. Shared flags are declared once in :mod:`dflash_doctor.cli.options`.
User mistakes raise :class:`dflash_doctor.errors.UsageError` (one sentence, exit 2).
"""

from __future__ import annotations

import typer

from dflash_doctor import __version__

app = typer.Typer(
    name="dflash-doctor",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Plain click errors: Typer's rich error panel cuts a long first word (a path) with an ellipsis and
    # can hide the rest of the sentence, which is where the fix is.
    rich_markup_mode=None,
    add_completion=False,
)


def _print_version(asked: bool) -> None:
    """Print ``dflash-doctor VERSION`` and stop before any command runs (eager, like ``pip --version``)."""
    if asked:
        typer.echo(f"dflash-doctor {__version__}")
        raise typer.Exit()


@app.callback()
def _tool_options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the installed version and exit."),
) -> None:
    """Diagnose why a speculative draft (DFlash or autoregressive) is rejected, and what to do about it."""


# Each module registers its command(s) on `app`; the import order is the order in --help.
from dflash_doctor.cli import check, replay, sweep  # noqa: E402,F401
from dflash_doctor.cli import train_draft  # noqa: E402,F401
from dflash_doctor.cli import single_checks  # noqa: E402,F401
from dflash_doctor.cli import compare, report  # noqa: E402,F401
from dflash_doctor.cli import workloads  # noqa: E402,F401
from dflash_doctor.cli import dashboard  # noqa: E402,F401
from dflash_doctor.cli import watch  # noqa: E402,F401


def main() -> None:
    """Console-script entry point."""
    app()
