"""`dflash-doctor --help` wall time: as shipped (each command's module loaded when it runs) against every
command module imported up front (what the CLI did before; the model commands' modules import torch).

Each variant runs ``--runs`` times in a fresh interpreter; prints the median seconds and the ratio, and
whether torch was imported. Not a test, nothing asserts.

    python benchmarks/cli_help.py [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from dflash_doctor.cli.root import COMMANDS

SHIPPED = (
    "import sys\nfrom dflash_doctor.cli import main\nsys.argv[0] = 'dflash-doctor'\ntry:\n    "
    "main()\nfinally:\n    print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n"
)
EAGER = "".join(f"import {module}\n" for module in dict.fromkeys(m for m, _ in COMMANDS.values())) + SHIPPED


def timed(code: str, runs: int) -> tuple[float, str]:
    seconds, note = [], ""
    for _ in range(runs):
        started = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, check=True)
        seconds.append(time.perf_counter() - started)
        note = result.stderr.strip().splitlines()[-1]
    return statistics.median(seconds), note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    shipped, shipped_note = timed(SHIPPED, args.runs)
    eager, eager_note = timed(EAGER, args.runs)
    print(f"dflash-doctor --help, median of {args.runs} runs")
    print(f"  commands on demand         {shipped:6.2f} s  ({shipped_note})")
    print(f"  every command imported     {eager:6.2f} s  ({eager_note})")
    print(f"  ratio                      {eager / shipped:6.1f}x")


if __name__ == "__main__":
    sys.exit(main())
