"""Several speculators on the same prompts and target: tau, priced speedup at each one's best K, the
per-position curves side by side, and per class which one to deploy and by how much it wins.

Inputs are each speculator's finished ``check``: its run record (tau and its interval per K from the
sweep, the per-position rates) and its steps at every K. The verdict rests on a speedup priced the
same way for every speculator (docs/speculators.md):

* Every step costs the speculator's own draft time at K plus the target's verify time for the tokens
  it *really* drafted; a step that drafted nothing (an n-gram lookup without a match) is a plain
  decode step - the pricing of every sweep (:class:`dflash_doctor.stats.speedup.StepPrices`), so a
  speculator's row here and its own check's sweep agree when they share costs.
* The target's decode and verify times come from one speculator's timing (the one that timed the
  largest K) for all of them, so timing noise between runs does not decide the verdict; each keeps its
  own draft time. Costs are the fitted model of :mod:`dflash_doctor.stats.step_costs`.
* ``speedup(K) = tokens emitted x t_decode / time of the steps``, summed over the scope's conversations.
* Best K: the highest point speedup (the smaller K on a tie).
* Intervals: percentile bootstrap over conversations (the turns of one conversation are not independent)
  and the step timings together, *paired*: one draw of conversations and one draw of the target's
  timings price every speculator, so the ratio leader / runner-up has an interval of its own. "deploy X"
  is said only when that interval lies above 1, X's own speedup interval lies above plain decoding's
  1.0x, and the scope holds at least :data:`MIN_CONVERSATIONS` conversations and :data:`MIN_DRAFTS`
  drafted steps of the leader; otherwise the verdict says "no clear winner" or "too few requests".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.run_record import OVERALL, RunRecord, StepCosts, _from_json, _to_json
from dflash_doctor.rundir.tables import HEAD_TO_HEAD_JSON
from dflash_doctor.stats.metrics import NUM_BOOTSTRAP_RESAMPLES, group_rng, interval, resample_multiplicities
from dflash_doctor.stats.speedup import StepPrices, UnitSteps, max_drafted, units_of
from dflash_doctor.stats.step_costs import CostSamples, cost_replicates, fitted_costs, resampled_medians


@dataclass(frozen=True)
class Contender:
    """One speculator's finished run: its name in the table, its record and its steps at every K."""

    name: str
    record: RunRecord
    steps_by_k: Mapping[int, pd.DataFrame]
    cost_samples: CostSamples | None = None  # the check's raw step timings (None: priced with a cost profile)
    run_dir: Path | None = None  # its sub-run's folder, which the pages link to


@dataclass(frozen=True)
class ContenderRow:
    """One speculator in one scope, at its best K."""

    speculator: str
    best_k: int
    tau: float | None
    tau_ci: list[float | None]
    speedup: float
    speedup_ci: list[float]
    speedup_by_k: dict[int, float]
    acceptance_rate_per_pos: list[float | None]  # unconditional, at the run's largest K
    num_drafts: int


@dataclass(frozen=True)
class DeploySettings:
    """What to type in each engine to serve a verdict's leader (``settings``: engine -> setting) at
    ``settings_k``, and what the DRAFT placeholder stands for (``draft_shown``). Read from the sub-runs when
    the head-to-head is written, so it is absent for a leader whose sub-run has no run.json."""

    settings: dict[str, str]
    settings_k: int
    draft_shown: str


@dataclass(frozen=True)
class Verdict:
    """Which speculator to deploy in a scope: ``winner`` (the leader; None: none beats plain decoding), the
    ratio of its speedup to the runner-up's with a paired interval, and ``decisive``: whether the advice
    is clear (the ratio's and the leader's own intervals clear 1, on enough conversations)."""

    winner: str | None
    runner_up: str | None
    ratio: float | None
    ratio_ci: list[float] | None
    decisive: bool
    text: str
    deploy: DeploySettings | None = None  # stored flat beside the fields above


@dataclass(frozen=True)
class ScopeResult:
    rows: list[ContenderRow]
    verdict: Verdict


@dataclass(frozen=True)
class CostSpread:
    """The 95% bootstrap intervals of the shared costs (present when the costs were timed here, not a profile)
    and the timings that broke the cost model's physics."""

    t_decode_s_ci: list[float]
    t_verify_s_ci: dict[int, list[float]]
    t_draft_s_ci: dict[str, dict[int, list[float]]]  # speculator -> K -> interval
    timing_violations: list[str]


