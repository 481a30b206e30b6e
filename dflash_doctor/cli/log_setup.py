"""``-v`` / ``-q``: one ``logging`` setup for the tool and the libraries it drives.

transformers and huggingface_hub print warnings through handlers of their own and draw tqdm bars; both
would land in the middle of the tool's tables and progress bars. Here their loggers propagate to one
Rich handler on stderr, and their level and bars follow the tool's verbosity:

=========  ======================  =============================================  =====================
verbosity  dflash_doctor's logger  transformers, huggingface_hub, Python warnings  their tqdm bars
=========  ======================  =============================================  =====================
-q         errors                  errors                                          off (ours off too)
default    warnings                errors                                          off
-v         info                    warnings                                        on
-vv        debug                   debug                                           on
=========  ======================  =============================================  =====================
"""

from __future__ import annotations

import logging
import os
import sys

from rich.console import Console
from rich.logging import RichHandler

OURS = "dflash_doctor"
# Loggers of the libraries the tool drives; every other logger stays at the root's level (theirs).
LIBRARIES = ("transformers", "huggingface_hub", "accelerate", "torch", "py.warnings")

_HANDLER = RichHandler(
    console=Console(stderr=True), show_time=False, show_path=False, markup=False, rich_tracebacks=False
)


def configure_logging(verbosity: int) -> None:
    """Set up logging for ``verbosity``: -1 for -q, 0 by default, 1 for -v, 2 or more for -vv."""
    ours = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    theirs = logging.ERROR if verbosity < 1 else logging.WARNING if verbosity == 1 else logging.DEBUG
    root = logging.getLogger()
    if _HANDLER not in root.handlers:
        root.addHandler(_HANDLER)
    root.setLevel(theirs)
    logging.getLogger(OURS).setLevel(ours)
    logging.captureWarnings(True)  # warnings.warn(...) of torch, transformers ... -> the "py.warnings" logger
    for name in LIBRARIES:
        library = logging.getLogger(name)
        library.setLevel(theirs)
        if name == "huggingface_hub":  # its own stderr handler would print every record a second time
            library.handlers.clear()
            library.propagate = True
    # The libraries are imported by the commands that need them, after this runs (a monitoring install has
    # none of them): their import-time settings come from the environment; a library already imported (a
    # test's process) is set directly.
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = (
        "0" if verbosity >= 1 else "1"
    )  # read by huggingface_hub and transformers
    os.environ["TRANSFORMERS_VERBOSITY"] = logging.getLevelName(theirs).lower()
    transformers_logging = sys.modules.get("transformers.utils.logging")
    if transformers_logging is not None:
        _route_transformers(transformers_logging, verbosity)
    hub_utils = sys.modules.get("huggingface_hub.utils")
    if hub_utils is not None:
        (hub_utils.enable_progress_bars if verbosity >= 1 else hub_utils.disable_progress_bars)()


def _route_transformers(transformers_logging, verbosity: int) -> None:
    """transformers' own stderr handler off, its records to ours, its bars following ``verbosity``."""
    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    (transformers_logging.enable_progress_bar if verbosity >= 1 else transformers_logging.disable_progress_bar)()


def progress_shown() -> bool:
    """Our own progress bars are drawn unless -q asked for errors only."""
    return logging.getLogger(OURS).isEnabledFor(logging.WARNING)
