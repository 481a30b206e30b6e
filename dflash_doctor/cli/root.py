"""The Typer app every command module registers on (``@app.command``); :mod:`dflash_doctor.cli` imports
the command modules, in --help order, and runs it. A module of its own so the commands import it without
importing the package that imports them.
"""

from __future__ import annotations

import typer

from dflash_doctor import __version__
from dflash_doctor.cli.logs import configure_logging
from dflash_doctor.errors import UsageError

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


@app.callback(epilog="Example: dflash-doctor -v check --target ./target --draft ./draft --json > result.json")
def _tool_options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the installed version and exit."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, show_default=False,
                                help="More on stderr: -v info and the warnings and download bars of transformers and "
                                     "huggingface_hub (hidden by default), -vv debug."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Errors only: no progress bars, no warnings."),
) -> None:
    """Diagnose why a speculative draft (DFlash or autoregressive) is rejected, and what to do about it."""
    if verbose and quiet:
        raise UsageError("-v and -q ask for opposite things; pass one of them.")
    configure_logging(-1 if quiet else verbose)
