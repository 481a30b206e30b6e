"""Net speedup of speculative decoding: step costs, the K sweep table and the per-class K recommendation.

Acceptance alone does not say whether speculation pays: vLLM PR #26504 shows acceptance flat from batch 1
to 32 while the right decision flips from +23% to -16%. So the doctor prices every K with step times:

    speedup(K) = tau(K) * t_decode / (t_draft(K) + t_verify(K))

``t_decode`` is one plain target decode step, ``t_verify(K)`` the target's forward over the 1 + K block
tokens, ``t_draft(K)`` the draft's cost for K tokens (K sequential steps for an autoregressive draft, one
block pass for DFlash, which is why its draft term is nearly flat in K). The times come from
:func:`measure_costs` on the current device, or from a profile a user measured in a serving engine
(:func:`load_cost_profile`, ``--cost-profile FILE``, format in docs/cost-profile.md).
:func:`leviathan_speedup` is the i.i.d. closed form of Leviathan et al. 2023, kept as a cross-check.
"""

from __future__ import annotations

import json
import math
import statistics
import time
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import pandas as pd

from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.run_record import OVERALL, Recommendation, StepCosts, Sweep, SweepRow
from dflash_doctor.stats.metrics import expected_tau_iid, tau_with_ci

ESTIMATES = ("exact", "truncated")
def leviathan_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. 2023 walltime speedup with i.i.d. acceptance ``alpha``, K drafted tokens, cost ratio c.

    ``(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))`` with c = draft step / target step. It is the general
    form with t_draft(K) = K c t_decode and t_verify(K) = t_decode (verifying K + 1 tokens costs one
    decode step), which holds only while verification stays memory-bound.
    """
    return expected_tau_iid(alpha, k) / (k * c + 1.0)


# ----------------------------------------------------------------------------- measuring


def measure_costs(
    decode_step: Callable[[], None],
    verify_step: Callable[[int], None],
    draft_step: Callable[[int], None],
    ks: Iterable[int],
    *,
    warmup: int = 2,
    repeats: int = 5,
    sync: Callable[[], None] | None = None,
    device: str = "cpu",
    clock: Callable[[], float] = time.perf_counter,
) -> StepCosts:
    """Time the three step kinds with closures over real models; median of ``repeats`` after ``warmup``.

    The closures must do one step's work and nothing else (inputs prepared outside). ``sync`` is called
    before starting and after stopping the clock (``torch.cuda.synchronize`` on a GPU, where kernels run
    asynchronously and the clock would otherwise time only the launch). Warm-up runs absorb one-off
    costs (allocator growth, kernel autotuning, lazy init); the median resists a stray slow repeat. The
    steps are timed round-robin (every step once per repeat), so a busy spell of the machine slows every
    step alike instead of one K's: the speedup is a ratio of these times, and a spell that hit only the
    K = 8 verify used to make K = 8 look best.
    Measure a few K (e.g. 1, 2, 4, 8, 16): :class:`StepCosts` interpolates between them.
    """
    ks = sorted(set(int(k) for k in ks))
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must hold integers >= 1, got {ks}")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup}, {repeats}")
    synchronize = sync or (lambda: None)
    steps: dict[tuple[str, int], Callable[[], None]] = {("decode", 0): decode_step}
    steps.update({("verify", k): (lambda k=k: verify_step(k)) for k in ks})
    steps.update({("draft", k): (lambda k=k: draft_step(k)) for k in ks})
    for _ in range(warmup):
        for step in steps.values():
            step()
    synchronize()
    durations_s: dict[tuple[str, int], list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            synchronize()
            start = clock()
            step()
            synchronize()
            durations_s[name].append(clock() - start)
    median_s = {name: statistics.median(times) for name, times in durations_s.items()}
    return StepCosts(
        t_decode_s=median_s[("decode", 0)],
        t_verify_s={k: median_s[("verify", k)] for k in ks},
        t_draft_s={k: median_s[("draft", k)] for k in ks},
        source="measured",
        device=device,
    )


# ----------------------------------------------------------------------------- cost profiles

_PROFILE_KEYS = ("t_decode_s", "t_verify_s", "t_draft_s", "device", "source", "notes")


def load_cost_profile(path: Path | str) -> StepCosts:
    """Read step times a user measured in their serving engine (``--cost-profile FILE``).

    TOML or JSON, by extension; times in seconds (see docs/cost-profile.md)::

        device = "H200, vLLM 0.11, batch 8"    # optional, shown next to every speedup
        t_decode_s = 0.0079                   # one plain decode step of the target
        t_draft_s = 0.0011                    # a number: the same at every K (a DFlash block pass)
        [t_verify_s]                          # a table: K = seconds, interpolated between the Ks given
        1 = 0.0081
        4 = 0.0086
        16 = 0.0112

    ``t_verify_s`` and ``t_draft_s`` are each a number or a ``K -> seconds`` table. ``notes`` is free
    text; ``source`` is accepted and ignored, so the ``summary.sweep.costs`` block of a run.json is a
    valid JSON profile. Anything else (a typo, a missing field, a negative time) is a UsageError.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"cost profile {path} does not exist; pass an existing .toml or .json file to --cost-profile.")
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise UsageError(f"cost profile {path} must be a .toml or .json file; rename it or convert it (see docs/cost-profile.md).")
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        kind = "TOML" if suffix == ".toml" else "JSON"
        raise UsageError(f"cost profile {path} is not valid {kind} ({exc}); fix the file (see docs/cost-profile.md).") from None
    if not isinstance(data, dict):
        raise UsageError(f"cost profile {path} must hold an object with t_decode_s, t_verify_s and t_draft_s; fix the file.")

    unknown = sorted(set(data) - set(_PROFILE_KEYS))
    if unknown:
        raise UsageError(f"cost profile {path} has unknown keys {unknown}; use only {', '.join(_PROFILE_KEYS)}.")
    missing = [key for key in ("t_decode_s", "t_verify_s", "t_draft_s") if key not in data]
    if missing:
        raise UsageError(f"cost profile {path} lacks {', '.join(missing)}; add the step times in seconds (see docs/cost-profile.md).")

    t_decode_s = _profile_seconds(path, "t_decode_s", data["t_decode_s"], allow_zero=False)
    device = data.get("device", f"profile {path.name}")
    if not isinstance(device, str):
        raise UsageError(f"cost profile {path}: device must be a string describing where the times were measured; fix it.")
    return StepCosts(
        t_decode_s=t_decode_s,
        t_verify_s=_profile_table(path, "t_verify_s", data["t_verify_s"], allow_zero=False),
        t_draft_s=_profile_table(path, "t_draft_s", data["t_draft_s"], allow_zero=True),
        source="profile",
        device=device,
    )


