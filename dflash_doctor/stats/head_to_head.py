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

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from dflash_doctor.rundir.run_record import OVERALL, RunRecord, StepCosts
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


@dataclass
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


@dataclass
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


@dataclass
class ScopeResult:
    rows: list[ContenderRow]
    verdict: Verdict


@dataclass
class HeadToHead:
    speculators: list[dict[str, Any]]
    costs: dict[str, Any]
    scopes: dict[str, ScopeResult] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "speculators": self.speculators,
            "costs": self.costs,
            "scopes": {
                name: {"rows": [_row_json(row) for row in scope.rows], "verdict": asdict(scope.verdict)}
                for name, scope in self.scopes.items()
            },
        }


def _row_json(row: ContenderRow) -> dict[str, Any]:
    data = asdict(row)
    data["speedup_by_k"] = {str(k): v for k, v in row.speedup_by_k.items()}
    return data


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
    """The table and the verdicts, overall and per class (the classes every contender ran)."""
    if len(contenders) < 2:
        raise ValueError("a head-to-head needs at least two speculators")
    for contender in contenders:
        if contender.record.summary.sweep is None:
            raise ValueError(f"{contender.name}: the run has no sweep to compare")
    costs, replicates = _cost_models(contenders, n_boot, seed)
    scope_names = [OVERALL] + sorted(set.intersection(*(set(c.record.summary.by_class) for c in contenders)))
    result = HeadToHead(
        speculators=[
            {"name": c.name, "draft": c.record.models["draft"].id, "kind": c.record.models["draft"].kind}
            for c in contenders
        ],
        costs=_costs_json(contenders, costs, replicates),
    )
    for scope in scope_names:
        result.scopes[scope] = _scope(contenders, costs, replicates, scope, n_boot, seed)
    return result


def _costs_json(
    contenders: Sequence[Contender], costs: Sequence[StepCosts], replicates: list[list[StepCosts]] | None
) -> dict[str, Any]:
    """The shared costs with their spread: each fitted time and, when timed here, its 95% bootstrap interval."""

    def ci(values: list[float]) -> list[float]:
        return [float(x) for x in interval(np.asarray(values))]

    block: dict[str, Any] = {
        "source": costs[0].source,
        "device": costs[0].device,
        "t_decode_s": costs[0].t_decode_s,
        "t_verify_s": {str(k): v for k, v in sorted(costs[0].t_verify_s.items())},
        "t_draft_s": {
            c.name: {str(k): v for k, v in sorted(cost.t_draft_s.items())} for c, cost in zip(contenders, costs)
        },
    }
    if replicates is not None:
        block["t_decode_s_ci"] = ci([m.t_decode_s for m in replicates[0]])
        block["t_verify_s_ci"] = {
            str(k): ci([m.t_verify_s[k] for m in replicates[0]]) for k in sorted(costs[0].t_verify_s)
        }
        block["t_draft_s_ci"] = {
            c.name: {str(k): ci([m.t_draft_s[k] for m in reps]) for k in sorted(cost.t_draft_s)}
            for c, cost, reps in zip(contenders, costs, replicates)
        }
        block["timing_violations"] = sorted(
            {v for c in contenders if c.cost_samples for v in c.cost_samples.violations}
        )
    return block


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
    rows: list[ContenderRow] = []
    best: list[
        tuple[int, UnitSteps, StepPrices]
    ] = []  # per contender: its best K, its steps there, its resampled prices
    for contender, cost, own, models in zip(contenders, costs, frames, replicates or [None] * len(costs)):
        ks = sorted(own)
        largest = max_drafted(own.values())
        point = StepPrices.of([cost], ks, largest)
        counts = {k: UnitSteps.of(frame, units, largest) for k, frame in own.items()}
        by_k = {k: counts[k].point_speedup(point, k) for k in ks}
        best_k = max(ks, key=lambda k: by_k[k] if np.isfinite(by_k[k]) else -np.inf)
        best.append((best_k, counts[best_k], StepPrices.of(models or [cost], ks, largest)))
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
                speedup_ci=[float("nan"), float("nan")],
                speedup_by_k=by_k,
                acceptance_rate_per_pos=list(metrics.acceptance_rate_per_pos) if metrics else [],
                num_drafts=int(metrics.num_drafts) if metrics else 0,
            )
        )
    # paired bootstrap: one draw of conversations and one draw of the timings price every contender at its best K
    boot = np.empty((len(contenders), n_boot))
    rng = group_rng(seed, f"head-to-head:{scope}")
    for rows_slice, multiplicity in resample_multiplicities(len(units), n_boot, rng):
        for i, (k, unit_steps, prices) in enumerate(best):
            boot[i, rows_slice] = unit_steps.replicates(prices, k, multiplicity, rows_slice)
    for i, row in enumerate(rows):
        row.speedup_ci = [float(x) for x in interval(boot[i])]
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
    margin = f"{ratio:.2f}x the speedup of {run.speculator} at K={run.best_k} (95% interval {ratio_ci[0]:.2f}-{ratio_ci[1]:.2f})"
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
