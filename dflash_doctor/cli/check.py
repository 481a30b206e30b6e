"""`dflash-doctor check`: static checks + teacher-forced replay of every K + probes + verdicts and reports."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from dflash_doctor import pipeline
from dflash_doctor.checks.base import exit_code, get_check
from dflash_doctor.cli import options as opt
from dflash_doctor.cli.progress import run_with_progress
from dflash_doctor.cli.root import app
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.config import build_config
from dflash_doctor.replay import scenarios, sharding
from dflash_doctor.serving.http import secret
from dflash_doctor.report.terminal import print_check_results, print_class_summary, print_engine_comparison, print_sweep, print_why_rejected

Scenario = Annotated[Optional[str], typer.Option("--scenario", help="Reproduce a real failure on the demo pair; `--scenario list` names them.")]
Only = Annotated[Optional[str], typer.Option("--only", help="Comma-separated check ids to run (default: all).")]
Skip = Annotated[Optional[str], typer.Option("--skip", help="Comma-separated check ids to leave out.")]
EngineUrl = Annotated[Optional[str], typer.Option("--engine", help="URL of a running OpenAI-compatible server (vLLM, SGLang, llama.cpp): measure acceptance there; with --target/--draft also replay locally and compare (engine-agreement).")]
EngineModel = Annotated[Optional[str], typer.Option("--engine-model", help="Model name on the --engine server (default: its only model).")]
EngineConcurrency = Annotated[Optional[int], typer.Option("--engine-concurrency", help="Requests in flight at once against --engine (default 4).")]
EngineTimeout = Annotated[Optional[float], typer.Option("--engine-timeout", help="Per-request timeout in seconds against --engine (default 300).")]
EngineApiKey = Annotated[Optional[str], typer.Option("--engine-api-key", envvar="OPENAI_API_KEY", show_envvar=True,
                                                     help="API key of the --engine server (sent as a bearer token); env:VAR reads it from the environment. Never written to the run directory.")]
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
    devices: opt.Devices = None,
    dtype: opt.Dtype = None,
    out: opt.Out = None,
    overwrite: opt.Overwrite = False,
    config: opt.ConfigFile = None,
    seed: opt.Seed = None,
    fail_on: opt.FailOn = None,
    chat_template: opt.ChatTemplate = None,
    cost_profile: opt.CostProfile = None,
    strict_classes: opt.StrictClasses = None,
    engine_config: EngineConfig = None,
    engine: EngineUrl = None,
    engine_model: EngineModel = None,
    engine_concurrency: EngineConcurrency = None,
    engine_timeout: EngineTimeout = None,
    engine_api_key: EngineApiKey = None,
    scenario: Scenario = None,
    only: Only = None,
    skip: Skip = None,
    exact_blocks: opt.ExactBlocks = False,
    trust_remote_code: opt.TrustRemoteCode = False,
    end_of_request: opt.EndOfRequest = None,
    plotly: opt.Plotly = None,
) -> None:
    """Is the pair set up right, where does the draft lose, which K to serve? Exit 0 pass/warn, 1 a check failed, 2 bad input.

    With no model flags it runs the built-in demo pair (SmolLM2-135M-Instruct + its DFlash draft) on CPU.
    """
    out_console = Console()
    if scenario == "list":
        table = Table(title="Failure scenarios (dflash-doctor check --scenario NAME)")
        for column in ("name", "reproduces", "named by check"):
            table.add_column(column)
        for item in scenarios.SCENARIOS.values():
            table.add_row(item.name, item.incident, ", ".join(item.expect))
        out_console.print(table)
        return
    cfg = build_config(config, engine_timeout_s=engine_timeout, **opt.config_values(locals()))
    chosen = None
    if scenario is not None:
        chosen = scenarios.get_scenario(scenario)
        scenarios.check_demo_pair(cfg)
    only_ids, skip_ids = _ids(only), _ids(skip)
    for check_id in only_ids + skip_ids:
        get_check(check_id)  # an unknown id fails now, with "did you mean", before any model work
    if cfg.engine is not None and cfg.devices:
        raise UsageError("--devices spreads the local replay over processes, --engine measures a server; drop one of them.")
    if cfg.engine is not None and scenario is not None:
        raise UsageError("--scenario reproduces failures on the embedded demo pair; drop it or drop --engine.")
    api_key = secret(engine_api_key, "--engine-api-key") if engine_api_key else None
    if (code := sharding.launch_ranks(cfg)) is not None:
        raise typer.Exit(code)
    if cfg.engine is not None:
        outcome = run_with_progress(lambda progress: pipeline.run_engine_check(cfg, only=only_ids, skip=skip_ids, progress=progress, api_key=api_key))
    else:
        outcome = run_with_progress(lambda progress: pipeline.run_check(cfg, scenario=chosen, only=only_ids, skip=skip_ids,
                                                                        exact_blocks=exact_blocks, progress=progress))
    record = outcome.record
    if cfg.engine is not None:
        print_class_summary(record, record.source.details.get("num_spec_tokens") or 0, out_console)
        print_engine_comparison(record, out_console)
    else:
        print_class_summary(record, max(record.config["k"]), out_console)
        print_sweep(record, out_console)
        print_why_rejected(outcome.why_rejected, out_console)
    print_check_results(record.checks, out_console)
    out_console.print(f"run directory and reports: {outcome.run_dir} (report.html, report.md, report.json, junit.xml)")
    code = exit_code(record.checks, cfg.fail_on)
    if code:
        raise typer.Exit(code)
