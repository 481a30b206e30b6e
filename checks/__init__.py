"""Diagnostic checks, one file per check, registered by a decorator (see :mod:`dflash_doctor.checks.base`).

Importing this package registers every built-in check; :func:`run_checks` runs them on a
:class:`CheckContext`.
"""

from dflash_doctor.checks.base import (  # noqa: F401
    Check,
    CheckContext,
    CheckResult,
    Finding,
    Need,
    exit_code,
    get_check,
    make_check,
    register,
    registered_ids,
    run_checks,
)
from dflash_doctor.checks import tokenizer_parity  # noqa: E402,F401
from dflash_doctor.checks import chat_template_parity  # noqa: E402,F401
from dflash_doctor.checks import environment  # noqa: E402,F401
from dflash_doctor.checks import draft_config  # noqa: E402,F401
from dflash_doctor.checks import acceptance  # noqa: E402,F401
from dflash_doctor.checks import lossless  # noqa: E402,F401
from dflash_doctor.checks import prompt_format  # noqa: E402,F401
from dflash_doctor.checks import target_identity  # noqa: E402,F401
from dflash_doctor.checks import speculative_k  # noqa: E402,F401
from dflash_doctor.checks import engine_agreement  # noqa: E402,F401
from dflash_doctor.checks import eagle3_config  # noqa: E402,F401
from dflash_doctor.checks import mtp_config  # noqa: E402,F401
from dflash_doctor.checks import timing  # noqa: E402,F401
