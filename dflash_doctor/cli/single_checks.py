"""`dflash-doctor tokenizers A B`, `templates A B` and `env`: one check each, fast, no model weights.

A is the target (what the server runs), B the draft. Each prints the check table and exits 0 on
pass/warn, 1 on fail (or on a warning with --fail-on warn), 2 on bad input (docs/user-guide.md#exit-codes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

if TYPE_CHECKING:
    from dflash_doctor.checks import CheckContext
from dflash_doctor.serving.server_settings import server_settings
from dflash_doctor.inputs.machine import collect_environment
from dflash_doctor.inputs.check_inputs import load_config_json, load_template_spec, load_tokenizer_spec
from dflash_doctor.report.terminal import print_check_results
from dflash_doctor.cli.root import app
from dflash_doctor.cli.options import config_command
from dflash_doctor.inputs.config import DoctorConfig

TargetArg = Annotated[
    str,
    typer.Argument(
        help="Target side: model dir, tokenizer dir, tokenizer.json or .gguf (templates: also a .jinja file)."
    ),
]
DraftArg = Annotated[str, typer.Argument(help="Draft side, same forms as the target.")]
Thinking = Optional[bool]


def _finish(ctx: CheckContext, check_id: str, fail_on: str, params: dict | None = None) -> None:
    """Run one check, print the table, exit with the documented code (docs/user-guide.md#exit-codes)."""
    from dflash_doctor.checks import exit_code, run_checks  # torch: not for --help

    results = run_checks(ctx, only=[check_id], params={check_id: params or {}})
    print_check_results(results, Console())
    raise typer.Exit(exit_code(results, fail_on))


@app.command("tokenizers", epilog="Example: dflash-doctor tokenizers Qwen/Qwen3-8B z-lab/Qwen3-8B-DFlash-b16")
@config_command("fail_on")
def tokenizers_command(config: DoctorConfig, target: TargetArg, draft: DraftArg) -> None:
    """Compare two tokenizers: ids over the whole vocabulary, special tokens, pipeline, corpus round-trip."""
    from dflash_doctor.checks import CheckContext  # torch: not for --help

    ctx = CheckContext(
        target_tokenizer=load_tokenizer_spec(target, "target"),
        draft_tokenizer=load_tokenizer_spec(draft, "draft"),
        target_config=load_config_json(target),
        draft_config=load_config_json(draft),
        config=config,
    )
    _finish(ctx, "tokenizer-parity", config.fail_on)


@app.command("templates", epilog="Example: dflash-doctor templates ./target ./draft --draft-disable-thinking")
@config_command("fail_on")
def templates_command(
    config: DoctorConfig,
    target: TargetArg,
    draft: DraftArg,
    target_enable_thinking: Annotated[
        Thinking,
        typer.Option(
            "--target-enable-thinking/--target-disable-thinking",
            help="Pin enable_thinking for the served template (default: render both ways).",
        ),
    ] = None,
    draft_enable_thinking: Annotated[
        Thinking,
        typer.Option(
            "--draft-enable-thinking/--draft-disable-thinking",
            help="Pin enable_thinking for the draft's template, e.g. as it was trained.",
        ),
    ] = None,
) -> None:
    """Render canonical conversations with both chat templates and show the first differing bytes."""
    from dflash_doctor.checks import CheckContext  # torch: not for --help

    target_template, target_tokenizer = load_template_spec(target, "target")
    draft_template, draft_tokenizer = load_template_spec(draft, "draft")
    ctx = CheckContext(
        target_tokenizer=target_tokenizer,
        draft_tokenizer=draft_tokenizer,
        target_template=target_template,
        draft_template=draft_template,
        config=config,
    )
    pins = {
        k: v
        for k, v in {
            "target_enable_thinking": target_enable_thinking,
            "draft_enable_thinking": draft_enable_thinking,
        }.items()
        if v is not None
    }
    _finish(ctx, "chat-template-parity", config.fail_on, pins)


@app.command("env", epilog="Example: dflash-doctor env --engine-config vllm_spec.json --draft ./draft")
@config_command("engine_config", "draft", "fail_on")
def env_command(config: DoctorConfig) -> None:
    """Show versions and hardware, and check them (and --engine-config) against known incompatibilities."""
    from dflash_doctor.checks import CheckContext  # torch: not for --help

    ctx = CheckContext(
        environment=collect_environment(),
        engine_config=server_settings(config.engine_config) if config.engine_config else None,
        draft_config=load_config_json(config.draft),
        config=config,
    )
    _finish(ctx, "environment", config.fail_on)
