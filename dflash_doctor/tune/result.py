"""The result of a tune run, typed: one :class:`TuneResult`, written once as ``tune.json`` and read back by every view.

:func:`dflash_doctor.tune.experiment.run_tune` builds it once from what the analysis, the cost fit, the
prediction and the recommendation found; :meth:`TuneResult.to_json` and :meth:`TuneResult.from_json` are the
only places that know tune.json's layout, and :func:`read_tune_result` is how the dashboard reads a file
(a bad or old one is a UsageError naming the file and the fix, as :func:`dflash_doctor.rundir.load.read_run_meta`
answers for run.json).

tune.json is the contract, so a result reads back to the same bytes: a figure a cell never had is left out
of its object (not written null), and a record that may lack keys (:class:`Cell`, :class:`GridRecord`,
:class:`ServerFacts`) keeps the order its keys were written in (a cell whose figures came from the
``/metrics`` counters lists them after the others); an absent figure reads as None. A load level keeps its
JSON form: a concurrency (int), a request rate (float) or "inf" (all at once). Nothing here imports torch:
a monitoring install renders tune runs (tests/test_light_install.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.tables import TUNE_JSON
from dflash_doctor.tune.loads import LOAD_KINDS
from dflash_doctor.tune.prediction import FittedCosts

TUNE_SCHEMA_VERSION = 1

Load = Union[int, float, str]  # a concurrency, a request rate, or "inf": a request rate of all at once
Interval = list[float | None]  # a 95% interval, [low, high]; null where the bootstrap had no figure


@dataclass(frozen=True)
class Cell:
    """The measured figures of one (load, K, scope) (:func:`dflash_doctor.tune.analysis.analyse`): a figure the
    cell lacks is None (tau and rollback where the engine reported no drafts, the run-level figures outside the
    overall scope, ``acceptance_from`` unless the /metrics counters filled tau in)."""

    load_kind: str  # the JSON key the load is written under: concurrency or request_rate
    load: Load
    k: int
    scope: str
    num_requests: int
    num_output_tokens: int
    ttft_s: float | None = None
    ttft_s_ci: Interval | None = None
    e2e_s: float | None = None
    e2e_s_ci: Interval | None = None
    tpot_s: float | None = None
    tpot_s_ci: Interval | None = None
    tau: float | None = None
    tau_ci: Interval | None = None
    rollback_per_token: float | None = None
    rollback_per_token_ci: Interval | None = None
    step_s: float | None = None
    speedup: float | None = None
    speedup_ci: Interval | None = None
    per_request: dict[str, list[Any]] | None = None  # what the cost fit resamples (overall scope)
    output_tokens_per_s: float | None = None
    requests_per_s: float | None = None
    wall_s: float | None = None
    throughput_speedup: float | None = None
    acceptance_from: str | None = None
    keys: tuple[str, ...] = field(default=(), repr=False)  # the JSON keys in their written order

    @classmethod
    def from_json(cls, data: Any, where: str) -> Cell:
        return _read_loaded(cls, data, where)

    def to_json(self) -> dict[str, Any]:
        return _write_loaded(self)


@dataclass(frozen=True)
class PredictionRow:
    """Predicted against measured at one (load, K > 0, scope) (:func:`dflash_doctor.tune.prediction.predict`)."""

    load_kind: str
    load: Load
    k: int
    scope: str
    held_out: bool
    predicted_tau: float
    measured_tau: float | None
    measured_tau_ci: Interval | None
    predicted_speedup: float
    predicted_speedup_ci: Interval | None
    measured_speedup: float | None
    measured_speedup_ci: Interval | None
    speedup_error: float | None
    speedup_relative_error: float | None
    tau_error: float | None
    tau_relative_error: float | None
    predicted_step_s: float
    measured_step_s: float | None
    step_relative_error: float | None
    definition_gap: float | None
    within_interval: bool | None
    prediction_within_measured_interval: bool | None
    predicted_pays: bool | None
    measured_pays: bool | None

    @classmethod
    def from_json(cls, data: Any, where: str) -> PredictionRow:
        return _read_loaded(cls, data, where)

    def to_json(self) -> dict[str, Any]:
        return _write_loaded(self)


@dataclass(frozen=True)
class Pick:
    """The recommendation of one load and scope (:func:`dflash_doctor.tune.advice.recommend_grid`): the
    recommender's :class:`~dflash_doctor.rundir.run_record.Recommendation` and the verdict read off the intervals."""

    k: int
    conservative_k: int
    speedup: float | None
    reason: str
    speedup_ci: Interval
    ks_within_noise: list[int]
    confidence: str
    verdict: str


