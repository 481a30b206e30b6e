"""`dflash-doctor replay`: run only the engine (the live speculative loop) and write a run directory."""

from __future__ import annotations

from rich.console import Console

from dflash_doctor import pipeline
from dflash_doctor.cli import options as opt
from dflash_doctor.cli.progress import run_with_progress
from dflash_doctor.cli.root import app
from dflash_doctor.inputs.config import build_config


@app.command()
def replay(
    target: opt.Target = None,
    draft: opt.Draft = None,
    draft_kind: opt.DraftKind = None,
    workload: opt.Workload = None,
    classes: opt.Classes = None,
    max_requests: opt.MaxRequests = None,
    max_new_tokens: opt.MaxNewTokens = None,
    temperature: opt.Temperature = None,
    k: opt.K = None,
    device: opt.Device = None,
    dtype: opt.Dtype = None,
    out: opt.Out = None,
    overwrite: opt.Overwrite = False,
    config: opt.ConfigFile = None,
    seed: opt.Seed = None,
    chat_template: opt.ChatTemplate = None,
    trust_remote_code: opt.TrustRemoteCode = False,
    end_of_request: opt.EndOfRequest = None,
) -> None:
    """Replay prompts through the live speculative loop (K = the largest --k) and write a run directory."""
    cfg = build_config(config, **opt.config_values(locals()))
    outcome = run_with_progress(lambda progress: pipeline.run_replay(cfg, progress=progress))
    console = Console(stderr=True)
    overall = outcome.record.summary.overall
    tau = overall.mean_acceptance_length if overall is not None and overall.mean_acceptance_length is not None else float("nan")
    console.print(
        f"wrote {outcome.run_dir}  tau {tau:.2f} over {overall.num_drafts if overall else 0} drafts, "
        f"{overall.num_requests if overall else 0} requests"
    )
