"""The ``dflash-doctor`` command line.

One Typer app; each command lives in its own module under ``dflash_doctor/cli/`` and registers itself
on :data:`~dflash_doctor.cli.root.app` when imported below. Shared flags are declared once in :mod:`dflash_doctor.cli.options`.
User mistakes raise :class:`dflash_doctor.errors.UsageError` (one sentence, exit 2).
"""

from __future__ import annotations

from dflash_doctor.cli.root import app

# Each module registers its command(s) on `app`; the import order is the order in --help.
from dflash_doctor.cli import check, replay, sweep  # noqa: E402,F401
from dflash_doctor.cli import train_draft  # noqa: E402,F401
from dflash_doctor.cli import single_checks  # noqa: E402,F401
from dflash_doctor.cli import compare, report  # noqa: E402,F401
from dflash_doctor.cli import workloads  # noqa: E402,F401
from dflash_doctor.cli import dashboard  # noqa: E402,F401
from dflash_doctor.cli import watch  # noqa: E402,F401
from dflash_doctor.cli import tune  # noqa: E402,F401


def main() -> None:
    """Console-script entry point."""
    app()
