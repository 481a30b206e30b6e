"""Shared CLI flags (DESIGN.md "Shared flags"), declared once and reused by every command.

Every option defaults to None so that :func:`dflash_doctor.inputs.config.build_config` can tell "not given"
from a value and apply the precedence CLI > --config file > defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Optional

import typer

from dflash_doctor.inputs.config import DoctorConfig

Target = Annotated[Optional[str], typer.Option("--target", help="Target model: local dir, hub id, or .gguf file (default: the built-in demo target).")]
Draft = Annotated[Optional[str], typer.Option("--draft", help="Draft model: local dir, hub id, or .gguf file (default: the built-in demo DFlash draft).")]
DraftKind = Annotated[Optional[str], typer.Option("--draft-kind", help="dflash | autoregressive | auto (detect from the checkpoint).")]
Workload = Annotated[Optional[str], typer.Option("--workload", help="Built-in workload name (see `dflash-doctor workloads`) or a .jsonl/.csv/.parquet file.")]
Classes = Annotated[Optional[str], typer.Option("--classes", help="Comma-separated request classes to keep, e.g. math,code.")]
MaxRequests = Annotated[Optional[int], typer.Option("--max-requests", help="Replay at most N requests, stratified over classes (seeded).")]
MaxNewTokens = Annotated[Optional[int], typer.Option("--max-new-tokens", help="Tokens generated per request (default 128).")]
Temperature = Annotated[Optional[float], typer.Option("--temperature", help="Sampling temperature; 0 = greedy (default).")]
K = Annotated[Optional[str], typer.Option("--k", help="Draft tokens per step: 8, a list 2,4,8 or a range 1-15.")]
Device = Annotated[Optional[str], typer.Option("--device", help="cpu, cuda, cuda:1 ... (default cpu); cuda:0,cuda:1 places a target too large for one GPU over both.")]
Devices = Annotated[Optional[str], typer.Option("--devices", help="Spread the requests over several devices, one torchrun process each: cuda:0,cuda:1 (cuda:0+cuda:1 gives one process a target over two GPUs).")]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="float32 | bfloat16 | float16 (default float32).")]
Out = Annotated[Optional[str], typer.Option("--out", help="Run directory to write (default runs/<timestamp>).")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace the run already in --out (without it a folder holding files is refused).")]
ConfigFile = Annotated[Optional[str], typer.Option("--config", help="doctor.toml with the same keys plus thresholds; CLI flags override it.")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling and request selection (default 0).")]
FailOn = Annotated[Optional[str], typer.Option("--fail-on", help="fail (default) or warn: warnings also exit 1.")]
TrustRemoteCode = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model repos to run their own Python code (off by default).")]
ChatTemplate = Annotated[Optional[str], typer.Option("--chat-template", help="A .jinja file that replaces the target's chat template.")]
CostProfile = Annotated[Optional[str], typer.Option("--cost-profile", help="TOML/JSON step times measured in your serving engine (see docs/cost-profile.md) instead of timing here.")]
StrictClasses = Annotated[Optional[str], typer.Option("--strict-classes", help="Comma-separated classes that must never risk a slowdown (capped K, or speculation off).")]
EndOfRequest = Annotated[Optional[str], typer.Option("--end-of-request", help="vllm (default: full blocks, as vLLM/SGLang) | official (dflash_generate shrinks the last blocks); see docs/draft-formats.md.")]
Plotly = Annotated[Optional[str], typer.Option("--plotly", help="Where report.html loads plotly.js from: inline (default: embedded, opens offline) or cdn (4.6 MB smaller, for CI artefacts).")]
ExactBlocks = Annotated[bool, typer.Option("--exact-blocks", help="Block drafters: one pass per K instead of estimating smaller K from the largest block.")]


def config_values(flags: dict[str, Any]) -> dict[str, Any]:
    """A command's parameters that are DoctorConfig fields, as ``build_config`` keyword arguments.

    Call it first thing with ``locals()``. A switch left off (False) counts as "not given", so a
    --config file can still turn it on.
    """
    fields = {f.name for f in dataclasses.fields(DoctorConfig)}
    return {name: (value or None) if isinstance(value, bool) else value for name, value in flags.items() if name in fields}
