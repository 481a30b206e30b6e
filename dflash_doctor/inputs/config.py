"""One configuration object for every command, with precedence CLI > TOML file > defaults.

The TOML file (``--config doctor.toml``, else the first one :func:`discover_config_file` finds) holds the
same keys as the shared CLI flags (``target``, ``k``, ``max_requests``...) plus ``[thresholds]`` for verdicts,
``[checks.<id>]`` tables with per-check parameters, and ``strict_classes`` for request classes that must never risk a
slowdown. Validation happens once, in :func:`build_config`, and names the offending key or flag.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import platformdirs

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.validation import finite_number, type_error
from dflash_doctor.urls import without_userinfo
from dflash_doctor.stats.speedup import load_cost_profile


#: one item of an integer grid: ``8`` or ``1-15``, ASCII digits only
_GRID_PART = re.compile(r"[0-9]{1,18}(-[0-9]{1,18})?")


def parse_int_grid(text: str, flag: str, *, minimum: int, maximum: int | None = None) -> tuple[int, ...]:
    """``8``, a list ``2,4,8``, a range ``1-15`` or a mix, as sorted distinct integers in [``minimum``, ``maximum``].

    The one parser of integer grids (``--k`` of check/sweep/tune, tune's ``--fit-k`` and ``--concurrency``):
    a reversed range such as ``8-4`` is refused rather than read as empty; ``maximum`` is checked on each
    number before a range is spelled out, so ``1-10000000000`` is refused rather than allocated."""
    values: list[int] = []
    try:
        for part in text.replace(" ", "").split(","):
            if not _GRID_PART.fullmatch(part):
                raise ValueError  # int() also reads "1_000" and other scripts' digits ("٣")
            low, sep, high = part.partition("-")
            first, last = int(low), int(high) if sep else int(low)
            if first > last:
                raise ValueError
            if maximum is not None and last > maximum:
                raise UsageError(f"{flag} {text!r} must hold integers <= {maximum}; fix the value.")
            values.extend(range(first, last + 1))
    except ValueError:
        raise UsageError(
            f"{flag} {text!r} is not an integer, a list like 2,4,8 or a range like 1-15; fix the value."
        ) from None
    if not values or min(values) < minimum:
        raise UsageError(f"{flag} {text!r} must hold integers >= {minimum}; fix the value.")
    return tuple(sorted(set(values)))


#: The largest K (draft tokens per step) any command replays: vLLM's own ceiling (its rejection sampler's
#: ``MAX_SPEC_LEN`` = 128), so no K above it can be served. A block drafter is capped lower by its block
#: (``Pair.check_k_fits``); this cap is what bounds a speculator without a block (ngram, suffix, an
#: autoregressive draft), whose verify of 1 + K tokens holds (1 + K) x vocabulary logits (K = 32767 asked
#: for 45 GB) and whose K is an int16 column of steps.parquet.
MAX_K = 128


def parse_k(value: str | int | list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Parse ``--k`` (or a config file's ``k``): an integer, a list or a grid string, as sorted unique ints
    in [1, :data:`MAX_K`]."""
    if isinstance(value, str):
        return parse_int_grid(value, "--k", minimum=1, maximum=MAX_K)
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values or any((not isinstance(v, int)) or isinstance(v, bool) or not 1 <= v <= MAX_K for v in values):
        raise UsageError(
            f"--k {value!r} must hold integers from 1 to {MAX_K} (vLLM's most draft tokens per step); fix the value."
        )
    return tuple(sorted(set(values)))


# The settings that take one of a few words: each a Literal (the CLI shows and completes its choices) and
# the tuple of its words (validation of a config-file value).
#: Where report pages load plotly.js from: ``inline`` embeds the bundle (~4.6 MB, opens offline, the
#: default) and ``cdn`` links plotly's CDN (a few kB per page, for CI artefacts; needs the network to draw).
PlotlySource = Literal["inline", "cdn"]
PLOTLY_SOURCES: tuple[str, ...] = typing.get_args(PlotlySource)
Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
#: Which verdict turns the exit code to 1: ``fail`` only, or ``warn`` as well.
FailOn = Literal["fail", "warn"]
FAIL_ON: tuple[str, ...] = typing.get_args(FailOn)
#: How a request's last steps draft and count (dflash_doctor.engine.schedule): ``vllm`` K drafts to the end,
#: counted past max_tokens and a stop token; ``llamacpp`` drafts capped at the tokens left; ``official``
#: (dflash_generate) shrinks the last blocks too.
EndOfRequest = Literal["vllm", "llamacpp", "official"]
END_OF_REQUEST: tuple[str, ...] = typing.get_args(EndOfRequest)


def parse_plotly_source(value: str) -> str:
    """``--plotly``: one of :data:`PLOTLY_SOURCES`, else a UsageError naming them."""
    if value not in PLOTLY_SOURCES:
        raise UsageError(f"--plotly {value!r} is not a plotly.js source; use {' or '.join(PLOTLY_SOURCES)}.")
    return value


@dataclass
class DoctorConfig:
    """Everything a command was asked for; stored verbatim in run.json ``config``."""

    target: str | None = None  # local dir, hub id, or .gguf file; None = the built-in demo target
    draft: str | None = None  # same forms; None = the built-in demo draft
    draft_kind: str = "auto"  # a registered draft kind (dflash_doctor.models.draft_kinds) or auto
    workload: str = "demo"  # built-in name or a .jsonl/.csv/.parquet file
    classes: tuple[str, ...] = ()  # keep only these request classes (empty = all)
    max_requests: int | None = None  # stratified over classes, seeded
    max_new_tokens: int = 128
    temperature: float = 0.0
    k: tuple[int, ...] = ()  # draft tokens per step; several = a sweep; empty = the draft's own default
    device: str = "cpu"  # several GPUs (cuda:0,cuda:1) place one target over them (dflash_doctor.models.placement)
    devices: tuple[str, ...] = ()  # one torchrun rank per entry (sweep, check); cuda:0+cuda:1 gives a rank two GPUs
    dtype: str = "float32"
    out: str | None = None  # run directory; None = runs/<timestamp>
    overwrite: bool = False  # replace the run already in --out (refused otherwise: rundir/ownership.py)
    seed: int = 0
    fail_on: str = "fail"  # fail | warn: which verdict turns the exit code to 1
    trust_remote_code: bool = False
    chat_template: str | None = None  # a .jinja file overriding the target's template
    cost_profile: str | None = None  # TOML/JSON step times measured in a serving engine
    timing_budget_s: float = (
        20.0  # seconds for timing the step costs here (stats/step_costs.py); a cost profile needs none
    )
    engine_config: str | None = None  # vLLM speculative_config JSON or SGLang launch flags
    end_of_request: str = "vllm"  # vllm | llamacpp | official (dflash_generate): engine/schedule.py
    strict_classes: tuple[str, ...] = ()  # classes that get a capped K, or no speculation if it would not pay
    engine: str | None = None  # URL of a running OpenAI-compatible server to measure (check --engine)
    engine_model: str | None = None  # model name on that server; None = its only model
    engine_concurrency: int = 4  # requests in flight at once against the server
    engine_timeout_s: float = 300.0  # per-request timeout against the server
    thresholds: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-check parameters
    watch: dict[str, Any] = field(
        default_factory=dict
    )  # `watch` settings: window, baseline, thresholds (telemetry/settings.py)
    plotly: str = "inline"  # where report.html loads plotly.js from: inline (offline) | cdn (small CI artefacts)

    def as_dict(self) -> dict[str, Any]:
        """What run.json records: a URL's ``user:password@`` is kept for the requests only, never written."""
        values = dataclasses.asdict(self)
        if values.get("engine"):
            values["engine"] = without_userinfo(values["engine"])[0]
        return values


_FIELDS = {f.name: f for f in dataclasses.fields(DoctorConfig)}
_TUPLE_FIELDS = {"classes", "strict_classes", "devices"}
# The type a config-file value must have: the field's own, except where the file may write the flag's
# text form (``k = "1-8"``, ``classes = "math,code"``).
_FILE_TYPES: dict[str, Any] = {
    **typing.get_type_hints(DoctorConfig),
    "k": str | int | list[int],
    **{name: str | list[str] for name in _TUPLE_FIELDS},
}


CONFIG_FILE_NAME = "doctor.toml"
#: The table of a pyproject.toml that holds the same keys as a doctor.toml: ``[tool.dflash-doctor]``.
PYPROJECT_TABLE = "dflash-doctor"


def _pyproject_table(document: dict[str, Any]) -> dict[str, Any] | None:
    table = document.get("tool", {}).get(PYPROJECT_TABLE)
    return table if isinstance(table, dict) else None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {path} is not valid TOML ({exc}); fix the file.") from None


def discover_config_file(folder: Path | None = None) -> Path | None:
    """The config file a command reads when ``--config`` is not given, first found wins: ``doctor.toml``
    in ``folder`` (default: the working directory), then that folder's ``pyproject.toml`` when it has a
    ``[tool.dflash-doctor]`` table, then ``doctor.toml`` in the user config folder (platformdirs:
    ``~/.config/dflash-doctor`` on Linux). None when there is none (the defaults apply)."""
    folder = Path.cwd() if folder is None else folder
    if (folder / CONFIG_FILE_NAME).is_file():
        return folder / CONFIG_FILE_NAME
    pyproject = folder / "pyproject.toml"
    if pyproject.is_file() and _pyproject_table(_read_toml(pyproject)) is not None:
        return pyproject
    user_file = user_config_folder() / CONFIG_FILE_NAME
    return user_file if user_file.is_file() else None


def user_config_folder() -> Path:
    """The user's own config folder (platformdirs: ``$XDG_CONFIG_HOME/dflash-doctor``, else
    ``~/.config/dflash-doctor`` on Linux): the one place a config file may hold :data:`GUARDED_KEYS`."""
    return Path(platformdirs.user_config_dir(PYPROJECT_TABLE))


def read_config_file(path: Path | str) -> dict[str, Any]:
    """Read a doctor.toml, or the ``[tool.dflash-doctor]`` table of a pyproject.toml; unknown keys are
    refused by :func:`build_config`."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"config file {path} does not exist; pass an existing TOML file to --config.")
    document = _read_toml(path)
    if path.name != "pyproject.toml":
        return document
    table = _pyproject_table(document)
    if table is None:
        raise UsageError(f"config file {path} has no [tool.{PYPROJECT_TABLE}] table; add one or pass a doctor.toml.")
    return table


@dataclass(frozen=True)
class GuardedKey:
    """A config-file key that reaches outside this machine or outside the run folder (see :data:`GUARDED_KEYS`)."""

    flag: str  # the command-line flag that sets it instead
    reach: str  # what it does, for the refusal: "sends your API key and the prompts to that server"
    user_folder: bool  # whether a file in the user config folder may set it (False: the flag only)
    with_key: str | None = None  # guarded only when the command also gets this key on (``out`` with ``overwrite``)


#: The keys a config file may not set unless it lives in the user's own config folder
#: (:func:`user_config_folder`). The tool reads ``./doctor.toml`` and ``./pyproject.toml`` from whatever
#: folder it runs in, and that folder is often someone else's (a cloned repository, a pull request's
#: checkout): a key there must not run a model's own Python (``trust_remote_code``: the flag only, from
#: any file), send ``OPENAI_API_KEY`` and the workload's prompts to a server of its choosing (``engine``)
#: or replace files in a folder it chose (``overwrite``; ``out`` when ``--overwrite`` is given). A file
#: that tries is refused, not skipped, so nobody believes its setting took effect. (``--engine-api-key``,
#: tune's ``--launch`` and watch's sources are flags only: no config file holds them.)
GUARDED_KEYS: dict[str, GuardedKey] = {
    "trust_remote_code": GuardedKey("--trust-remote-code", "runs a model's own Python", user_folder=False),
    "engine": GuardedKey("--engine", "sends your API key and the workload's prompts to that server", user_folder=True),
    "overwrite": GuardedKey("--overwrite", "replaces the files already in the run folder", user_folder=True),
    "out": GuardedKey(
        "--out",
        "with --overwrite replaces the files of a folder the file chose",
        user_folder=True,
        with_key="overwrite",
    ),
}


def _refuse_guarded_keys(path: Path, file_values: dict[str, Any], merged: dict[str, Any], given: set[str]) -> None:
    """Refuse the first :data:`GUARDED_KEYS` key that ``path`` sets (``file_values``) in one sentence, unless
    the file lives in the user config folder and the key may come from there. A key with ``with_key`` counts
    only when the command runs with the file's value (``given``: the keys a flag set) and that key on."""
    for key, guard in GUARDED_KEYS.items():
        if not file_values.get(key) or (guard.with_key and (key in given or not merged.get(guard.with_key))):
            continue
        folder = user_config_folder()
        if guard.user_folder and path.resolve().is_relative_to(folder.resolve()):
            continue
        where = f"the command-line flag {guard.flag}" + (f" or a config file in {folder}" if guard.user_folder else "")
        raise UsageError(
            f"config file {path} sets {key}, which {guard.reach} and only {where} may set; "
            f"remove the key and pass {guard.flag} on the command line."
        )


def build_config(config_file: str | Path | None = None, **cli_values: Any) -> DoctorConfig:
    """Merge defaults < file < CLI (a CLI value of None means "not given") and validate once; a file's
    :data:`GUARDED_KEYS` are refused unless it lives in the user config folder."""
    file_values: dict[str, Any] = {}
    if config_file is not None:
        for key, value in read_config_file(config_file).items():
            key = key.replace("-", "_")
            if key not in _FIELDS:
                raise UsageError(
                    f"config file {config_file}: unknown key {key!r}; "
                    f"remove it or use one of {', '.join(sorted(_FIELDS))}."
                )
            expected = type_error(value, _FILE_TYPES[key])
            if expected is not None:
                raise UsageError(
                    f"config file {config_file}: `{key}` is {value!r}, but it must be {expected}; fix the value."
                )
            file_values[key] = value
    merged = dict(file_values)
    given = set()
    for key, value in cli_values.items():
        if key not in _FIELDS:
            raise TypeError(f"build_config got an unknown field {key!r}")
        if value is not None and value != ():
            merged[key] = value
            given.add(key)
    if config_file is not None:
        _refuse_guarded_keys(Path(config_file), file_values, merged, given)
    if "k" in merged:
        merged["k"] = parse_k(merged["k"])
    for key in _TUPLE_FIELDS:
        if key in merged:
            value = merged[key]
            merged[key] = tuple(x.strip() for x in (value.split(",") if isinstance(value, str) else value) if x.strip())
    config = DoctorConfig(**merged)
    _validate(config)
    return config


#: Every key ``[thresholds]`` may hold, with the range :func:`finite_number` holds it to: checked with every
#: other number before any work (an unknown key is refused, not ignored: a misspelt threshold would leave
#: its default silently in force). Read by the deviation analysis (``confident_*``) and the K recommendation.
THRESHOLDS: dict[str, dict[str, Any]] = {
    "confident_max_entropy": {"minimum": 0.0, "maximum": 1e6},
    "confident_min_margin": {"minimum": 0.0, "maximum": 1.0},
    "strict_max_k": {"minimum": 1, "maximum": 1024, "integer": True},
    "conservative_share": {"above": 0.0, "maximum": 1.0},
}


def _validate(config: DoctorConfig) -> None:
    # every number from a user is finite and in range (nan passes
    # a plain "< 0" check): one rule, validation.finite_number
    config.temperature = finite_number(
        config.temperature, "--temperature", minimum=0, maximum=1e6, fix="use 0 for greedy or a positive value"
    )
    config.engine_timeout_s = finite_number(
        config.engine_timeout_s, "--engine-timeout", above=0, maximum=86400 * 7, fix="pass a positive number of seconds"
    )
    for key, value in config.thresholds.items():
        if key not in THRESHOLDS:
            raise UsageError(f"[thresholds] has no key {key!r}; remove it or use one of {', '.join(THRESHOLDS)}.")
        config.thresholds[key] = finite_number(
            value, f"[thresholds] {key}", **THRESHOLDS[key], fix="fix the config file"
        )
    if config.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {config.max_new_tokens} must be at least 1.")
    if config.max_requests is not None and config.max_requests < 1:
        raise UsageError(f"--max-requests {config.max_requests} must be at least 1.")
    if config.engine_concurrency < 1:
        raise UsageError(f"--engine-concurrency {config.engine_concurrency} must be at least 1.")
    if config.engine_timeout_s <= 0:
        raise UsageError(f"--engine-timeout {config.engine_timeout_s} must be a positive number of seconds.")
    if config.fail_on not in FAIL_ON:
        raise UsageError(f"--fail-on {config.fail_on!r} is not one of {', '.join(FAIL_ON)}; pick one.")
    config.timing_budget_s = finite_number(
        config.timing_budget_s,
        "--timing-budget",
        minimum=0,
        maximum=86400,
        fix="pass the seconds the step timing may take, e.g. 20",
    )
    if config.cost_profile is not None:
        load_cost_profile(config.cost_profile)  # a profile that does not parse fails before any model work
    if config.end_of_request not in END_OF_REQUEST:
        raise UsageError(
            f"end_of_request {config.end_of_request!r} is not one of "
            f"{', '.join(END_OF_REQUEST)}; pick the loop you model."
        )
    parse_plotly_source(config.plotly)
    if config.dtype not in DTYPES:
        raise UsageError(f"--dtype {config.dtype!r} is not one of {', '.join(DTYPES)}; pick one.")
