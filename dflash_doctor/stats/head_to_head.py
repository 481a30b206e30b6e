"""Several speculators on the same prompts and target: tau, priced speedup at each one's best K, the
per-position curves side by side, and per class which one to deploy and by how much it wins.

Inputs are each speculator's finished ``check``: its run record (tau and its interval per K from the
sweep, the per-position rates) and its steps at every K. The verdict rests on a speedup priced the
same way for every speculator (docs/speculators.md):

* Every step costs the speculator's own draft time at K plus the target's verify time for the tokens
  it *really* drafted; a step that drafted nothing (an n-gram lookup without a match) is a plain
  decode step. A run's own sweep prices every step as a full draft step, which is right for a drafter
  that always drafts K and overstates a lookup speculator that often proposes nothing.
* The target's decode and verify times come from one speculator's measurement (the first one's) for
  all of them, so timing noise between runs does not decide the verdict; each keeps its own draft time.
* ``speedup(K) = tokens emitted x t_decode / time of the steps``, summed over the scope's requests.
* Best K: the highest point speedup (the smaller K on a tie).
* Intervals: percentile bootstrap over requests, *paired*: the same resampled requests price every
  speculator, so the ratio winner / runner-up has an interval of its own. The winner is named outright
  only when that interval lies above 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from dflash_doctor.rundir.run_record import OVERALL, RunRecord, StepCosts
from dflash_doctor.stats.metrics import NUM_BOOTSTRAP_RESAMPLES, group_rng, interval, resample_multiplicities


@dataclass(frozen=True)
class Contender:
    """One speculator's finished run: its name in the table, its record and its steps at every K."""

    name: str
    record: RunRecord
    steps_by_k: Mapping[int, pd.DataFrame]


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
    """Which speculator to deploy in a scope: ``winner`` (None: none beats plain decoding), the ratio of
    its speedup to the runner-up's with a paired interval, and whether that interval clears 1."""

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
            "scopes": {name: {"rows": [_row_json(row) for row in scope.rows], "verdict": asdict(scope.verdict)}
                       for name, scope in self.scopes.items()},
        }


def _row_json(row: ContenderRow) -> dict[str, Any]:
    data = asdict(row)
    data["speedup_by_k"] = {str(k): v for k, v in row.speedup_by_k.items()}
    return data


def _shared_costs(costs: Sequence[StepCosts]) -> list[StepCosts]:
    """Each speculator's costs with one set of decode and verify times: the target's, the same for all of
    them, taken from the speculator whose check timed verification up to the largest K (the first of
    those), so a speculator priced at a larger K than the first one's block still finds its verify time."""
    base = max(costs, key=lambda c: max(c.t_verify_s))
    return [StepCosts(t_decode_s=base.t_decode_s, t_verify_s=base.t_verify_s, t_draft_s=c.t_draft_s, source=c.source, device=c.device)
            for c in costs]


def request_totals(steps: pd.DataFrame, request_ids: np.ndarray, k: int, costs: StepCosts) -> tuple[np.ndarray, np.ndarray]:
    """Per request: tokens emitted and seconds spent by the steps at K (priced as the module says)."""
    index = pd.Index(request_ids)
    codes = index.get_indexer(steps["request_id"].to_numpy())
    drafted = steps["num_drafted"].to_numpy(dtype=np.int64)
    accepted = steps["num_accepted"].to_numpy(dtype=np.int64)
    verify = {n: costs.verify_s(n) for n in np.unique(drafted[drafted > 0]).tolist()}
    step_s = costs.draft_s(k) + np.array([verify[n] if n > 0 else costs.t_decode_s for n in drafted.tolist()], dtype=np.float64)
    emitted = np.bincount(codes, weights=accepted + 1, minlength=len(index))
    seconds = np.bincount(codes, weights=step_s, minlength=len(index))
    return emitted, seconds


def _scope_steps(steps: pd.DataFrame, scope: str) -> pd.DataFrame:
    return steps if scope == OVERALL else steps[steps["class"] == scope]


def build_head_to_head(contenders: Sequence[Contender], *, n_boot: int = NUM_BOOTSTRAP_RESAMPLES, seed: int = 0) -> HeadToHead:
    """The table and the verdicts, overall and per class (the classes every contender ran)."""
    if len(contenders) < 2:
        raise ValueError("a head-to-head needs at least two speculators")
    for contender in contenders:
        if contender.record.summary.sweep is None:
            raise ValueError(f"{contender.name}: the run has no sweep to compare")
    costs = _shared_costs([c.record.summary.sweep.step_costs() for c in contenders])  # type: ignore[union-attr]
    scope_names = [OVERALL] + sorted(set.intersection(*(set(c.record.summary.by_class) for c in contenders)))
    result = HeadToHead(
        speculators=[{"name": c.name, "draft": c.record.models["draft"].id, "kind": c.record.models["draft"].kind} for c in contenders],
        costs={"t_decode_s": costs[0].t_decode_s, "t_verify_s": {str(k): v for k, v in sorted(costs[0].t_verify_s.items())},
               "t_draft_s": {c.name: {str(k): v for k, v in sorted(cost.t_draft_s.items())} for c, cost in zip(contenders, costs)}},
    )
    for scope in scope_names:
        result.scopes[scope] = _scope(contenders, costs, scope, n_boot, seed)
    return result


