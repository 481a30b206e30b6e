"""Errors the user can fix.

Every problem caused by the user's input (a missing model, a malformed workload line, an impossible K)
is raised as :class:`UsageError` carrying ONE sentence that names the input and the fix. It is a
``click.ClickException`` so the CLI (and Typer's test runner) prints ``Error: <sentence>`` on stderr and
exits 2, never with a traceback. Everything else is a bug and is allowed to surface as one.
"""

import click


class UsageError(click.ClickException):
    """Bad input from the user: the message names the input and the fix; the CLI exits 2."""

    exit_code = 2
