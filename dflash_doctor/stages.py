"""Long steps without a natural count (loading a model, converting a GGUF file, pricing the sweep)
announce themselves, so a front end can show that the tool is busy and with what, while the layers
that do the work know nothing of the terminal.

A step runs inside ``with stage("loading the target"):``; :func:`on_stage` lets the CLI (cli/progress.py)
open its indicator for the duration. Stages nest (a GGUF conversion happens while loading the target).
Every stage is also an INFO log line, so ``-v`` lists the steps in a non-interactive log.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Callable, Iterator

StageListener = Callable[[str], AbstractContextManager[object]]

_log = logging.getLogger(__name__)
_listeners: list[StageListener] = []


@contextmanager
def stage(description: str) -> Iterator[None]:
    """Run the body as one named step: logged, and shown by every listener while it runs."""
    _log.info(description)
    with ExitStack() as shown:
        for listener in list(_listeners):
            shown.enter_context(listener(description))
        yield


@contextmanager
def on_stage(listener: StageListener) -> Iterator[None]:
    """Call ``listener(description)`` (a context manager) around every stage entered in the body."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)
