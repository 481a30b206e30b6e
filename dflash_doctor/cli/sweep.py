"""`dflash-doctor sweep`: acceptance and net speedup for every K per class, and the K to serve."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from dflash_doctor.cli import app
from dflash_doctor.cli import options as opt
from dflash_doctor.config import build_config


def print_sweep(meta: dict, console: Console) -> None:
    """Per-class table: tau and speedup at each K, then the recommended K with its reason."""
    sweep = meta["summary"].get("sweep") or {}
    rows_by_group = {"overall": sweep.get("overall", []), **sweep.get("by_class", {})}
    table = Table(title="K sweep: tau (bonus included) / net speedup", show_lines=False)
    table.add_column("K", justify="right")
    for group in rows_by_group:
        table.add_column(group, justify="right")
    ks = [row["k"] for row in sweep.get("overall", [])]
    for index, k in enumerate(ks):
        cells = []
        for rows in rows_by_group.values():
            row = next((r for r in rows if r["k"] == k), None)
            if row is None or row.get("mean_acceptance_length") is None:
                cells.append("-")
                continue
            speedup = row.get("speedup")
            mark = "" if row.get("estimate") == "exact" else "~"
            cells.append(f"{mark}{row['mean_acceptance_length']:.2f} / {speedup:.2f}x" if speedup is not None else f"{row['mean_acceptance_length']:.2f}")
        table.add_row(str(k), *cells)
    console.print(table)
    if any(row.get("estimate") != "exact" for row in sweep.get("overall", [])):
        console.print("~ = estimated from the largest block (block drafter); --exact-blocks runs each K.")
    rec = meta.get("recommendation") or {}
    rec_table = Table(title="Recommended num_speculative_tokens")
    for column in ("class", "K", "conservative K", "speedup", "why"):
        rec_table.add_column(column)
    for group, item in rec.items():
        speedup = item.get("speedup")
        rec_table.add_row(group, str(item.get("k")), str(item.get("conservative_k")), f"{speedup:.2f}x" if speedup else "-", item.get("reason", ""))
    console.print(rec_table)


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
    dtype: opt.Dtype = None,
    out: opt.Out = None,
    config: opt.ConfigFile = None,
    seed: opt.Seed = None,
    chat_template: opt.ChatTemplate = None,
    cost_profile: opt.CostProfile = None,
    strict_classes: opt.StrictClasses = None,
    exact_blocks: opt.ExactBlocks = False,
    trust_remote_code: opt.TrustRemoteCode = False,
) -> None:
    """Teacher-forced replay answering every K at once (default K = 1..block-1 or 1-8), net speedup per class, recommended K."""
    cfg = build_config(config, **opt.config_values(locals()))
    from dflash_doctor import runner

    console = Console(stderr=True)
    requests = runner.select_requests(cfg)
    engine = runner.load_engine(cfg)
    cfg = runner.default_sweep_range(cfg, engine)
    run_dir = Path(cfg.out) if cfg.out else runner.default_run_dir("sweep")
    meta = runner.start_meta(cfg, engine, "sweep")
    try:
        with runner.ProgressReporter(sum(r.num_turns for r in requests), console) as progress:
            steps_by_k = runner.teacher_replay(engine, requests, cfg, run_dir, meta, progress, exact_blocks=exact_blocks)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted[/]: finished requests are kept in {run_dir}")
        raise typer.Exit(130)
    runner.sweep_summary(engine, cfg, steps_by_k, meta)
    runner.write_run_json(run_dir, meta)
    print_sweep(meta, Console())
    console.print(f"wrote {run_dir}")
