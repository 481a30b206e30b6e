"""The run record: one typed object per run, written once as ``run.json`` and read back by every view.

The pipeline builds a :class:`RunRecord` in memory (meta, source, models, environment, config,
summary overall + by class + sweep, recommendation, checks, probes); :meth:`RunRecord.to_json` and
:meth:`RunRecord.from_json` are the only places that know the JSON layout. The Parquet tables
(requests, steps, tokens) are declared next to the writer in :mod:`dflash_doctor.rundir.tables`.

``source`` says where the replayed steps came from, so other producers fill the same record:

* ``embedded``: dflash-doctor's own engine replayed the workload (``check``, ``sweep``, ``replay``);
* ``serving-engine``: a running vLLM / SGLang server answered the requests (``--engine URL``);
* ``telemetry``: production counters were read from a serving engine (``watch``).

Numbers follow vLLM's definitions (docs/definitions.md); NaN is written as null.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin, get_type_hints

import numpy as np

from dflash_doctor import __version__
from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.engine_agreement import JSON_NAME, EngineAgreement
from dflash_doctor.rundir.status import CheckResult

OVERALL = "overall"  # the summary's scope over every request, next to the per-class scopes
SCHEMA_VERSION = 2  # 2: the typed run record (meta.command/scenario/served_k, source, probes); 1 was the untyped dict

SourceKind = Literal["embedded", "serving-engine", "telemetry"]


COST_SOURCES = ("measured", "profile")


@dataclass(frozen=True)
class StepCosts:
    """Seconds per step: plain decode, and verify / draft at each K that was measured.

    K values between measured ones are linearly interpolated: verify cost grows smoothly with the number
    of tokens verified (memory-bound at small K, compute-bound later) and the draft cost is either flat
    (DFlash) or linear (K autoregressive steps), so a line between neighbours is close and lets a few
    measurements (e.g. K = 1, 2, 4, 8, 16) price the whole sweep. A table with a single K is taken as
    the same cost at every K. Outside the measured range nothing is guessed: asking is a UsageError.
    """

    t_decode_s: float
    t_verify_s: dict[int, float]
    t_draft_s: dict[int, float]
    source: str = "measured"  # measured | profile
    device: str = "unknown"

    def __post_init__(self) -> None:
        if self.source not in COST_SOURCES:
            raise ValueError(f"source must be one of {COST_SOURCES}, got {self.source!r}")
        if not (self.t_decode_s > 0 and self.t_verify_s and self.t_draft_s):
            raise ValueError("StepCosts needs t_decode_s > 0 and at least one K in t_verify_s and t_draft_s")

    def verify_s(self, k: int) -> float:
        return self._at(self.t_verify_s, k, "verify")

    def draft_s(self, k: int) -> float:
        return self._at(self.t_draft_s, k, "draft")

    def speedup(self, tau: float, k: int) -> float:
        """Tokens per second relative to plain decoding; K = 0 (speculation off) is 1 by definition."""
        if k == 0:
            return 1.0
        return tau * self.t_decode_s / (self.draft_s(k) + self.verify_s(k))

    def _at(self, table: dict[int, float], k: int, what: str) -> float:
        if k in table:
            return table[k]
        if len(table) == 1:
            return next(iter(table.values()))
        measured_ks = sorted(table)
        if not measured_ks[0] <= k <= measured_ks[-1]:
            raise UsageError(
                f"the {self.source} step costs ({self.device}) have "
                f"{what} times for K {measured_ks[0]}..{measured_ks[-1]} "
                f"but K={k} was asked; add K={k} to the cost profile or sweep only K in that range."
            )
        return float(np.interp(k, measured_ks, [table[m] for m in measured_ks]))

    def as_dict(self) -> dict[str, Any]:
        """The ``summary.sweep.costs`` block of run.json (JSON object keys are strings)."""
        return {
            "source": self.source,
            "device": self.device,
            "t_decode_s": self.t_decode_s,
            "t_verify_s": {str(k): v for k, v in sorted(self.t_verify_s.items())},
            "t_draft_s": {str(k): v for k, v in sorted(self.t_draft_s.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StepCosts":
        """Inverse of :meth:`as_dict` (for views re-pricing a stored sweep)."""
        return cls(
            t_decode_s=float(data["t_decode_s"]),
            t_verify_s={int(k): float(v) for k, v in data["t_verify_s"].items()},
            t_draft_s={int(k): float(v) for k, v in data["t_draft_s"].items()},
            source=data.get("source", "measured"),
            device=data.get("device", "unknown"),
        )


@dataclass
class Source:
    """Where the steps came from: ``kind`` (see the module docstring), a human ``description``, the
    server ``url`` for a serving engine or telemetry, and producer-specific ``details``."""

    kind: SourceKind = "embedded"
    description: str = "dflash-doctor's embedded speculative engine"
    url: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunMeta:
    """What ran and when. ``served_k`` is the K the user serves (``--k``), when they named one."""

    command: str
    schema_version: int = SCHEMA_VERSION
    tool_version: str = __version__
    created_at: str = ""
    scenario: str | None = None
    served_k: int | None = None
    interrupted: bool = False


@dataclass
class ModelInfo:
    """One model of the pair: identity, how it was loaded, and kind-specific ``facts`` (layer counts,
    block size, target layer ids...) declared by the draft-kind registry. ``facts`` is stored flat
    next to the identity fields in run.json. ``hub_commit`` is the Hugging Face snapshot's commit when
    the model came from the hub cache (``org/name[@revision]``), beside the file hash; None otherwise."""

    id: str
    revision_or_hash: str
    dtype: str
    device: str
    kind: str  # "target", or the draft's kind
    hub_commit: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """Identity first, then the kind-specific facts, flat: what run.json stores and the reports list."""
        identity = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "facts"}
        return {**identity, **self.facts}

    @classmethod
    def from_json(cls, data: Any, where: str = "model") -> "ModelInfo":
        """One ``models`` entry of run.json: the identity fields type-checked, every other key a fact."""
        if not isinstance(data, dict):
            raise ValueError(f"{where} is {_json_kind(data)}, not an object")
        names = {f.name for f in dataclasses.fields(cls)} - {"facts"}
        identity = {k: v for k, v in data.items() if k in names}
        return _from_json(cls, {**identity, "facts": {k: v for k, v in data.items() if k not in names}}, where)


@dataclass
class TauDistribution:
    """Per-request tau (requests that drafted): mean and deciles, next to the pooled headline."""

    mean: float | None
    p10: float | None
    p50: float | None
    p90: float | None


@dataclass
class Metrics:
    """One scope (overall or a class) of the summary, vLLM's counters and definitions
    (:mod:`dflash_doctor.stats.metrics` computes it; intervals bootstrap requests)."""

    num_requests: int
    num_output_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]
    mean_acceptance_length: float | None
    mean_acceptance_length_ci: list[float | None]
    acceptance_rate_per_pos: list[float | None]
    acceptance_rate_per_pos_ci: list[list[float | None]]
    conditional_acceptance_rate_per_pos: list[float | None]
    draft_acceptance_rate: float | None
    acceptance_histogram: list[int]
    request_tau: TauDistribution
    wasted_verify_tokens_per_output_token: float | None


@dataclass
class SweepRow:
    """tau with its interval and the net speedup at one K; ``estimate`` is exact or truncated.

    ``speedup_ci`` resamples the requests and the step timings together (:mod:`dflash_doctor.stats.step_costs`):
    the timing noise that can move the advice is inside it. A cost profile without samples is taken as exact,
    and the interval then covers the requests only."""

    k: int
    mean_acceptance_length: float | None
    mean_acceptance_length_ci: list[float | None]
    speedup: float | None
    estimate: str
    speedup_ci: list[float | None] = field(default_factory=lambda: [None, None])


@dataclass
class Sweep:
    """Every K, overall and per class, priced with ``costs`` (``StepCosts.as_dict``)."""

    overall: list[SweepRow]
    by_class: dict[str, list[SweepRow]]
    costs: dict[str, Any]

    def scopes(self) -> dict[str, list[SweepRow]]:
        """``{"overall": rows, CLASS: rows...}``: overall first, then classes in the order written."""
        return {OVERALL: self.overall, **self.by_class}

    def step_costs(self) -> StepCosts:
        """The step costs the speedups were priced with (``costs`` is their run.json form)."""
        return StepCosts.from_dict(self.costs)


@dataclass
class Summary:
    """The acceptance summary at the replayed K: overall and per request class, plus the K sweep."""

    overall: Metrics | None = None
    by_class: dict[str, Metrics] = field(default_factory=dict)
    sweep: Sweep | None = None

    def scopes(self) -> dict[str, Metrics]:
        """``{"overall": M, CLASS: M...}``: overall first, then classes in name order."""
        return {**({OVERALL: self.overall} if self.overall is not None else {}), **self.by_class}

    def classes_then_overall(self) -> list[tuple[str, Metrics | None]]:
        """``(class, M)`` in class-name order, then ``("overall", M)``: the row order of the reports and
        figures. Overall is None when nothing was summarized (a journal with no finished request)."""
        named: list[tuple[str, Metrics | None]] = [(cls, self.by_class[cls]) for cls in sorted(self.by_class)]
        return [*named, ("overall", self.overall)]

    def drafted_scopes(self) -> list[tuple[str, Metrics]]:
        """:meth:`classes_then_overall` without the scopes that never drafted (their rates are undefined)."""
        return [(name, m) for name, m in self.classes_then_overall() if m is not None and m.num_drafts]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Summary":
        """Parse a run.json ``summary`` (also how :func:`dflash_doctor.stats.metrics.summarize` types its counters)."""
        return _from_json(cls, data)


@dataclass
class Recommendation:
    """The K to serve for one class: the best measured speedup, the smallest K within reach of it, why.

    ``confidence`` says how far the advice holds: ``clear`` when the best K's speedup interval lies wholly
    above 1 (K named) or wholly below (speculation off, ``k`` 0); ``uncertain`` when it includes 1 (``k`` is
    the best K when its point speedup reaches 1, else 0, and the reason says it may not pay);
    ``unreliable`` when the step timings broke the cost model's physics beyond their noise even after a
    re-timing: no advice is given (``k`` 0). ``ks_within_noise``: the Ks whose speedup cannot be told
    from the best one's (a paired interval of their ratio includes 1), the best K among them."""

    k: int
    conservative_k: int
    speedup: float | None
    reason: str
    speedup_ci: list[float | None] = field(default_factory=lambda: [None, None])
    ks_within_noise: list[int] = field(default_factory=list)
    confidence: Literal["clear", "uncertain", "unreliable"] = "clear"