@dataclass(frozen=True)
class SharedCosts:
    """The costs every speedup was priced with: the target's decode and verify times (shared by all
    speculators) and each speculator's own draft time per K, with their spread when timed here."""

    source: str
    device: str
    t_decode_s: float
    t_verify_s: dict[int, float]
    t_draft_s: dict[str, dict[int, float]]  # speculator -> K -> seconds
    spread: CostSpread | None = None  # stored flat beside the fields above


@dataclass(frozen=True)
class SubRunCheck:
    id: str
    status: str
    summary: str


@dataclass(frozen=True)
class SubRun:
    """What the pages show of a speculator's own check, read from its run.json when the head-to-head is
    written (paths relative to the head-to-head folder): its verdict word and flagged checks, report, command,
    date, machine and tool version."""

    folder: str
    report: str
    command: str
    created_at: str
    machine: str
    tool_version: str
    verdict: str
    flagged: list[str]
    checks: list[SubRunCheck]
    draft_shown: str


@dataclass(frozen=True)
class Speculator:
    """One speculator of the head-to-head: its table name, draft and kind, its sub-run's folder (``run_dir``;
    None in a head-to-head built without one) and that sub-run's facts (None when it has no run.json)."""

    name: str
    draft: str
    kind: str
    run_dir: str | None = None
    sub_run: SubRun | None = None  # stored flat beside the fields above


@dataclass(frozen=True)
class HeadToHead:
    """The head-to-head as ``head_to_head.json`` holds it: only :meth:`to_json` and :meth:`from_json` know
    that layout (groups of optional keys stored flat beside their parent's fields); every view reads this."""

    speculators: list[Speculator]
    costs: SharedCosts
    scopes: dict[str, ScopeResult]

    def to_json(self) -> dict[str, Any]:
        """The JSON form, key for key in the order head_to_head.json has always had.

        Returns:
            A dict for :func:`json.dumps`; an absent optional group leaves out its keys.
        """
        return {
            "speculators": [_flat(s, "sub_run") for s in self.speculators],
            "costs": _flat(self.costs, "spread"),
            "scopes": {
                name: {"rows": [_to_json(row) for row in scope.rows], "verdict": _flat(scope.verdict, "deploy")}
                for name, scope in self.scopes.items()
            },
        }

    @classmethod
    def from_json(cls, data: Any) -> "HeadToHead":
        """Parse the JSON form, every field checked against its declared type.

        Args:
            data: head_to_head.json's content, as :func:`json.loads` gives it.

        Returns:
            The typed head-to-head.

        Raises:
            ValueError: one sentence naming the path of a missing, unknown or mistyped field
                (:func:`read_head_to_head` turns it into a UsageError naming the file).
        """
        top = _object(data, "the head-to-head", ("speculators", "costs", "scopes"))
        speculators = _from_json(list[dict[str, Any]], top["speculators"], "speculators")
        scopes = _from_json(dict[str, dict[str, Any]], top["scopes"], "scopes")
        return cls(
            speculators=[
                _grouped(Speculator, s, f"speculators[{i}]", "sub_run", SubRun) for i, s in enumerate(speculators)
            ],
            costs=_grouped(SharedCosts, top["costs"], "costs", "spread", CostSpread),
            scopes={name: _scope_from_json(scope, f"scopes.{name}") for name, scope in scopes.items()},
        )


def _scope_from_json(data: dict[str, Any], where: str) -> ScopeResult:
    scope = _object(data, where, ("rows", "verdict"))
    return ScopeResult(
        rows=_from_json(list[ContenderRow], scope["rows"], f"{where}.rows"),
        verdict=_grouped(Verdict, scope["verdict"], f"{where}.verdict", "deploy", DeploySettings),
    )


def _object(data: Any, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """``data`` as an object with exactly ``keys``, else a ValueError naming ``where``."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} is not an object")
    if set(data) != set(keys):
        raise ValueError(f"{where} has the keys {sorted(data)}, not {list(keys)}")
    return data


def _flat(value: Any, group: str) -> dict[str, Any]:
    """A dataclass as JSON with its optional ``group`` field's keys stored flat after the others (none when it
    is None): head_to_head.json's layout since the sub-run facts and engine settings were added to it."""
    data = _to_json(value)
    inner = data.pop(group)
    return {**data, **(inner or {})}


