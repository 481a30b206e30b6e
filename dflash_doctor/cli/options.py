"""Shared CLI flags (docs/user-guide.md#shared-flags), declared once; :func:`config_command` gives a command the
ones it takes.

Every flag that is a :class:`~dflash_doctor.inputs.config.DoctorConfig` field defaults to None, so that
:func:`~dflash_doctor.inputs.config.build_config` can tell "not given" from a value and apply the
precedence CLI (or its DFLASH_DOCTOR_* variable) > config file > defaults. ``--help`` still shows the
real default: ``show_default`` names DoctorConfig's value as text, which Click prints and never passes on.
"""

from __future__ import annotations

import importlib

import dataclasses
import functools
import inspect
import logging
from typing import Annotated, Any, Callable, Optional

import typer

from dflash_doctor.cli.log_setup import progress_shown
from dflash_doctor.inputs import config as settings
from dflash_doctor.inputs.config import DoctorConfig, build_config, discover_config_file

_DEFAULTS = DoctorConfig()
_log = logging.getLogger(__name__)


def _default(name: str) -> str:
    """DoctorConfig's default for ``name`` as --help shows it."""
    return str(getattr(_DEFAULTS, name))


def _env(name: str) -> dict[str, Any]:
    """The environment variable a common setting may come from (below the flag, above the config file)."""
    return {"envvar": f"DFLASH_DOCTOR_{name.upper()}", "show_envvar": True}


def _complete_draft_kinds(incomplete: str) -> list[str]:
    """The registered kinds, read when the shell asks: the registry imports torch, which the commands that
    share these flags without loading a model (watch, compare) must not (tests/test_light_install.py)."""
    registry = importlib.import_module("dflash_doctor.models.draft_kinds")
    return [name for name in registry.kind_names() if name.startswith(incomplete)]