@dataclass
class Divergence:
    """Where the live speculative loop first left the target's own decoding.

    The ``verify_*`` / ``decode_*`` fields: the position scored again on the same committed prefix through the
    live loop's multi-token forwards and through one-token forwards (``kernel_path_evidence`` in
    dflash_doctor/replay/probes.py), each path's top-2 tokens and margin; ``path_disagreement``: the largest
    difference between those two rows of logits (on a hybrid target the two paths run different recurrent
    kernels). None in runs recorded before they were measured, and where the live loop left no steps to follow."""

    request_id: str
    position: int
    speculative_token: int
    plain_token: int
    speculative_text: str
    plain_text: str
    top2_margin: float
    top1_logit: float | None = None  # the target's top logit there: the dtype's rounding is relative to it
    verify_top2: list[int] | None = None
    verify_margin: float | None = None
    decode_top2: list[int] | None = None
    decode_margin: float | None = None
    path_disagreement: float | None = None


@dataclass
class LosslessProbe:
    """The live loop against the target's plain greedy decoding on the first requests (temperature 0;
    see :func:`dflash_doctor.replay.probes.lossless_probe`)."""

    num_requests: int
    num_identical: int
    dtype: str
    divergences: list[Divergence] = field(default_factory=list)
    # the kernels the target computed with (:func:`dflash_doctor.engine.kernels.kernel_paths`); empty in older runs
    kernels: dict[str, str] = field(default_factory=dict)