def _grouped(kind: Any, data: Any, where: str, group: str, group_kind: Any) -> Any:
    """Parse an object holding ``kind``'s fields and, all or none of them, ``group_kind``'s fields stored flat
    beside them (the inverse of :func:`_flat`)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} is not an object")
    if group in data:
        raise ValueError(f"{where} has no field(s) {[group]}")
    names = {f.name for f in fields(group_kind)}
    inner = {k: v for k, v in data.items() if k in names}
    built = _from_json(kind, {k: v for k, v in data.items() if k not in names}, where)
    return replace(built, **{group: _from_json(group_kind, inner, where)}) if inner else built


def read_head_to_head(folder: Path | str) -> HeadToHead:
    """Read and type a head-to-head folder's ``head_to_head.json``: the one reader of the report, the dashboard
    and the tests.

    Args:
        folder: the folder ``check --draft A --draft B ...`` wrote.

    Returns:
        The typed head-to-head.

    Raises:
        UsageError: the file is missing, not JSON, or has a field of the wrong shape or type (one written by
            another version of dflash-doctor): one sentence naming the file and the fix.
    """
    path = Path(folder) / HEAD_TO_HEAD_JSON
    rerun = "re-run the `dflash-doctor check --draft A --draft B ...` that wrote it."
    if not path.is_file():
        raise UsageError(
            f"{folder} holds no {HEAD_TO_HEAD_JSON}; pass a folder "
            "written by `dflash-doctor check --draft A --draft B ...`."
        )
    try:
        return HeadToHead.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is not valid JSON ({exc}); {rerun}") from None
    except RecursionError:
        raise UsageError(f"{path} nests its values too deeply for a head-to-head; {rerun}") from None
    except ValueError as exc:
        detail = " ".join(str(exc).split())[:200]
        raise UsageError(f"{path} has a field of the wrong shape or type ({detail}); {rerun}") from None


def _widest(costs: Sequence[StepCosts]) -> int:
    """The speculator whose check timed verification up to the largest K (the first of those): its target
    times are shared, so a speculator priced at a larger K than another's block still finds its verify time."""
    return max(range(len(costs)), key=lambda i: max(costs[i].t_verify_s))


def _shared_costs(costs: Sequence[StepCosts]) -> list[StepCosts]:
    """Each speculator's costs with one set of decode and verify times: the target's, the same for all of
    them, taken from :func:`_widest`; each keeps its own draft times."""
    base = costs[_widest(costs)]
    return [
        StepCosts(
            t_decode_s=base.t_decode_s,
            t_verify_s=base.t_verify_s,
            t_draft_s=c.t_draft_s,
            source=c.source,
            device=c.device,
        )
        for c in costs
    ]


def _shared_samples(contenders: Sequence[Contender], widest: int) -> list[CostSamples] | None:
    """The raw timings behind :func:`_shared_costs`: the target's decode and verify samples of the ``widest``
    speculator, each speculator's own draft samples. None when any speculator was priced with a cost profile
    (no samples: the costs are taken as exact)."""
    samples = [c.cost_samples for c in contenders]
    base = samples[widest]
    if base is None or any(s is None for s in samples):
        return None
    target = {key: v for key, v in base.seconds.items() if key[0] != "draft"}
    return [
        replace(s, seconds={**target, **{key: v for key, v in s.seconds.items() if key[0] == "draft"}})
        for s in samples
        if s is not None
    ]


def _cost_models(
    contenders: Sequence[Contender], n_boot: int, seed: int
) -> tuple[list[StepCosts], list[list[StepCosts]] | None]:
    """Each speculator's point costs and, when timed here, ``n_boot`` replicates per speculator: one draw of the
    target's decode and verify times shared by all of them (paired), its own draws of its draft time."""
    own = [c.record.summary.sweep.step_costs() for c in contenders]  # type: ignore[union-attr]
    samples = _shared_samples(contenders, _widest(own))
    if samples is None:
        return _shared_costs(own), None
    rng = group_rng(seed, "head-to-head:timing")
    target = resampled_medians({key: v for key, v in samples[0].seconds.items() if key[0] != "draft"}, n_boot, rng)
    return [fitted_costs(s) for s in samples], [cost_replicates(s, n_boot, rng, shared=target) for s in samples]


def _scope_steps(steps: pd.DataFrame, scope: str) -> pd.DataFrame:
    return steps if scope == OVERALL else steps[steps["class"] == scope]


