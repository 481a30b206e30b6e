"""Errors the user can fix.

Every problem caused by the user's input (a missing model, a malformed workload line, an impossible K)
is raised as :class:`UsageError` carrying ONE sentence that names the input and the fix. The CLI prints
``Error: <sentence>`` on stderr and exits 2, never with a traceback. Everything else is a bug and is
allowed to surface as one.

Typer (0.29+) vendors its own copy of click and only handles *its* ClickException, while code and tests
outside the CLI may catch plain ``click.ClickException``; UsageError is both. Typer's class is taken
from its public ``BadParameter`` (a ClickException), not from the vendored module's private path; on an
older Typer that is click's own class and the two bases are one.
"""

import click
import typer

_TyperClickException = next(base for base in typer.BadParameter.__mro__ if base.__name__ == "ClickException")

_BASES = tuple(dict.fromkeys((_TyperClickException, click.ClickException)))


class UsageError(*_BASES):
    """Bad input from the user: the message names the input and the fix; the CLI exits 2."""

    exit_code = 2
