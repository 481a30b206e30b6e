"""The check registry: what a check is, what it receives, what it returns, and how a set of them runs.

A check is one small file holding a frozen dataclass whose fields are its parameters (thresholds with
defaults), a docstring saying which failure it detects and why that failure matters, ``needs`` (the
:class:`CheckContext` fields it cannot work without) and ``run(ctx) -> CheckResult``. It returns data and
never prints: the terminal, the reports and run.json are views of the same :class:`CheckResult`.

:func:`run_checks` is the one runner. A check whose inputs are absent is marked ``skip`` with the missing
inputs named; a check that raises is marked ``error`` with the exception text, and the others still run,
so a report always renders (the evidently / lm-evaluation-harness habit).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping, TypeVar

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.validation import finite_number, type_error
from dflash_doctor.rundir.run_record import RunRecord
from dflash_doctor.rundir.status import (  # noqa: F401 (re-exported: checks import their vocabulary from here)
    SEVERITIES,
    STATUSES,
    VERDICT_NONE,
    CheckResult,
    Finding,
    Status,
    overall_status,
    worst_severity,
)


@dataclass(frozen=True)
class Need:
    """An input whose absence the check explains in its own sentence rather than the runner's
    "needs <path>": the run was fine, it just did not produce this probe (no ``--engine`` pair, a sampled
    run without the lossless comparison), and the skip should say so."""

    path: str  # as in ``Check.needs``: a dotted path into CheckContext, "a|b" for either
    skip_reason: str


@dataclass
class CheckContext:
    """Everything a check may read. All fields are optional: a check names the ones it ``needs``.

    Tokenizers are transformers tokenizers; ``target_config`` is a ``PretrainedConfig`` or a dict;
    ``draft_config`` is the draft checkpoint's ``config.json`` as a dict; ``engine_config`` is the output
    of :func:`dflash_doctor.inputs.server_config.parse_server_config`; ``record`` is the typed run record
    (summary, recommendation, probes, models): checks read its named fields, so a renamed field fails the
    type checker and the check tests instead of silently reading nothing.
    """

    target_tokenizer: Any = None
    draft_tokenizer: Any = None
    target_config: Any = None
    draft_config: dict[str, Any] | None = None
    draft_kind: str | None = None  # dflash | autoregressive
    environment: dict[str, Any] | None = None
    engine_config: dict[str, Any] | None = None
    corpus: list[str] | None = None  # workload texts for round-trips
    target_template: str | None = None  # the chat template the server renders prompts with
    draft_template: str | None = None  # the chat template shipped with the draft
    draft_training_template: str | None = None  # the template the draft was trained with, when recorded
    record: RunRecord | None = None
    config: Any = None  # DoctorConfig
    output_token_ids_by_class: dict[str, list[int]] | None = (
        None  # ids the target produced in the run, per request class
    )
    draft_weight_shapes: dict[str, list[int]] | None = None  # tensor name (no "model." prefix) -> shape

    @property
    def output_token_ids(self) -> list[int] | None:
        """Every id the target produced in the run, all classes together (None when the run gave none)."""
        by_class = self.output_token_ids_by_class
        return None if by_class is None else [token for ids in by_class.values() for token in ids]

    def value(self, path: str) -> Any:
        """The input at a dotted ``path`` ("record.probes.lossless"); None when any step on the way is None."""
        value: Any = self
        for name in path.split("."):
            if value is None:
                return None
            value = getattr(value, name)
        return value

    def missing(self, needs: Iterable[str | Need]) -> list[str]:
        """The needs that are absent; an entry ``"a|b"`` is satisfied by either path."""
        absent = []
        for need in needs:
            alternatives = (need.path if isinstance(need, Need) else need).split("|")
            if all(_is_absent(self.value(path)) for path in alternatives):
                absent.append(" or ".join(alternatives))
        return absent


def _is_absent(value: Any) -> bool:
    return value is None or (isinstance(value, (dict, list, str, tuple)) and len(value) == 0)


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a ``PretrainedConfig`` or a dict (target configs come in both forms)."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


class Check:
    """Base of every check; subclasses are frozen dataclasses registered with :func:`register`.

    Class attributes: ``id`` (kebab-case, stable: it is stored in run.json and named by --only/--skip),
    ``needs`` (every input the check cannot work without, as dotted paths into :class:`CheckContext`:
    ``"draft_config"``, ``"record.probes.lossless"``; ``"a|b"`` for either; a :class:`Need` where the
    check words the skip itself) and ``title``.
    """

    id: ClassVar[str] = ""
    title: ClassVar[str] = ""
    needs: ClassVar[tuple[str | Need, ...]] = ()
    # Every registered check is a dataclass (register() refuses others); declared so that type checkers
    # accept a check class where dataclasses.fields() wants one.
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def run(self, ctx: CheckContext) -> CheckResult:  # pragma: no cover - abstract
        raise NotImplementedError


CheckT = TypeVar("CheckT", bound="type[Check]")
_REGISTRY: dict[str, type[Check]] = {}


def register(cls: CheckT) -> CheckT:
    """Class decorator: add a check class to the registry; a second class with the same id is refused."""
    check_id = getattr(cls, "id", "")
    if not check_id:
        raise ValueError(f"{cls.__name__} has no `id`; give the check a kebab-case id")
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"check {check_id!r} must be a (frozen) dataclass so its parameters are declared fields")
    if check_id in _REGISTRY and _REGISTRY[check_id] is not cls:
        raise ValueError(f"check id {check_id!r} is already registered by {_REGISTRY[check_id].__qualname__}")
    _REGISTRY[check_id] = cls
    return cls


def registered_ids() -> list[str]:
    """All registered check ids, in registration order."""
    return list(_REGISTRY)


def _did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}? " if close else ""


def get_check(check_id: str) -> type[Check]:
    """The check class for ``check_id``; an unknown id is a UsageError suggesting the closest id."""
    try:
        return _REGISTRY[check_id]
    except KeyError:
        hint = _did_you_mean(check_id, _REGISTRY)
        raise UsageError(f"unknown check {check_id!r}; {hint}pick one of {', '.join(_REGISTRY)}.") from None


def make_check(check_id: str, params: Mapping[str, Any] | None = None) -> Check:
    """Instantiate a check with parameter overrides; an unknown parameter names the check and the valid ones."""
    cls = get_check(check_id)
    params = dict(params or {})
    names = [f.name for f in dataclasses.fields(cls)]
    for key in params:
        if key not in names:
            hint = _did_you_mean(key, names)
            valid = ", ".join(names) if names else "none"
            raise UsageError(f"check {check_id!r} has no parameter {key!r}; {hint}valid parameters: {valid}.")
    declared = typing.get_type_hints(cls)
    for key, value in params.items():
        expected = type_error(value, declared[key])
        if expected is not None:
            raise UsageError(
                f"check {check_id!r} parameter {key!r} is {value!r}, "
                f"but it must be {expected}; fix [checks.{check_id}]."
            )
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # A check's numbers are thresholds, shares and counts, all >= 0; nan compares false with
            # everything, so `tau < nan` never fails a run and the gate is silently off (inf likewise).
            finite_number(value, f"check {check_id!r} parameter {key!r}", minimum=0, fix=f"fix [checks.{check_id}]")
    return cls(**params)


def validate_check_params(tables: Mapping[str, Any], only: Iterable[str] = (), skip: Iterable[str] = ()) -> None:
    """Refuse an unknown check id in ``only`` / ``skip``, or a ``[checks.<id>]`` table with an unknown check,
    an unknown parameter or a value of the wrong type, before any work (a command calls it first: the
    checks themselves run after the whole replay)."""
    for check_id in [*only, *skip]:
        get_check(check_id)
    for check_id, params in tables.items():
        if not isinstance(params, Mapping):
            raise UsageError(
                f"[checks.{check_id}] must be a table of parameters, not {params!r}; write it as a TOML table."
            )
        make_check(check_id, params)


def run_checks(
    ctx: CheckContext,
    only: Iterable[str] = (),
    skip: Iterable[str] = (),
    params: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[CheckResult]:
    """Run the registered checks (or ``only`` those, minus ``skip``) and return one result each.

    Parameters come from ``ctx.config.checks[id]`` (the ``[checks.<id>]`` tables of doctor.toml) with
    ``params[id]`` on top (the CLI). Unknown ids anywhere are a UsageError with "did you mean".
    """
    only, skip = list(only), list(skip)
    file_params = dict(getattr(ctx.config, "checks", None) or {})
    call_params = dict(params or {})
    for check_id in [*only, *skip, *file_params, *call_params]:
        get_check(check_id)
    selected = [c for c in (only or registered_ids()) if c not in skip]
    results = []
    for check_id in selected:
        merged = {**file_params.get(check_id, {}), **call_params.get(check_id, {})}
        check = make_check(check_id, merged)
        results.append(run_one(check, ctx))
    return results


def run_one(check: Check, ctx: CheckContext) -> CheckResult:
    """Run a single check instance: ``skip`` when its needs are absent (in the check's own words for a
    :class:`Need`), ``error`` when it raises."""
    try:
        for need in check.needs:
            if isinstance(need, Need) and ctx.missing([need]):
                return skipped(check.id, need.skip_reason)
        absent = ctx.missing(check.needs)
        if absent:
            return CheckResult(check.id, "skip", f"skipped: needs {', '.join(absent)}", {"missing": absent})
        return check.run(ctx)
    except UsageError:
        raise
    except Exception as exc:  # a bug or an unexpected input in one check must not hide the others
        return CheckResult(check.id, "error", f"{type(exc).__name__}: {exc}", {"exception": type(exc).__name__})


def exit_code(results: Iterable[CheckResult], fail_on: str = "fail") -> int:
    """The exit codes (docs/user-guide.md#exit-codes) from :func:`overall_status`: 1 when the verdict is ``fail`` or
    ``error`` (or ``warn`` with ``fail_on="warn"``), else 0."""
    bad = {Status.FAIL, Status.ERROR} | ({Status.WARN} if fail_on == "warn" else set())
    return 1 if overall_status(r.status for r in results) in bad else 0


def skipped(check_id: str, reason: str) -> CheckResult:
    """A ``skip`` result decided inside a check (an input is present but unusable for this check)."""
    return CheckResult(check_id, "skip", f"skipped: {reason}")