def build_head_to_head(
    contenders: Sequence[Contender], *, n_boot: int = NUM_BOOTSTRAP_RESAMPLES, seed: int = 0
) -> HeadToHead:
    """The table and the verdicts, overall and per class (the classes every contender ran).

    Every speculator is priced with one paired draw of the widest contender's timing, so the ratio of two
    speedups carries no timing noise the two do not share.

    Args:
        contenders: the speculators' sub-runs (record, steps per K, cost samples, folder), at least two.
        n_boot: bootstrap resamples behind every interval.
        seed: seeds the resamples.

    Returns:
        The head-to-head, built once: speculators, shared costs with their spread, and per scope the rows and
        the verdict.
    """
    if len(contenders) < 2:
        raise ValueError("a head-to-head needs at least two speculators")
    for contender in contenders:
        if contender.record.summary.sweep is None:
            raise ValueError(f"{contender.name}: the run has no sweep to compare")
    costs, replicates = _cost_models(contenders, n_boot, seed)
    scope_names = [OVERALL] + sorted(set.intersection(*(set(c.record.summary.by_class) for c in contenders)))
    return HeadToHead(
        speculators=[
            Speculator(
                name=c.name,
                draft=c.record.models["draft"].id,
                kind=c.record.models["draft"].kind,
                run_dir=str(c.run_dir) if c.run_dir is not None else None,
            )
            for c in contenders
        ],
        costs=_shared_costs_with_spread(contenders, costs, replicates),
        scopes={scope: _scope(contenders, costs, replicates, scope, n_boot, seed) for scope in scope_names},
    )


def _shared_costs_with_spread(
    contenders: Sequence[Contender], costs: Sequence[StepCosts], replicates: list[list[StepCosts]] | None
) -> SharedCosts:
    """The shared costs with their spread: each fitted time and, when timed here, its 95% bootstrap interval."""

    def ci(values: list[float]) -> list[float]:
        return [float(x) for x in interval(np.asarray(values))]

    spread = None
    if replicates is not None:
        spread = CostSpread(
            t_decode_s_ci=ci([m.t_decode_s for m in replicates[0]]),
            t_verify_s_ci={k: ci([m.t_verify_s[k] for m in replicates[0]]) for k in sorted(costs[0].t_verify_s)},
            t_draft_s_ci={
                c.name: {k: ci([m.t_draft_s[k] for m in reps]) for k in sorted(cost.t_draft_s)}
                for c, cost, reps in zip(contenders, costs, replicates)
            },
            timing_violations=sorted({v for c in contenders if c.cost_samples for v in c.cost_samples.violations}),
        )
    return SharedCosts(
        source=costs[0].source,
        device=costs[0].device,
        t_decode_s=costs[0].t_decode_s,
        t_verify_s=dict(sorted(costs[0].t_verify_s.items())),
        t_draft_s={c.name: dict(sorted(cost.t_draft_s.items())) for c, cost in zip(contenders, costs)},
        spread=spread,
    )


def _scope(
    contenders: Sequence[Contender],
    costs: Sequence[StepCosts],
    replicates: list[list[StepCosts]] | None,
    scope: str,
    n_boot: int,
    seed: int,
) -> ScopeResult:
    frames = [{k: _scope_steps(steps, scope) for k, steps in c.steps_by_k.items()} for c in contenders]
    units = units_of(f[max(f)] for f in frames)
    by_ks: list[dict[int, float]] = []  # per contender: its point speedup at each K
    best: list[
        tuple[int, UnitSteps, StepPrices]
    ] = []  # per contender: its best K, its steps there, its resampled prices
    for cost, own, models in zip(costs, frames, replicates or [None] * len(costs)):
        ks = sorted(own)
        largest = max_drafted(own.values())
        point = StepPrices.of([cost], ks, largest)
        counts = {k: UnitSteps.of(frame, units, largest) for k, frame in own.items()}
        by_k = {k: counts[k].point_speedup(point, k) for k in ks}
        best_k = max(ks, key=lambda k: by_k[k] if np.isfinite(by_k[k]) else -np.inf)
        by_ks.append(by_k)
        best.append((best_k, counts[best_k], StepPrices.of(models or [cost], ks, largest)))
    # paired bootstrap: one draw of conversations and one draw of the timings price every contender at its best K
    boot = np.empty((len(contenders), n_boot))
    rng = group_rng(seed, f"head-to-head:{scope}")
    for rows_slice, multiplicity in resample_multiplicities(len(units), n_boot, rng):
        for i, (k, unit_steps, prices) in enumerate(best):
            boot[i, rows_slice] = unit_steps.replicates(prices, k, multiplicity, rows_slice)
    rows: list[ContenderRow] = []
    for i, (contender, by_k, (best_k, _, _)) in enumerate(zip(contenders, by_ks, best)):
        sweep_rows = {row.k: row for row in contender.record.summary.sweep.scopes().get(scope, [])}  # type: ignore[union-attr]
        sweep_row = sweep_rows.get(best_k)
        metrics = contender.record.summary.scopes().get(scope)
        rows.append(
            ContenderRow(
                speculator=contender.name,
                best_k=best_k,
                tau=sweep_row.mean_acceptance_length if sweep_row else None,
                tau_ci=list(sweep_row.mean_acceptance_length_ci) if sweep_row else [None, None],
                speedup=by_k[best_k],
                speedup_ci=[float(x) for x in interval(boot[i])],
                speedup_by_k=by_k,
                acceptance_rate_per_pos=list(metrics.acceptance_rate_per_pos) if metrics else [],
                num_drafts=int(metrics.num_drafts) if metrics else 0,
            )
        )
    return ScopeResult(rows=rows, verdict=_verdict(rows, boot, scope, len(units)))


