"""The ``dflash-doctor`` command line.

One Typer app; each command lives in its own module under ``dflash_doctor/cli/`` and registers itself
on :data:`~dflash_doctor.cli.root.app` when imported. The root group imports a command's module only when
that command runs (:data:`~dflash_doctor.cli.root.COMMANDS`), so ``--help`` and the monitoring commands
load no model stack. Shared flags are declared once in :mod:`dflash_doctor.cli.options`.
User mistakes raise :class:`dflash_doctor.errors.UsageError` (one sentence, exit 2).
"""

from __future__ import annotations

from dflash_doctor.cli.root import app


def main() -> None:
    """Console-script entry point."""
    app()