def _profile_seconds(path: Path, key: str, value: Any, *, allow_zero: bool) -> float:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not is_number or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise UsageError(f"cost profile {path}: {key} = {value!r} is not a number of seconds {bound}; fix the value.")
    return float(value)


def _profile_table(path: Path, key: str, value: Any, *, allow_zero: bool) -> dict[int, float]:
    """A number (same at every K, stored as K=1: a one-entry table applies to all K) or ``{K: seconds}``."""
    if not isinstance(value, dict):
        return {1: _profile_seconds(path, key, value, allow_zero=allow_zero)}
    if not value:
        raise UsageError(f"cost profile {path}: {key} is an empty table; give seconds per K, e.g. 1 = 0.008.")
    table = {}
    for k_text, seconds in value.items():
        try:
            k = int(k_text)
        except ValueError:
            k = 0
        if k < 1:
            raise UsageError(f"cost profile {path}: {key} has key {k_text!r}, not a K >= 1; use integer keys like 1, 4, 16.")
        table[k] = _profile_seconds(path, f"{key}.{k_text}", seconds, allow_zero=allow_zero)
    return table


# ----------------------------------------------------------------------------- sweep


def sweep_row(k: int, tau: float, tau_ci: list[float], costs: StepCosts, estimate: str) -> SweepRow:
    """One row of run.json ``summary.sweep``; ``estimate`` says whether tau came from a run at this K."""
    if estimate not in ESTIMATES:
        raise ValueError(f"estimate must be one of {ESTIMATES}, got {estimate!r}")
    return SweepRow(k=int(k), mean_acceptance_length=float(tau), mean_acceptance_length_ci=[float(x) for x in tau_ci],
                    speedup=costs.speedup(tau, k), estimate=estimate)


