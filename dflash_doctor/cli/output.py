"""`--json`: one JSON object on stdout, the only thing a command prints there when asked for it.

Keys are sorted and NaN is written as null (as in report.json), so the output diffs cleanly and every
JSON reader parses it; the keys of each command are listed in docs/user-guide.md "Machine-readable output".
"""

from __future__ import annotations

import json
import sys
from typing import Any

from dflash_doctor.rundir.writer import json_safe


def print_json(payload: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(json_safe(payload), indent=2, sort_keys=True) + "\n")
    sys.stdout.flush()
