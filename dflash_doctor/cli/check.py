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
    from dflash_doctor import pipeline, scenarios
    from dflash_doctor.checks.base import exit_code, get_check
    from dflash_doctor.cli.progress import progress_bar
    from dflash_doctor.report.terminal import print_check_results, print_class_summary, print_sweep

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
        outcome = pipeline.run_check(cfg, scenario=chosen, only=only_ids, skip=skip_ids, exact_blocks=exact_blocks,
                                     progress=progress_bar(console))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: finished requests are kept in the run directory")
        raise typer.Exit(130)
    record = outcome.record
    print_class_summary(record, max(record.config["k"]), out_console)
    print_sweep(record, out_console)
    print_check_results(record.checks, out_console)
    out_console.print(f"run directory and reports: {outcome.run_dir} (report.html, report.md, report.json, junit.xml)")
    code = exit_code(record.checks, cfg.fail_on)
    if code:
        raise typer.Exit(code)