def build_sweep(
    steps_by_k: dict[int, pd.DataFrame],
    costs: StepCosts,
    estimate_by_k: dict[int, str],
    *,
    n_boot: int = 1000,
    seed: int = 0,
) -> Sweep:
    """run.json ``summary.sweep``: tau with its interval and speedup per K, overall and per class.

    ``steps_by_k[K]`` holds the steps of a run (live or teacher-forced) at K drafted tokens;
    ``estimate_by_k[K]`` is ``"exact"`` when they are the steps a live run at K takes, ``"truncated"``
    when they were cut down from a larger K (:func:`dflash_doctor.stats.metrics.truncate_steps`).
    """
    missing = sorted(set(steps_by_k) - set(estimate_by_k))
    if missing:
        raise ValueError(f"estimate_by_k has no entry for K {missing}")
    overall: list[SweepRow] = []
    by_class: dict[str, list[SweepRow]] = {}
    for k in sorted(steps_by_k):
        steps = steps_by_k[k]
        tau, tau_ci = tau_with_ci(steps, n_boot=n_boot, seed=seed, group=OVERALL)
        overall.append(sweep_row(k, tau, tau_ci, costs, estimate_by_k[k]))
        for cls, class_steps in steps.groupby("class", sort=True):
            tau, tau_ci = tau_with_ci(class_steps, n_boot=n_boot, seed=seed, group=f"class:{cls}")
            by_class.setdefault(str(cls), []).append(sweep_row(k, tau, tau_ci, costs, estimate_by_k[k]))
    return Sweep(overall=overall, by_class=by_class, costs=costs.as_dict())


# ----------------------------------------------------------------------------- recommendation


def recommend(
    sweep_rows_by_scope: Mapping[str, Sequence[SweepRow]],
    *,
    conservative_share: float = 0.95,
    strict_classes: Iterable[str] = (),
    strict_max_k: int = 4,
) -> dict[str, Recommendation]:
    """run.json ``recommendation``: per scope (overall and each class; ``Sweep.scopes()``), the K to serve, a conservative K, the speedup and why.

    * ``k``: the K with the best speedup (the smaller K on a tie); 0 (speculation off) when even the
      best K is slower than plain decoding.
    * ``conservative_k``: the smallest K whose speedup is within ``conservative_share`` of the best:
      fewer wasted verify tokens and less exposure if acceptance drops, for almost the same gain.
    * Strict classes (they must never risk a slowdown) only consider K <= ``strict_max_k`` and rank each
      K by its speedup at the *low* end of tau's 95% interval (speedup is proportional to tau); if that
      pessimistic speedup is below 1 at every such K, speculation is off.
    """
    if not 0.0 < conservative_share <= 1.0:
        raise ValueError(f"conservative_share must be in (0, 1], got {conservative_share}")
    if strict_max_k < 1:
        raise ValueError(f"strict_max_k must be >= 1, got {strict_max_k}")
    strict = set(strict_classes)
    return {
        name: _recommend_one(rows, conservative_share, strict_max_k if name in strict else None)
        for name, rows in sweep_rows_by_scope.items()
    }


