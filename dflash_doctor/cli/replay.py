"""`dflash-doctor replay`: run only the engine (the live speculative loop) and write a run directory."""

from __future__ import annotations

from rich.console import Console

from dflash_doctor.cli import options as opt
from dflash_doctor.cli.root import app
from dflash_doctor.inputs.config import DoctorConfig


@app.command(epilog="Example: dflash-doctor replay --target ./target --draft ./draft --k 4 --workload prompts.jsonl")
@opt.config_command(*opt.REPLAY_FLAGS)
def replay(config: DoctorConfig) -> None:
    """Replay prompts through the live speculative loop (K = the largest --k) and write a run directory."""
    # imported here, not above: they import torch, which `replay --help` must not
    from dflash_doctor import pipeline
    from dflash_doctor.cli.progress import run_with_progress

    outcome = run_with_progress(lambda progress: pipeline.run_replay(config, progress=progress))
    console = Console(stderr=True)
    overall = outcome.record.summary.overall
    tau = (
        overall.mean_acceptance_length
        if overall is not None and overall.mean_acceptance_length is not None
        else float("nan")
    )
    console.print(
        f"wrote {outcome.run_dir}  tau {tau:.2f} over {overall.num_drafts if overall else 0} drafts, "
        f"{overall.num_requests if overall else 0} requests"
    )