Target = Annotated[
    Optional[str],
    typer.Option(
        "--target",
        metavar="PATH|ORG/NAME",
        help="Target model: local dir, hub id (org/name or org/name@revision), or .gguf file.",
        show_default="the built-in demo target",
        **_env("target"),
    ),
]
Draft = Annotated[
    Optional[str],
    typer.Option(
        "--draft",
        metavar="PATH|ORG/NAME",
        help="Draft model: local dir, hub id (org/name or org/name@revision), or .gguf file.",
        show_default="the built-in demo DFlash draft",
        **_env("draft"),
    ),
]
# A registry (plugins may add kinds), so the words are listed and completed, and get_draft_kind refuses an unknown one.
DraftKind = Annotated[
    Optional[str],
    typer.Option(
        "--draft-kind",
        help=(
            "dflash | eagle3 | autoregressive | auto; mtp (the target's own MTP head: "
            "--draft mtp), ngram or suffix (no weights: --draft ngram, --draft "
            "suffix); or a kind a plugin registered (auto: detect from the checkpoint)."
        ),
        show_default=_default("draft_kind"),
        autocompletion=_complete_draft_kinds,
    ),
]
Workload = Annotated[
    Optional[str],
    typer.Option(
        "--workload",
        metavar="NAME|PATH",
        help="Built-in workload name (see `dflash-doctor workloads`) or a .jsonl/.csv/.parquet file.",
        show_default=_default("workload"),
    ),
]
Classes = Annotated[
    Optional[str],
    typer.Option("--classes", help="Comma-separated request classes to keep, e.g. math,code.", show_default="all"),
]
MaxRequests = Annotated[
    Optional[int],
    typer.Option(
        "--max-requests", help="Replay at most N requests, stratified over classes (seeded).", show_default="all"
    ),
]
MaxNewTokens = Annotated[
    Optional[int],
    typer.Option("--max-new-tokens", help="Tokens generated per request.", show_default=_default("max_new_tokens")),
]
Temperature = Annotated[
    Optional[float],
    typer.Option("--temperature", help="Sampling temperature; 0 = greedy.", show_default=_default("temperature")),
]
K = Annotated[
    Optional[str],
    typer.Option(
        "--k",
        help="Draft tokens per step: 8, a list 2,4,8 or a range 1-15.",
        show_default="the draft's block size - 1, or 1-8",
    ),
]
Device = Annotated[
    Optional[str],
    typer.Option(
        "--device",
        help="cpu, cuda, cuda:1 ...; cuda:0,cuda:1 places a target too large for one GPU over both.",
        show_default=_default("device"),
        **_env("device"),
    ),
]
Devices = Annotated[
    Optional[str],
    typer.Option(
        "--devices",
        help=(
            "Spread the requests over several devices, one torchrun process each: "
            "cuda:0,cuda:1 (cuda:0+cuda:1 gives one process a target over two GPUs)."
        ),
        show_default="one process",
    ),
]
Dtype = Annotated[
    Optional[settings.Dtype],
    typer.Option("--dtype", help="Weights and compute dtype.", show_default=_default("dtype"), **_env("dtype")),
]
Out = Annotated[
    Optional[str],
    typer.Option("--out", metavar="DIR", help="Run directory to write.", show_default="runs/<command>-<timestamp>"),
]
Overwrite = Annotated[
    bool,
    typer.Option(
        "--overwrite", help="Replace the run already in --out (without it a folder holding files is refused)."
    ),
]
Seed = Annotated[
    Optional[int],
    typer.Option("--seed", help="Random seed for sampling and request selection.", show_default=_default("seed")),
]
FailOn = Annotated[
    Optional[settings.FailOn],
    typer.Option(
        "--fail-on",
        help="The verdict that exits 1: fail, or warn (warnings too).",
        show_default=_default("fail_on"),
        **_env("fail_on"),
    ),
]
TrustRemoteCode = Annotated[
    bool, typer.Option("--trust-remote-code", help="Allow model repos to run their own Python code (off by default).")
]
ChatTemplate = Annotated[
    Optional[str],
    typer.Option(
        "--chat-template",
        metavar="PATH",
        help="A .jinja file that replaces the target's chat template.",
        show_default="the target's own",
    ),
]
CostProfile = Annotated[
    Optional[str],
    typer.Option(
        "--cost-profile",
        metavar="PATH",
        help="TOML/JSON step times measured in your serving engine (see docs/cost-profile.md) instead of timing here.",
        show_default="timed here",
    ),
]
TimingBudget = Annotated[
    Optional[float],
    typer.Option(
        "--timing-budget",
        help=(
            "Seconds the step timing may take here: each step kind is "
            "re-timed until its median is known within 5% or this is spent."
        ),
        show_default=_default("timing_budget_s"),
        **_env("timing_budget_s"),
    ),
]
StrictClasses = Annotated[
    Optional[str],
    typer.Option(
        "--strict-classes",
        help="Comma-separated classes that must never risk a slowdown (capped K, or speculation off).",
        show_default="none",
    ),
]
EndOfRequest = Annotated[
    Optional[settings.EndOfRequest],
    typer.Option(
        "--end-of-request",
        help=(
            "How a request's last steps draft and count: vllm (K drafts to the end, counted "
            "as vLLM/SGLang count them), llamacpp (drafts capped at the tokens left), "
            "official (dflash_generate shrinks the last blocks); docs/draft-formats.md."
        ),
        show_default=_default("end_of_request"),
    ),
]
Plotly = Annotated[
    Optional[settings.PlotlySource],
    typer.Option(
        "--plotly",
        help=(
            "Where report.html loads plotly.js from: inline (embedded, "
            "opens offline) or cdn (4.6 MB smaller, for CI artefacts)."
        ),
        show_default=_default("plotly"),
        **_env("plotly"),
    ),
]
ServerConfigFile = Annotated[
    Optional[str],
    typer.Option(
        "--engine-config",
        metavar="PATH",
        help="vLLM speculative_config JSON, or a file with SGLang/vLLM launch flags, to check against the draft.",
        show_default="none",
    ),
]
ServerUrl = Annotated[
    Optional[str],
    typer.Option(
        "--engine",
        metavar="URL",
        help=(
            "URL of a running OpenAI-compatible server (vLLM, SGLang, llama.cpp): measure acceptance "
            "there; with --target/--draft also replay locally and compare (engine-agreement)."
        ),
        show_default="no server",
    ),
]
ServerModel = Annotated[
    Optional[str],
    typer.Option("--engine-model", help="Model name on the --engine server.", show_default="its only model"),
]
ServerConcurrency = Annotated[
    Optional[int],
    typer.Option(
        "--engine-concurrency",
        help="Requests in flight at once against --engine.",
        show_default=_default("engine_concurrency"),
    ),
]
ServerApiKey = Annotated[
    Optional[str],
    typer.Option(
        "--engine-api-key",
        envvar="OPENAI_API_KEY",
        show_envvar=True,
        help=(
            "API key of the --engine server (sent as a bearer token); env:VAR "
            "reads it from the environment. Never written to the run directory."
        ),
    ),
]
ServerTimeout = Annotated[
    Optional[float],
    typer.Option(
        "--engine-timeout",
        help="The most seconds one request to --engine may take, its whole answer included.",
        show_default=_default("engine_timeout_s"),
    ),
]
ConfigFile = Annotated[
    Optional[str],
    typer.Option(
        "--config",
        metavar="PATH",
        help=(
            "TOML file with the flags' keys plus thresholds (docs/user-guide.md#configuration). Without "
            "it: ./doctor.toml, else [tool.dflash-doctor] in ./pyproject.toml, else doctor.toml in the "
            "user config folder. Precedence: flag > DFLASH_DOCTOR_* variable > file > default."
        ),
        show_default="discovered",
        **_env("config"),
    ),
]

