"""`dflash-doctor check`: static checks + teacher-forced replay of every K + probes + verdicts and reports."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from dflash_doctor.cli import app
from dflash_doctor.cli import options as opt
from dflash_doctor.config import build_config

Scenario = Annotated[Optional[str], typer.Option("--scenario", help="Reproduce a real failure on the demo pair; `--scenario list` names them.")]
Only = Annotated[Optional[str], typer.Option("--only", help="Comma-separated check ids to run (default: all).")]
Skip = Annotated[Optional[str], typer.Option("--skip", help="Comma-separated check ids to leave out.")]
EngineConfig = Annotated[Optional[str], typer.Option("--engine-config", help="vLLM speculative_config JSON or SGLang launch flags to check against the draft.")]


def _ids(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def print_class_summary(meta: dict, console: Console) -> None:
    """tau per class with its interval at the replayed K: the first thing a user wants to see."""
    summary = meta["summary"]
    table = Table(title=f"Acceptance at K = {max(meta['config']['k'])} (tau = mean acceptance length, bonus included)")
    for column in ("class", "requests", "tau", "95% CI", "per-position acceptance (first 5)"):
        table.add_column(column)
    for name, metrics in [("overall", summary["overall"]), *sorted(summary["by_class"].items())]:
        tau = metrics.get("mean_acceptance_length")
        lo, hi = metrics.get("mean_acceptance_length_ci") or (None, None)
        rates = ", ".join(f"{r:.2f}" for r in (metrics.get("acceptance_rate_per_pos") or [])[:5] if r is not None)
        table.add_row(name, str(metrics.get("num_requests", 0)), f"{tau:.2f}" if tau else "-",
                      f"[{lo:.2f}, {hi:.2f}]" if lo is not None else "-", rates)
    console.print(table)


@app.command()
def check(
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
    fail_on: opt.FailOn = None,
    chat_template: opt.ChatTemplate = None,
    cost_profile: opt.CostProfile = None,
    strict_classes: opt.StrictClasses = None,
    engine_config: EngineConfig = None,
    scenario: Scenario = None,
    only: Only = None,
    skip: Skip = None,
    exact_blocks: opt.ExactBlocks = False,
    trust_remote_code: opt.TrustRemoteCode = False,
) -> None:
    """Is the pair set up right, where does the draft lose, which K to serve? Exit 0 pass/warn, 1 a check failed, 2 bad input.

    With no model flags it runs the built-in demo pair (SmolLM2-135M-Instruct + its DFlash draft) on CPU.
    """
    from dflash_doctor import doctor, scenarios
    from dflash_doctor.checks.base import exit_code, get_check
    from dflash_doctor.checks.terminal import print_check_results
    from dflash_doctor.cli.sweep import print_sweep
    from dflash_doctor.cli.why_rejected import print_why_rejected
    from dflash_doctor.deviations import analyze_run
    from dflash_doctor.schema import load_run

    out_console = Console()
    if scenario == "list":
        table = Table(title="Failure scenarios (dflash-doctor check --scenario NAME)")
        for column in ("name", "reproduces", "named by check"):
            table.add_column(column)
        for item in scenarios.SCENARIOS.values():
            table.add_row(item.name, item.incident, ", ".join(item.expect))
        out_console.print(table)
        return
    cfg = build_config(config, **opt.config_values(locals()))
    chosen = None
    if scenario is not None:
        chosen = scenarios.get_scenario(scenario)
        scenarios.check_demo_pair(cfg)
    only_ids, skip_ids = _ids(only), _ids(skip)
    for check_id in only_ids + skip_ids:
        get_check(check_id)  # an unknown id fails now, with "did you mean", before any model work
    console = Console(stderr=True)
    try:
        run_dir, results, meta = doctor.run_doctor(
            cfg, scenario=chosen, only=only_ids, skip=skip_ids, exact_blocks=exact_blocks, console=console
        )
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: finished requests are kept in the run directory")
        raise typer.Exit(130)
    print_class_summary(meta, out_console)
    print_sweep(meta, out_console)
    print_why_rejected(analyze_run(load_run(run_dir)), out_console)
    print_check_results(results, out_console)
    out_console.print(f"run directory and reports: {run_dir} (report.html, report.md, report.json, junit.xml)")
    code = exit_code(results, cfg.fail_on)
    if code:
        raise typer.Exit(code)
