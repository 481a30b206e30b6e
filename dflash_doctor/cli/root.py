"""The Typer app every command module registers on (``@app.command``); :mod:`dflash_doctor.cli` imports
the command modules, in --help order, and runs it. A module of its own so the commands import it without
importing the package that imports them.
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
    add_completion=True,
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