#: Every shared flag by its DoctorConfig field name (``config_file`` is ``--config`` itself).
FLAGS: dict[str, Any] = {
    "target": Target,
    "draft": Draft,
    "draft_kind": DraftKind,
    "workload": Workload,
    "classes": Classes,
    "max_requests": MaxRequests,
    "max_new_tokens": MaxNewTokens,
    "temperature": Temperature,
    "k": K,
    "device": Device,
    "devices": Devices,
    "dtype": Dtype,
    "out": Out,
    "overwrite": Overwrite,
    "seed": Seed,
    "fail_on": FailOn,
    "trust_remote_code": TrustRemoteCode,
    "chat_template": ChatTemplate,
    "cost_profile": CostProfile,
    "timing_budget_s": TimingBudget,
    "strict_classes": StrictClasses,
    "end_of_request": EndOfRequest,
    "plotly": Plotly,
    "engine_config": ServerConfigFile,
    "engine": ServerUrl,
    "engine_model": ServerModel,
    "engine_concurrency": ServerConcurrency,
    "engine_timeout_s": ServerTimeout,
    "config_file": ConfigFile,
}

#: The flags of every command that replays a workload through a local pair (replay, sweep, check).
REPLAY_FLAGS = (
    "target",
    "draft",
    "draft_kind",
    "workload",
    "classes",
    "max_requests",
    "max_new_tokens",
    "temperature",
    "k",
    "device",
    "dtype",
    "out",
    "overwrite",
    "seed",
    "chat_template",
    "trust_remote_code",
    "end_of_request",
)

ExactBlocks = Annotated[
    bool,
    typer.Option(
        "--exact-blocks", help="Block drafters: one pass per K instead of estimating smaller K from the largest block."
    ),
]
Json = Annotated[
    bool,
    typer.Option(
        "--json",
        help=(
            "Print the result as one JSON object on stdout (keys: "
            "docs/user-guide.md#machine-readable-output); everything else goes to stderr."
        ),
    ),
]

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(DoctorConfig)}


def config_command(
    *names: str, beside: dict[str, str] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the shared flags ``names`` (DoctorConfig fields) and ``--config``, in front of its own;
    ``beside`` lists an own parameter right after a shared flag instead (``{"drafts": "target"}``: check's
    repeatable ``--draft`` next to ``--target`` in ``--help``, where a reader looks for it).

    The command's first parameter, ``config: DoctorConfig``, receives them merged by ``build_config``
    (flag > file > defaults; the file is --config or the discovered one, named on stderr unless -q). A
    switch left off (False) counts as "not given", so a config file can still turn it on.
    """
    unknown = [name for name in names if name not in _CONFIG_FIELDS]
    if unknown:
        raise ValueError(f"config_command: {unknown} are not DoctorConfig fields")

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = list(inspect.signature(command, eval_str=True).parameters.values())
        if not own or own[0].name != "config":
            raise TypeError(f"{command.__name__}: the first parameter must be `config: DoctorConfig`")
        shared = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=FLAGS[name],
                default=False if name in ("overwrite", "trust_remote_code") else None,
            )
            for name in (*names, "config_file")
        ]
        rest = [parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY) for parameter in own[1:]]
        parameters = [p for p in shared + rest if p.name not in (beside or {})]
        for moved, anchor in (beside or {}).items():
            parameter = next(p for p in rest if p.name == moved)
            parameters.insert(next(i for i, p in enumerate(parameters) if p.name == anchor) + 1, parameter)

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            config_file = values.pop("config_file") or discover_config_file()
            if config_file is None:
                _log.info("config file: none (flags and defaults)")
            elif progress_shown():  # without -v: a file picked up from the working directory is never silent
                typer.echo(f"settings read from {config_file}", err=True)
            flags = {name: values.pop(name) for name in names}
            config = build_config(
                config_file,
                **{name: (value or None) if isinstance(value, bool) else value for name, value in flags.items()},
            )
            return command(config, **values)

        setattr(run, "__signature__", inspect.Signature(parameters))
        run.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
        return run

    return decorate