@dataclass(frozen=True)
class ServerFacts:
    """What a server said about itself at one K; ``warning`` where that puts its figures in doubt."""

    k: int
    url: str
    model: str | None
    launched: str | None
    engine_num_spec_tokens: list[int]
    acceptance_from: str
    repeat: int
    warning: str | None = None
    keys: tuple[str, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class GridRecord:
    """What was measured: the K grid, the loads (``burstiness`` and ``max_concurrency`` for request rates only),
    the K the costs were fitted from and the requests per cell."""

    k: list[int]
    loads: list[Load]
    fit_k: list[int]
    num_requests: int
    burstiness: float | None = None
    max_concurrency: int | None = None
    keys: tuple[str, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class TuneResult:
    """Everything a tune run found. ``fits``, ``recommendation``, ``baseline_drift`` and ``cost_profiles`` are
    keyed by the load as :func:`dflash_doctor.tune.loads.load_text` writes it; ``recommendation`` then by scope."""

    schema_version: int
    tool_version: str
    created_at: str
    config: dict[str, Any]
    grid: GridRecord
    baseline_drift: dict[str, float]
    servers: list[ServerFacts]
    cells: list[Cell]
    fits: dict[str, FittedCosts]
    prediction: list[PredictionRow]
    held_out_error: float | None
    recommendation: dict[str, dict[str, Pick]]
    engine_settings: dict[str, str]
    cost_profiles: dict[str, str]
    sweep_dir: str

    @property
    def load_kind(self) -> str:
        """The run's kind of load (every level of a run is of one kind)."""
        return self.cells[0].load_kind

    @classmethod
    def from_json(cls, data: Any) -> TuneResult:
        """Parse tune.json's object, every value checked against its declared type: a value of another type
        raises one ValueError naming its path (``cells[3].tau is 'x', not a number``)."""
        result = _read(cls, data, "")
        if not result.cells:
            raise ValueError("cells is an empty list: a tune run measures at least one cell")
        return result

    def to_json(self) -> dict[str, Any]:
        """tune.json's object (strict JSON: ``json.dumps(..., allow_nan=False)`` writes it)."""
        return _plain(self)


def read_tune_result(run_dir: Path | str) -> TuneResult:
    """``run_dir``'s tune.json, typed; a missing, unreadable, older or malformed file is a UsageError naming it."""
    run_dir = Path(run_dir)
    path = run_dir / TUNE_JSON
    if not path.is_file():
        raise UsageError(
            f"{run_dir} is not a tune run directory (no {TUNE_JSON}); pass a folder written by `dflash-doctor tune`."
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UsageError(f"{path} is not readable JSON ({exc}); re-run `dflash-doctor tune` to rewrite it.") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != TUNE_SCHEMA_VERSION:
        older = version is None or (isinstance(version, int) and version < TUNE_SCHEMA_VERSION)
        raise UsageError(
            f"{path} has schema_version {version!r} but this dflash-doctor reads {TUNE_SCHEMA_VERSION}; "
            + (
                "re-run `dflash-doctor tune` to rewrite it."
                if older
                else "read it with the dflash-doctor version that wrote it."
            )
        )
    try:
        return TuneResult.from_json(data)
    except RecursionError:
        raise UsageError(
            f"{path} nests its values too deeply for a tune result; re-run `dflash-doctor tune`."
        ) from None
    except ValueError as exc:
        detail = " ".join(str(exc).split())[:200]
        raise UsageError(
            f"{path} has a field of the wrong shape or type ({detail}); re-run `dflash-doctor tune` to rewrite it."
        ) from None


# ----------------------------------------------------------------------------- the JSON boundary


def _plain(value: Any) -> Any:
    """A record as JSON values: a record with ``keys`` writes those keys in that order, another every field."""
    if isinstance(value, (Cell, PredictionRow)):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = getattr(value, "keys", None) or [f.name for f in dataclasses.fields(value) if f.name != "keys"]
        return {name: _plain(getattr(value, name)) for name in names}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _read(kind: Any, data: Any, where: str, **known: Any) -> Any:
    """A record of dataclass ``kind`` from a JSON object, every value checked (:func:`_checked`), ``known`` fields
    given; a record with a ``keys`` field remembers the order of the keys it was given."""
    name = where or "tune.json"
    if not isinstance(data, dict):
        raise ValueError(f"{name} is {_what(data)}, not an object")
    fields = {f.name: f for f in dataclasses.fields(kind) if f.name != "keys" and f.name not in known}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{name} has no field(s) {unknown}")
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{name} lacks the field(s) {missing}")
    hints = get_type_hints(kind)
    prefix = f"{where}." if where else ""
    values = {key: _checked(hints[key], value, prefix + key) for key, value in data.items()} | known
    if "keys" in {f.name for f in dataclasses.fields(kind)}:
        values["keys"] = tuple(data)
    return kind(**values)


def _read_loaded(kind: Any, data: Any, where: str) -> Any:
    """A cell or prediction row: its load, written under its kind's name, read into ``load_kind`` and ``load``."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} is {_what(data)}, not an object")
    named = [key for key in LOAD_KINDS if key in data]
    if len(named) != 1:
        raise ValueError(f"{where} names its load under {named or 'none'} of {list(LOAD_KINDS)}, not one")
    renamed = {("load" if key == named[0] else key): value for key, value in data.items()}
    return _read(kind, renamed, where, load_kind=named[0])


def _write_loaded(record: Cell | PredictionRow) -> dict[str, Any]:
    fields = record.keys if isinstance(record, Cell) else [f.name for f in dataclasses.fields(record)][1:]
    return {(record.load_kind if name == "load" else name): _plain(getattr(record, name)) for name in fields}


def _checked(kind: Any, value: Any, where: str) -> Any:
    """``value`` if it is a JSON value of ``kind`` (a record, list, dict, union or scalar type), as it was (an
    int stays an int where a float may stand, so the file reads back to its bytes); else a ValueError."""
    origin = get_origin(kind)
    if kind is Any:
        return value
    if origin in (Union, types.UnionType):
        for option in get_args(kind):
            if option is type(None) and value is None:
                return None
            if option is not type(None):
                try:
                    return _checked(option, value, where)
                except ValueError:
                    continue
        raise ValueError(f"{where} is {_what(value)}, not {_named(kind)}")
    if dataclasses.is_dataclass(kind):
        reader = getattr(kind, "from_json", None)
        return reader(value, where) if reader is not None else _read(kind, value, where)
    if origin in (list, tuple) and isinstance(value, list):
        item = get_args(kind)[0]
        items = [_checked(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict and isinstance(value, dict):
        item = get_args(kind)[1]
        return {key: _checked(item, v, f"{where}.{key}") for key, v in value.items()}
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return value
    if kind in (int, str, bool) and isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise ValueError(f"{where} is {_what(value)}, not {_named(kind)}")


def _named(kind: Any) -> str:
    """``kind`` in the words of an error sentence."""
    if get_origin(kind) in (Union, types.UnionType):
        return " or ".join(_named(a) for a in get_args(kind))
    names = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false", type(None): "null"}
    return names.get(kind, "a list" if get_origin(kind) in (list, tuple) else "an object")


def _what(value: Any) -> str:
    """What a JSON value is, for an error sentence."""
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = repr(value)
    return text if len(text) <= 40 else f"{type(value).__name__} {text[:37]}..."