MIN_CONVERSATIONS = 5  # fewer independent conversations give a bootstrap too coarse to name a winner on
MIN_DRAFTS = 10  # a leader that drafted fewer steps in the scope has no acceptance to judge


def _verdict(rows: list[ContenderRow], boot: np.ndarray, scope: str, num_units: int) -> Verdict:
    order = sorted(range(len(rows)), key=lambda i: -rows[i].speedup if np.isfinite(rows[i].speedup) else np.inf)
    first, second = order[0], order[1]
    win, run = rows[first], rows[second]
    where = "overall" if scope == OVERALL else f"for {scope}"
    low, high = win.speedup_ci
    described = (
        f"{win.speedup:.2f}x [{low:.2f}, {high:.2f}]"
        if np.isfinite(low) and np.isfinite(high)
        else f"{win.speedup:.2f}x"
    )
    if not np.isfinite(win.speedup) or win.speedup < 1.0:
        shown = "is shown to beat" if np.isfinite(high) and high >= 1.0 else "beats"
        return Verdict(
            None,
            None,
            None,
            None,
            False,
            f"{where}: no speculator {shown} plain decoding (best {win.speculator} {described} at K={win.best_k}); "
            "serve without speculation.",
        )
    if num_units < MIN_CONVERSATIONS or win.num_drafts < MIN_DRAFTS:
        return Verdict(
            win.speculator,
            run.speculator,
            None,
            None,
            False,
            f"{where}: too few requests to decide ({num_units} conversation(s), {win.num_drafts} drafted step(s) "
            f"for the leader; at least {MIN_CONVERSATIONS} and {MIN_DRAFTS}): {win.speculator} leads at "
            f"K={win.best_k} ({described}).",
        )
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = boot[first] / boot[second]
    ratio = win.speedup / run.speedup if run.speedup > 0 else float("inf")
    ratio_ci = (
        [float(x) for x in interval(ratios[np.isfinite(ratios)])]
        if np.isfinite(ratios).any()
        else [float("nan"), float("nan")]
    )
    decisive = bool(np.isfinite(ratio_ci[0]) and ratio_ci[0] > 1.0)
    margin = (
        f"{ratio:.2f}x the speedup of {run.speculator} at K={run.best_k} "
        f"(95% interval {ratio_ci[0]:.2f}-{ratio_ci[1]:.2f})"
    )
    if np.isfinite(low) and low < 1.0:
        return Verdict(
            win.speculator,
            run.speculator,
            float(ratio),
            ratio_ci,
            False,
            f"{where}: no clear winner: {win.speculator} leads at K={win.best_k} ({described}) but may not beat "
            f"plain decoding; {margin}.",
        )
    head = f"{where}: deploy {win.speculator} at K={win.best_k} ({described})"
    text = (
        f"{head}: {margin}."
        if decisive
        else f"{where}: no clear winner: {win.speculator} leads at K={win.best_k} ({described}); {margin} includes 1."
    )
    return Verdict(win.speculator, run.speculator, float(ratio), ratio_ci, decisive, text)