@dataclass
class PromptFormat:
    """How the workload's prompts reach the target: raw text or chat-templated messages."""

    num_raw_prompts: int
    num_templated: int


@dataclass
class Probes:
    """Measurements beyond the replay that checks judge: lossless decoding, the layer-offset probe
    ({offset: mean acceptance length over every anchor} and the drafts behind offset 0), the prompt format, the served
    target's weights, and the serving engine vs the embedded replay."""

    lossless: LosslessProbe | None = None
    offset_probe: dict[int, float] | None = None
    offset_probe_drafts: int | None = None
    prompt_format: PromptFormat | None = None
    target_weights_fingerprint: str | None = None
    # `check --engine` with a local pair: the server against the embedded replay of the same turns
    # (dflash_doctor/serving/agreement.py summarize_agreement; judged by the engine-agreement check)
    engine_agreement: EngineAgreement | None = None


@dataclass
class RunRecord:
    """Everything a run says, typed. Views and checks read these fields; only :meth:`to_json` and
    :meth:`from_json` know run.json's layout (the meta fields sit at the top level of the file)."""

    meta: RunMeta
    source: Source = field(default_factory=Source)
    models: dict[str, ModelInfo] = field(default_factory=dict)  # "target", "draft"
    environment: dict[str, Any] = field(default_factory=dict)  # versions and hardware (environment.collect_environment)
    config: dict[str, Any] = field(default_factory=dict)  # the resolved DoctorConfig, echoed for reproduction
    summary: Summary = field(default_factory=Summary)
    recommendation: dict[str, Recommendation] = field(default_factory=dict)
    checks: list[CheckResult] = field(default_factory=list)
    probes: Probes = field(default_factory=Probes)

    @property
    def seed(self) -> int:
        """The seed of the summary's bootstrap (the config's; 0 for a producer without one, e.g. ``watch``),
        so a view that recomputes a summary draws the same resamples."""
        return int(self.config.get("seed") or 0)

    def to_json(self) -> dict[str, Any]:
        """The run.json object (NaN becomes null when written: :func:`dflash_doctor.rundir.writer.write_run_json`)."""
        return {
            **_to_json(self.meta),
            "source": _to_json(self.source),
            "models": {name: info.fields() for name, info in self.models.items()},
            "environment": dict(self.environment),
            "config": _to_json(self.config),
            "checks": [c.to_dict() for c in self.checks],
            "summary": _to_json(self.summary),
            "recommendation": _to_json(self.recommendation),
            "probes": _to_json(self.probes),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RunRecord":
        """Parse run.json (already checked for :data:`SCHEMA_VERSION`); a missing section takes its default.

        Every field, nested ones included, is checked against its declared type (null only where the type
        is Optional), so a reader never meets a value of another type: a bad field raises one ValueError
        naming its path (``models.target.revision_or_hash is null, not a string``), which
        :func:`dflash_doctor.rundir.load.read_run_meta` turns into a UsageError naming the file.
        """
        meta_names = {f.name for f in dataclasses.fields(RunMeta)}
        config = _from_json(dict[str, Any], data.get("config", {}), "config")
        seed = config.get("seed")
        if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < _INT_LIMIT):
            # RunRecord.seed seeds the bootstrap of a recomputed summary
            raise ValueError(f"config.seed is {seed!r}, not a non-negative integer")
        models = _from_json(dict[str, Any], data.get("models", {}), "models")
        summary = _from_json(Summary, data.get("summary", {}), "summary")
        if summary.sweep is not None and summary.sweep.costs:
            try:  # the views re-price the sweep with these costs
                summary.sweep.step_costs()
            except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
                raise ValueError(f"summary.sweep.costs is not a step-cost table ({exc})") from None
        return cls(
            meta=_from_json(RunMeta, {k: v for k, v in data.items() if k in meta_names}, ""),
            source=_from_json(Source, data.get("source", {}), "source"),
            models={name: ModelInfo.from_json(info, f"models.{name}") for name, info in models.items()},
            environment=_from_json(dict[str, Any], data.get("environment", {}), "environment"),
            config=config,
            summary=summary,
            recommendation=_from_json(dict[str, Recommendation], data.get("recommendation", {}), "recommendation"),
            checks=_from_json(list[CheckResult], data.get("checks", []), "checks"),
            probes=_from_json(Probes, data.get("probes", {}), "probes"),
        )