def _pessimistic_speedup(row: SweepRow) -> float:
    """Speedup at the low end of tau's interval; the point speedup when the row has no usable interval."""
    speedup = _point_speedup(row)
    ci = row.mean_acceptance_length_ci or [None, None]
    low, tau = ci[0], row.mean_acceptance_length
    if low is None or not math.isfinite(low) or not tau:
        return speedup
    return speedup * min(low, tau) / tau


def _point_speedup(row: SweepRow) -> float:
    assert row.speedup is not None, "only priced rows (_is_priced) are ranked"
    return row.speedup


def _is_priced(row: SweepRow) -> bool:
    return row.speedup is not None and math.isfinite(row.speedup) and row.k >= 1


def priced_speedups(rows: Iterable[SweepRow]) -> dict[int, float]:
    """``{K: speedup}`` of the sweep rows that were priced (a finite speedup at K >= 1), in K order."""
    return {row.k: _point_speedup(row) for row in sorted(rows, key=lambda row: row.k) if _is_priced(row)}


def best_speedup(speedups: Mapping[int, float]) -> tuple[int, float]:
    """``(K, speedup)`` with the highest speedup of a non-empty ``{K: speedup}``, the smallest K on a tie
    (fewer wasted verify tokens for the same gain)."""
    k = max(sorted(speedups), key=speedups.__getitem__)
    return k, speedups[k]


def k_that_pays(best: tuple[int, float], floor: float = 1.0) -> int:
    """The best K when its speedup reaches ``floor`` (plain decoding runs at 1.0x), else 0: speculation off.

    The one rule behind run.json's ``recommendation``, the speculative-k check's suggested K and watch's
    fallback advice, so the three never name different Ks for the same prices."""
    k, speedup = best
    return k if speedup >= floor else 0


def _recommend_one(rows: Sequence[SweepRow], share: float, strict_max_k: int | None) -> Recommendation:
    candidates = sorted((row for row in rows if _is_priced(row)), key=lambda row: row.k)
    strict = strict_max_k is not None
    score = _point_speedup
    note = ""
    if strict_max_k is not None:
        candidates = [row for row in candidates if row.k <= strict_max_k]
        score = _pessimistic_speedup
        note = f" (strict class: K <= {strict_max_k}, judged at the low end of tau's 95% interval)"
    if not candidates:
        swept = f"no K <= {strict_max_k}" if strict else "no K"
        return _speculation_off(f"Speculation off: {swept} was priced (no draft steps or no sweep rows){note}.")

    best_k, best_score = best_speedup({row.k: score(row) for row in candidates})
    best = next(row for row in candidates if row.k == best_k)
    described = _describe(best, strict)
    if k_that_pays((best_k, best_score)) == 0:
        slower = "possibly slower" if strict else "slower"
        return _speculation_off(f"Speculation off: even the best, K={best.k}, runs at {described}, {slower} than plain decoding{note}.")
    conservative = next(row for row in candidates if score(row) >= share * best_score)
    if conservative.k == best.k:
        tail = f"no smaller K keeps {share:.0%} of it"
    else:
        tail = f"K={conservative.k} keeps {score(conservative) / best_score:.0%} of it at {_point_speedup(conservative):.2f}x"
    return Recommendation(k=int(best.k), conservative_k=int(conservative.k), speedup=float(_point_speedup(best)),
                          reason=f"K={best.k} is the best at {described}; {tail}{note}.")


def _speculation_off(reason: str) -> Recommendation:
    return Recommendation(k=0, conservative_k=0, speedup=1.0, reason=reason)


def _describe(row: SweepRow, pessimistic: bool) -> str:
    """'2.31x (tau 4.10)' plus the pessimistic speedup for strict classes and a truncation note."""
    tau = row.mean_acceptance_length
    text = f"{_point_speedup(row):.2f}x (tau {'not reported' if tau is None else f'{tau:.2f}'}"
    if pessimistic:
        text += f"; {_pessimistic_speedup(row):.2f}x at the interval's low end"
    if row.estimate == "truncated":
        text += ", truncated estimate"
    return text + ")"
