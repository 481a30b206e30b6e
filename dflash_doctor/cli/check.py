"""`dflash-doctor check`: static checks + teacher-forced replay of every K + probes + verdicts and reports."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from dflash_doctor.cli import options as opt
from dflash_doctor.cli.root import app
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.cli.output import print_json
from dflash_doctor.serving.http import secret
from dflash_doctor.report.head_to_head import check_verdict, print_head_to_head, sub_run_line
from dflash_doctor.report.sanitize import for_terminal
from dflash_doctor.report.terminal import (
    print_check_results,
    print_class_summary,
    print_server_comparison,
    print_sweep,
    print_why_rejected,
)

if TYPE_CHECKING:
    from dflash_doctor import pipeline

Scenario = Annotated[
    Optional[str],
    typer.Option("--scenario", help="Reproduce a real failure on the demo pair; `--scenario list` names them."),
]
Only = Annotated[Optional[str], typer.Option("--only", help="Comma-separated check ids to run (default: all).")]
Skip = Annotated[Optional[str], typer.Option("--skip", help="Comma-separated check ids to leave out.")]
Drafts = Annotated[
    Optional[list[str]],
    typer.Option(
        "--draft",
        metavar="PATH|ORG/NAME|KIND",
        help="Draft model: local dir, hub id (org/name or org/name@revision), .gguf file, a speculator without weights "
        "(ngram, ngram:prompt_lookup_min=2,prompt_lookup_max=5, suffix, "
        "suffix:suffix_decoding_max_tree_depth=24, mtp: the target's own MTP head), "
        "demo (the built-in DFlash draft) or demo-eagle3 (the built-in "
        "EAGLE-3 head of the same target). Repeat it to compare "
        "speculators head-to-head on the same prompts.",
        show_default="the built-in demo DFlash draft",
        envvar="DFLASH_DOCTOR_DRAFT",
        show_envvar=True,
    ),
]
DEMO_DRAFT = "demo"  # --draft demo: the built-in demo draft, as when no --draft is given
DEMO_EAGLE3 = "demo-eagle3"  # the built-in EAGLE-3 head of the demo target, the other half of the demo's head-to-head


def _heavy_imports():
    """The modules that run a check, imported when it runs: they import torch (seconds), which ``check --help``
    must not (tests/test_help_and_light_lane.py)."""
    from dflash_doctor import pipeline
    from dflash_doctor.checks.base import exit_code, get_check
    from dflash_doctor.cli.progress import run_with_progress
    from dflash_doctor.models.loading import DEMO_EAGLE3_DIR
    from dflash_doctor.replay import scenarios, sharding

    return pipeline, exit_code, get_check, run_with_progress, DEMO_EAGLE3_DIR, scenarios, sharding


def _ids(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


EPILOG = """\b
Examples:
  dflash-doctor check                                       # the built-in demo pair on CPU
  dflash-doctor check --target ./target --draft ./draft --workload prompts.jsonl --json > result.json
  dflash-doctor check --engine http://localhost:8000 --target ./target --draft ./draft

Exit codes: 0 every check passed or warned; 1 a check failed or errored (with --fail-on warn: also a
warning); 2 bad input; 128 + the signal when stopped (130 Ctrl-C, 143 SIGTERM; finished requests are kept)."""


def check_json(outcome: pipeline.Outcome, code: int) -> dict[str, Any]:
    """`check --json`: report.json's keys (written by the pipeline in the run directory) plus where the run
    is and the exit code, so a script needs neither the run directory's name nor a second read."""
    return {
        **json.loads((outcome.run_dir / "report.json").read_text(encoding="utf-8")),
        "run_dir": str(outcome.run_dir),
        "exit_code": code,
    }


