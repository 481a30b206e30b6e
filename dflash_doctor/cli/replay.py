"""`dflash-doctor replay`: run only the engine (the live speculative loop) and write a run directory."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from dflash_doctor.cli import app
from dflash_doctor.cli import options as opt
from dflash_doctor.config import build_config


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
    config: opt.ConfigFile = None,
    seed: opt.Seed = None,
    chat_template: opt.ChatTemplate = None,
    trust_remote_code: opt.TrustRemoteCode = False,
    end_of_request: opt.EndOfRequest = None,
) -> None:
    """Replay prompts through the live speculative loop (K = the largest --k) and write a run directory."""
    cfg = build_config(config, **opt.config_values(locals()))
    from dflash_doctor import runner

    console = Console(stderr=True)
    requests = runner.select_requests(cfg)
    engine = runner.load_engine(cfg)
    run_dir = Path(cfg.out) if cfg.out else runner.default_run_dir("replay")
    meta = runner.start_meta(cfg, engine, "replay")
    turns = sum(r.num_turns for r in requests)
    try:
        with runner.ProgressReporter(turns, console) as progress:
            runner.live_replay(engine, requests, cfg, run_dir, meta, progress)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted[/]: finished requests are kept in {run_dir}")
        raise typer.Exit(130)
    overall = meta["summary"]["overall"]
    console.print(
        f"wrote {run_dir}  tau {overall.get('mean_acceptance_length') or float('nan'):.2f} "
        f"over {overall.get('num_drafts', 0)} drafts, {overall.get('num_requests', 0)} requests"
    )
