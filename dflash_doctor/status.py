"""The one status vocabulary and the one verdict rule.

A check ends in one :class:`Status`; a run's verdict is :func:`overall_status` of its checks. The CLI
exit code, report.json / .md / .html / junit, the terminal and the dashboard all rank statuses through
this module, so one run never shows two verdicts. It has no dependencies, so light views (reports,
the dashboard) can import it without loading the checks.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Iterable


class Status(StrEnum):
    """A check's outcome, declared in the order reports list status counts (pass, warn, fail, skip, error).

    :data:`STATUS_RANK` is the one order views sort and rank by, worst first. ``error`` (the check crashed) ranks just below ``fail``: a setup nobody could verify is not
    healthy. ``skip`` (inputs absent) never decides a verdict. ``VERDICT_NONE`` is not a check status; it
    is the verdict of a run that recorded no decided check (replay and sweep runs have none).
    """

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"


STATUSES = tuple(s.value for s in Status)
STATUS_RANK = (Status.FAIL, Status.ERROR, Status.WARN, Status.PASS, Status.SKIP)  # worst first
DECIDED = STATUS_RANK[:4]  # skip never decides a verdict
VERDICT_NONE = "none"


def overall_status(statuses: Iterable[str]) -> str:
    """The ONE verdict of a run: the worst decided status (fail > error > warn > pass), ``"none"`` when
    no check decided anything. The exit code, every report format, the terminal and the dashboard
    all call this; nothing else ranks statuses."""
    present = set(statuses)
    for status in DECIDED:
        if status in present:
            return status.value
    return VERDICT_NONE


def status_counts(statuses: Iterable[str]) -> dict[str, int]:
    """How many checks ended in each status, in :class:`Status` order (every status present, zeros included)."""
    statuses = list(statuses)
    return {status: statuses.count(status) for status in STATUSES}