# ----------------------------------------------------------------------------- the JSON boundary


def _to_json(value: Any) -> Any:
    """Dataclasses to dicts (None fields of optional sections kept as null), tuples to lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {_json_name(f): _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    return value


def _json_name(f: dataclasses.Field) -> str:
    """A field's run.json key: its name, or the ``json_name`` its metadata gives where the key is no Python name."""
    return f.metadata.get(JSON_NAME, f.name)


# A count, K or seed in run.json fits the int64 the tables and numpy hold; a larger one is no measurement.
_INT_LIMIT = 2**63


def _from_json(kind: Any, value: Any, where: str = "") -> Any:
    """Build ``kind`` (a dataclass, ``list[X]``, ``dict[K, X]``, ``X | None``, a Literal or a scalar type) from
    JSON, checking every value against its declared type on the way; ``where`` is the value's path in run.json,
    named in the ValueError a value of another type raises.

    Null only where the type is Optional; an int stands for a float (JSON writes 2.0 as 2) but a bool never for
    a number, and an integer must fit in int64. NaN passes as a float because
    :func:`dflash_doctor.stats.metrics.summarize` types its undefined ratios through here; a file holding NaN
    is refused where run.json is read (:func:`dflash_doctor.rundir.load.read_run_meta`).
    """
    name = where or "the record"
    origin = get_origin(kind)
    if value is None:
        if kind is Any or (origin in (typing.Union, types.UnionType) and type(None) in get_args(kind)):
            return None
        raise ValueError(f"{name} is null, not {_type_name(kind)}")
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in get_args(kind) if a is not type(None)]
        if dataclasses.is_dataclass(inner) and value == {}:
            return None  # an empty section (a run with no drafted steps has an empty overall block)
        return _from_json(inner, value, where)
    if kind is Any:
        return value
    if origin is Literal:
        if value not in get_args(kind):
            raise ValueError(f"{name} is {value!r}, not {_type_name(kind)}")
        return value
    if not _is_a(kind, value):
        raise ValueError(f"{name} is {_json_kind(value)}, not {_type_name(kind)}")
    if origin is list:
        (item,) = get_args(kind)
        return [_from_json(item, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key, item = get_args(kind)
        return {_key(key, k, name): _from_json(item, v, f"{name}.{k}") for k, v in value.items()}
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):  # the class, never an instance
        hints = get_type_hints(kind)
        fields = {_json_name(f): f for f in dataclasses.fields(kind)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ValueError(f"{name} has no field(s) {unknown}")
        missing = [
            key
            for key, f in fields.items()
            if key not in value and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ValueError(f"{name} lacks the field(s) {missing}")
        prefix = f"{where}." if where else ""
        built = {fields[key].name: _from_json(hints[fields[key].name], v, prefix + key) for key, v in value.items()}
        try:
            return kind(**built)
        except ValueError as exc:  # the dataclass's own check (a check status, a finding severity)
            raise ValueError(f"{name}: {exc}") from None
    return float(value) if kind is float else value


def _is_a(kind: Any, value: Any) -> bool:
    """Whether a JSON ``value`` has the shape of ``kind`` (its items are checked by :func:`_from_json`)."""
    origin = get_origin(kind) or kind
    if origin is bool or isinstance(value, bool):
        return origin is bool and isinstance(value, bool)
    if origin in (int, float) and isinstance(value, int):
        return -_INT_LIMIT < value < _INT_LIMIT
    if origin is float:
        return isinstance(value, float)
    if dataclasses.is_dataclass(origin):
        return isinstance(value, dict)
    if origin in (int, list, dict, str):
        return isinstance(value, origin)
    raise TypeError(f"run.json has no reader for the type {kind!r}")  # a field type this module cannot check


def _key(kind: Any, key: Any, where: str) -> Any:
    """A JSON object key as ``kind`` (int keys are written as strings of ASCII digits)."""
    if kind is int:
        text = str(key)
        if isinstance(key, bool) or not (text.removeprefix("-").isascii() and text.removeprefix("-").isdigit()):
            raise ValueError(f"{where} has the key {key!r}, not an integer")
        return int(text)
    if not isinstance(key, str):
        raise ValueError(f"{where} has the key {key!r}, not a string")
    return key


def _type_name(kind: Any) -> str:
    """``kind`` in the words of an error sentence."""
    origin = get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(kind) if a is not type(None)) + " or null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(kind))
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "true or false",
        list: "a list",
        dict: "an object",
    }
    return names.get(origin or kind, "an object")


def _json_kind(value: Any) -> str:
    """What a JSON value is, for an error sentence (a short value is quoted, a container named)."""
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = repr(value)
    return text if len(text) <= 40 else f"{type(value).__name__} {text[:37]}..."