@app.command(epilog=EPILOG)
@opt.config_command(
    *(name for name in opt.REPLAY_FLAGS if name != "draft"),
    "devices",
    "fail_on",
    "cost_profile",
    "timing_budget_s",
    "strict_classes",
    "engine_config",
    "engine",
    "engine_model",
    "engine_concurrency",
    "engine_timeout_s",
    "plotly",
    beside={"drafts": "target"},
)
def check(
    config: DoctorConfig,
    scenario: Scenario = None,
    only: Only = None,
    skip: Skip = None,
    exact_blocks: opt.ExactBlocks = False,
    json_output: opt.Json = False,
    engine_api_key: opt.ServerApiKey = None,
    drafts: Drafts = None,
) -> None:
    """Is the pair set up right, where does the draft lose, which
    K to serve? Exit 0 pass/warn, 1 fail or error, 2 bad input.

    With no model flags it runs the built-in demo pair (SmolLM2-135M-Instruct + its DFlash draft) on CPU.
    """
    out_console = Console(stderr=json_output)
    pipeline, exit_code, get_check, run_with_progress, demo_eagle3_dir, scenarios, sharding = _heavy_imports()
    demo_drafts: dict[str, str | None] = {DEMO_DRAFT: None, DEMO_EAGLE3: str(demo_eagle3_dir)}
    chosen_drafts = [demo_drafts.get(draft, draft) for draft in drafts or []]
    if len(chosen_drafts) == 1:
        config = dataclasses.replace(config, draft=chosen_drafts[0])
    if len(chosen_drafts) > 1:
        _head_to_head(config, chosen_drafts, scenario, only, skip, exact_blocks, json_output, out_console)
        return
    if scenario == "list":
        table = Table(title="Failure scenarios (dflash-doctor check --scenario NAME)")
        for column in ("name", "reproduces", "named by check"):
            table.add_column(column)
        for item in scenarios.SCENARIOS.values():
            table.add_row(item.name, item.incident, ", ".join(item.expect))
        out_console.print(table)
        return
    chosen = None
    if scenario is not None:
        chosen = scenarios.get_scenario(scenario)
        scenarios.check_demo_pair(config)
    only_ids, skip_ids = _ids(only), _ids(skip)
    for check_id in only_ids + skip_ids:
        get_check(check_id)  # an unknown id fails now, with "did you mean", before any model work
    if config.engine is not None and config.devices:
        raise UsageError(
            "--devices spreads the local replay over processes, --engine measures a server; drop one of them."
        )
    if config.engine is not None and scenario is not None:
        raise UsageError("--scenario reproduces failures on the embedded demo pair; drop it or drop --engine.")
    api_key = secret(engine_api_key, "--engine-api-key") if engine_api_key else None
    if (code := sharding.launch_ranks(config, "check")) is not None:
        raise typer.Exit(code)
    if config.engine is not None:
        outcome = run_with_progress(
            lambda progress: pipeline.run_server_check(
                config, only=only_ids, skip=skip_ids, progress=progress, api_key=api_key
            )
        )
    else:
        outcome = run_with_progress(
            lambda progress: pipeline.run_check(
                config, scenario=chosen, only=only_ids, skip=skip_ids, exact_blocks=exact_blocks, progress=progress
            )
        )
    record = outcome.record
    if config.engine is not None:
        print_class_summary(record, record.source.details.get("num_spec_tokens") or 0, out_console)
        print_server_comparison(record, out_console)
    else:
        print_class_summary(record, max(record.config["k"]), out_console)
        print_sweep(record, out_console)
        print_why_rejected(outcome.why_rejected, out_console)
    print_check_results(record.checks, out_console)
    out_console.print(f"run directory and reports: {outcome.run_dir} (report.html, report.md, report.json, junit.xml)")
    code = exit_code(record.checks, config.fail_on)
    if json_output:
        print_json(check_json(outcome, code))
    if code:
        raise typer.Exit(code)


def _head_to_head(
    config: DoctorConfig,
    drafts: list[str | None],
    scenario: str | None,
    only: str | None,
    skip: str | None,
    exact_blocks: bool,
    json_output: bool,
    out_console: Console,
) -> None:
    """``check --draft A --draft B ...``: each speculator's check, then the head-to-head table and verdict, then
    one line per speculator with its check verdict (pass / warn / fail) and the checks that warned or failed.
    Exit code as for one check over every speculator's checks: 1 when any sub-run's verdict meets --fail-on."""
    pipeline, exit_code, get_check, run_with_progress, *_ = _heavy_imports()
    if scenario is not None:
        raise UsageError("--scenario reproduces a failure of the demo pair; drop it when comparing several --draft.")
    if config.devices:
        raise UsageError("--devices spreads one replay over processes; drop it when comparing several --draft.")
    only_ids, skip_ids = _ids(only), _ids(skip)
    for check_id in only_ids + skip_ids:
        get_check(check_id)
    result = run_with_progress(
        lambda progress: pipeline.run_head_to_head(
            config, drafts, only=only_ids, skip=skip_ids, exact_blocks=exact_blocks, progress=progress
        )
    )
    codes = {}
    print_head_to_head(result.head_to_head, out_console)
    for name, outcome in result.outcomes.items():  # each sub-run's own verdict word and what warned or failed
        codes[name] = exit_code(outcome.record.checks, config.fail_on)
        verdict, flagged = check_verdict((check.id, check.status) for check in outcome.record.checks)
        out_console.print(
            f"{for_terminal(sub_run_line(name, verdict, flagged))}: {for_terminal(outcome.run_dir)}/report.html"
        )
    out_console.print(
        f"head-to-head: {result.root} (head_to_head.html, head_to_head.md, head_to_head.json; one check per sub-folder)"
    )
    code = max(codes.values())
    if json_output:
        print_json(
            {
                "head_to_head": result.head_to_head.to_json(),
                "runs": {name: check_json(outcome, codes[name]) for name, outcome in result.outcomes.items()},
                "run_dir": str(result.root),
                "exit_code": code,
            }
        )
    if code:
        raise typer.Exit(code)
