"""`dflash-doctor sweep`: acceptance and net speedup for every K per class, and the K to serve."""

from __future__ import annotations

import typer
from rich.console import Console

from dflash_doctor.cli import options as opt
from dflash_doctor.cli.root import app
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.report.terminal import print_sweep


@app.command(epilog="Example: dflash-doctor sweep --target ./target --draft ./draft --k 1-8 --max-requests 40")
@opt.config_command(*opt.REPLAY_FLAGS, "devices", "cost_profile", "timing_budget_s", "strict_classes")
def sweep(config: DoctorConfig, exact_blocks: opt.ExactBlocks = False) -> None:
    """Teacher-forced replay answering every K at once (default K
    = 1..block-1 or 1-8), net speedup per class, recommended K."""
    # imported here, not above: they import torch, which `sweep --help` must not
    from dflash_doctor import pipeline
    from dflash_doctor.cli.progress import run_with_progress
    from dflash_doctor.replay import sharding

    if (code := sharding.launch_ranks(config, "sweep")) is not None:
        raise typer.Exit(code)
    outcome = run_with_progress(
        lambda progress: pipeline.run_sweep(config, exact_blocks=exact_blocks, progress=progress)
    )
    print_sweep(outcome.record, Console())
    Console(stderr=True).print(f"wrote {outcome.run_dir}")
