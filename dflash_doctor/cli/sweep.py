"""`dflash-doctor sweep`: acceptance and net speedup for every K per class, and the K to serve."""

from __future__ import annotations

import typer
from rich.console import Console

from dflash_doctor import pipeline
from dflash_doctor.cli import options as opt
from dflash_doctor.cli.progress import run_with_progress
from dflash_doctor.cli.root import app
from dflash_doctor.inputs.config import build_config
from dflash_doctor.replay import sharding
from dflash_doctor.report.terminal import print_sweep


@app.command()
def sweep(
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
    devices: opt.Devices = None,
    dtype: opt.Dtype = None,
    out: opt.Out = None,
    overwrite: opt.Overwrite = False,
    config: opt.ConfigFile = None,
    seed: opt.Seed = None,
    chat_template: opt.ChatTemplate = None,
    cost_profile: opt.CostProfile = None,
    strict_classes: opt.StrictClasses = None,
    exact_blocks: opt.ExactBlocks = False,
    trust_remote_code: opt.TrustRemoteCode = False,
    end_of_request: opt.EndOfRequest = None,
) -> None:
    """Teacher-forced replay answering every K at once (default K = 1..block-1 or 1-8), net speedup per class, recommended K."""
    cfg = build_config(config, **opt.config_values(locals()))
    if (code := sharding.launch_ranks(cfg)) is not None:
        raise typer.Exit(code)
    outcome = run_with_progress(lambda progress: pipeline.run_sweep(cfg, exact_blocks=exact_blocks, progress=progress))
    print_sweep(outcome.record, Console())
    Console(stderr=True).print(f"wrote {outcome.run_dir}")