def _scope(contenders: Sequence[Contender], costs: Sequence[StepCosts], scope: str, n_boot: int, seed: int) -> ScopeResult:
    all_steps = [_scope_steps(c.steps_by_k[max(c.steps_by_k)], scope) for c in contenders]
    request_ids = np.array(sorted(set().union(*(set(s["request_id"]) for s in all_steps))))
    rows: list[ContenderRow] = []
    best_totals: list[tuple[np.ndarray, np.ndarray]] = []
    for contender, cost in zip(contenders, costs):
        by_k: dict[int, float] = {}
        totals: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for k in sorted(contender.steps_by_k):
            emitted, seconds = request_totals(_scope_steps(contender.steps_by_k[k], scope), request_ids, k, cost)
            totals[k] = (emitted, seconds)
            by_k[k] = float(emitted.sum() * cost.t_decode_s / seconds.sum()) if seconds.sum() > 0 else float("nan")
        best_k = max(sorted(by_k), key=lambda k: by_k[k] if np.isfinite(by_k[k]) else -np.inf)
        best_totals.append(totals[best_k])
        sweep_rows = {row.k: row for row in contender.record.summary.sweep.scopes().get(scope, [])}  # type: ignore[union-attr]
        sweep_row = sweep_rows.get(best_k)
        metrics = contender.record.summary.scopes().get(scope)
        rows.append(ContenderRow(
            speculator=contender.name, best_k=best_k,
            tau=sweep_row.mean_acceptance_length if sweep_row else None,
            tau_ci=list(sweep_row.mean_acceptance_length_ci) if sweep_row else [None, None],
            speedup=by_k[best_k], speedup_ci=[float("nan"), float("nan")], speedup_by_k=by_k,
            acceptance_rate_per_pos=list(metrics.acceptance_rate_per_pos) if metrics else [],
            num_drafts=int(metrics.num_drafts) if metrics else 0,
        ))
    # paired bootstrap: one set of resampled requests prices every contender at its best K
    boot = np.empty((len(contenders), n_boot))
    rng = group_rng(seed, f"head-to-head:{scope}")
    for rows_slice, multiplicity in resample_multiplicities(len(request_ids), n_boot, rng):
        for i, ((emitted, seconds), cost) in enumerate(zip(best_totals, costs)):
            with np.errstate(invalid="ignore", divide="ignore"):
                boot[i, rows_slice] = (multiplicity @ emitted) * cost.t_decode_s / (multiplicity @ seconds)
    for i, row in enumerate(rows):
        row.speedup_ci = [float(x) for x in interval(boot[i])]
    return ScopeResult(rows=rows, verdict=_verdict(rows, boot, scope))


def _verdict(rows: list[ContenderRow], boot: np.ndarray, scope: str) -> Verdict:
    order = sorted(range(len(rows)), key=lambda i: -rows[i].speedup if np.isfinite(rows[i].speedup) else np.inf)
    first, second = order[0], order[1]
    win, run = rows[first], rows[second]
    where = "overall" if scope == OVERALL else f"for {scope}"
    if not np.isfinite(win.speedup) or win.speedup < 1.0:
        return Verdict(None, None, None, None, False,
                       f"{where}: no speculator beats plain decoding (best {win.speculator} {win.speedup:.2f}x at K={win.best_k}); serve without speculation.")
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = boot[first] / boot[second]
    ratio = win.speedup / run.speedup if run.speedup > 0 else float("inf")
    ratio_ci = [float(x) for x in interval(ratios[np.isfinite(ratios)])] if np.isfinite(ratios).any() else [float("nan"), float("nan")]
    decisive = bool(np.isfinite(ratio_ci[0]) and ratio_ci[0] > 1.0)
    head = f"{where}: deploy {win.speculator} at K={win.best_k} ({win.speedup:.2f}x)"
    margin = f"{ratio:.2f}x the speedup of {run.speculator} at K={run.best_k} (95% interval {ratio_ci[0]:.2f}-{ratio_ci[1]:.2f})"
    text = f"{head}: {margin}." if decisive else f"{head}, but no clear winner: {margin} includes 1."
    return Verdict(win.speculator, run.speculator, float(ratio), ratio_ci, decisive, text)
