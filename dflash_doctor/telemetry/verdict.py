"""Verdicts on production windows: alerts against a baseline, and when to fall back to plain decoding.

Rules (each alert says which one fired, with the numbers):

* ``acceptance-drop``: the window's tau is below the baseline's by more than ``threshold_tau`` AND the
  intervals separate (the window's upper bound below the baseline's lower bound; a fixed baseline tau
  has no interval). The same two-part rule as ``dflash-doctor compare``: a big but noisy drop does not
  page anyone, nor does a tiny but certain one. Windows with fewer than ``min_drafts`` drafts get no
  verdict ("too few drafts"), since a handful of drafts says nothing.
* ``drafting-stopped``: output tokens were generated but no draft was counted (the counters froze or
  vanished) after this series had drafted before - a draft that fell over, a config reload without
  speculation, or a version whose counters broke (docs/engines.md: a zero counter with drafting enabled).
* ``k-changed``: the number of draft positions differs from the previous window's (or from the
  baseline's / the engine's configured K): someone changed ``num_speculative_tokens``.
* ``fallback``: with step costs (a baseline sweep's ``summary.sweep.costs`` or ``--cost-profile``) the
  net speedup ``tau * t_decode / (t_draft(K) + t_verify(K))`` of the window is below ``speedup_floor``.
  The advice names the exact engine setting: a smaller K that still pays (priced from the window's own
  per-position rates, tau(K') = 1 + sum_{i<K'} r_i), else K = 0.

Never changes a server: it prints the change for a human (or an Alertmanager route) to apply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

from dflash_doctor.rundir.run_record import OVERALL, RunRecord, StepCosts
from dflash_doctor.stats.gate import DEFAULT_THRESHOLD_TAU, MAX_TAU_DROP
from dflash_doctor.stats.speedup import best_speedup, k_that_pays
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.validation import finite_number
from dflash_doctor.rundir.load import read_run_meta
from dflash_doctor.telemetry.counts import ALL_CLASSES, window_tau_interval
from dflash_doctor.telemetry.watcher import Window

DEFAULT_MIN_DRAFTS = 50
DEFAULT_SPEEDUP_FLOOR = 1.0
MIN_GATE_WINDOW_REQUESTS = 8  # TensorRT-LLM gate: never suggest judging on fewer completed requests


@dataclass(frozen=True)
class BaselineEntry:
    tau: float
    tau_ci: tuple[float, float] | None = None
    rates: tuple[float, ...] | None = None  # per-position, to truncate to a smaller served K
    request_tau_sd: float | None = None  # spread of per-request tau (sizes TensorRT-LLM's gate window)


@dataclass
class Baseline:
    """Expected acceptance per class (``overall`` for series without a class) and, optionally, step costs."""

    entries: dict[str, BaselineEntry]
    description: str
    costs: StepCosts | None = None

    def for_class(self, cls: str) -> BaselineEntry | None:
        return (
            self.entries.get(cls)
            or self.entries.get(OVERALL if cls == ALL_CLASSES else cls)
            or self.entries.get(OVERALL)
        )

    @classmethod
    def from_run(cls, run_dir: str | Path) -> "Baseline":
        """From a ``check`` / ``sweep`` run directory: tau,
        interval, per-position rates per class; costs if it swept."""
        summary = RunRecord.from_json(read_run_meta(run_dir)).summary
        entries = {}
        for name, metrics in summary.scopes().items():
            tau = metrics.mean_acceptance_length
            if tau is None or math.isnan(tau):
                continue
            low, high = (metrics.mean_acceptance_length_ci or [None, None])[:2]
            # a scope with a tau drafted, so every per-position rate is defined (None only without drafts)
            known_rates = [rate for rate in metrics.acceptance_rate_per_pos if rate is not None]
            spread = metrics.request_tau
            sd = None
            if spread.p90 is not None and spread.p10 is not None:
                sd = (spread.p90 - spread.p10) / (2 * NormalDist().inv_cdf(0.9))  # normal p10..p90 width
            entries[name] = BaselineEntry(
                tau=float(tau),
                tau_ci=(low, high) if low is not None and high is not None else None,
                rates=tuple(known_rates)
                if known_rates and len(known_rates) == len(metrics.acceptance_rate_per_pos)
                else None,
                request_tau_sd=sd,
            )
        if not entries:
            raise UsageError(
                f"baseline run {run_dir} has no mean_acceptance_length in its "
                "summary; pass a run written by `dflash-doctor check` or `sweep`."
            )
        costs = summary.sweep.step_costs() if summary.sweep is not None and summary.sweep.costs else None
        return cls(entries, f"run {Path(run_dir).name}", costs)

    @classmethod
    def fixed(cls, tau_by_class: dict[str, float]) -> "Baseline":
        entries = {}
        for name, tau in tau_by_class.items():
            if not isinstance(tau, (int, float)) or isinstance(tau, bool):
                raise UsageError(
                    f"baseline tau for {name!r} is {tau!r}; a mean acceptance "
                    "length is a number >= 1 (bonus token included)."
                )
            tau = finite_number(
                tau,
                f"baseline tau for {name!r}",
                minimum=1,
                maximum=MAX_TAU_DROP + 1,
                fix="a mean acceptance length is a finite number >= 1 (bonus token included)",
            )
            entries[name] = BaselineEntry(float(tau))
        return cls(entries, "fixed tau " + ", ".join(f"{k}={v:g}" for k, v in tau_by_class.items()))


def load_baseline(value: str | float | dict[str, float] | None) -> Baseline | None:
    """``--baseline`` / ``[watch] baseline``: a run directory, one tau for every class, or a table class -> tau."""
    if value is None:
        return None
    if isinstance(value, dict):
        return Baseline.fixed(value)
    if isinstance(value, (int, float)):
        return Baseline.fixed({OVERALL: float(value)})
    try:
        return Baseline.fixed({OVERALL: float(value)})
    except ValueError:
        return Baseline.from_run(value)


@dataclass(frozen=True)
class Thresholds:
    threshold_tau: float = DEFAULT_THRESHOLD_TAU
    min_drafts: int = DEFAULT_MIN_DRAFTS
    speedup_floor: float = DEFAULT_SPEEDUP_FLOOR

    def __post_init__(self) -> None:
        # the one place watch's thresholds are checked (flags and the [watch] table meet here): finite and
        # in range, since nan or inf pass a plain ">= 0" and then silence every alert
        fix = "fix the flag or the [watch] table"
        object.__setattr__(
            self,
            "threshold_tau",
            finite_number(self.threshold_tau, "watch threshold_tau", minimum=0, maximum=MAX_TAU_DROP, fix=fix),
        )
        object.__setattr__(
            self,
            "min_drafts",
            finite_number(self.min_drafts, "watch min_drafts", minimum=1, maximum=1e12, integer=True, fix=fix),
        )
        object.__setattr__(
            self,
            "speedup_floor",
            finite_number(self.speedup_floor, "watch speedup_floor", above=0, maximum=1000, fix=fix),
        )


@dataclass(frozen=True)
class Alert:
    kind: str  # acceptance-drop | drafting-stopped | k-changed | fallback
    series: str
    message: str
    advice: tuple[str, ...] = ()


@dataclass
class WindowVerdict:
    """A window with its metrics (vLLM's names) and what the rules concluded."""

    window: Window
    status: str  # ok | alert | idle | no-data | too-few-drafts | no-speculation | source-unavailable
    mean_acceptance_length: float | None = None
    mean_acceptance_length_ci: tuple[float, float] | None = None
    draft_acceptance_rate: float | None = None
    acceptance_rate_per_pos: list[float] | None = None
    k: int | None = None
    baseline_tau: float | None = None
    baseline_tau_ci: tuple[float, float] | None = None
    speedup: float | None = None
    best_k: int | None = None
    best_speedup: float | None = None
    alerts: list[Alert] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_row(self) -> dict[str, Any]:
        """A flat row of ``windows.parquet`` (one per series and window)."""
        w, c = self.window, self.window.counts
        ci = self.mean_acceptance_length_ci or (None, None)
        base_ci = self.baseline_tau_ci or (None, None)
        return {
            "end_s": w.end_s,
            "start_s": w.start_s,
            "model": w.key.model,
            "class": w.key.cls,
            "status": self.status,
            "num_drafts": c.num_drafts,
            "num_draft_tokens": c.num_draft_tokens,
            "num_accepted_tokens": c.accepted,
            "num_accepted_tokens_per_pos": list(c.num_accepted_tokens_per_pos)
            if c.num_accepted_tokens_per_pos is not None
            else None,
            "num_generated_tokens": c.num_generated_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "mean_acceptance_length_lo": ci[0],
            "mean_acceptance_length_hi": ci[1],
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
            "k": self.k,
            "baseline_tau": self.baseline_tau,
            "baseline_tau_lo": base_ci[0],
            "baseline_tau_hi": base_ci[1],
            "engine_mean_acceptance_length": w.reported.get("mean_acceptance_length"),
            "speedup": self.speedup,
            "best_k": self.best_k,
            "best_speedup": self.best_speedup,
            "alerts": [a.kind for a in self.alerts],
            "alert_messages": [a.message for a in self.alerts],
            "advice": [line for a in self.alerts for line in a.advice],
            "notes": self.notes,
        }


def _baseline_at_k(entry: BaselineEntry, k: int | None) -> tuple[float, tuple[float, float] | None, str | None]:
    """The baseline's tau at the served K: truncated from its per-position rates when K is smaller."""
    if k is None or entry.rates is None or k >= len(entry.rates):
        note = (
            None
            if k is None or entry.rates is None or k == len(entry.rates)
            else f"baseline drafted K={len(entry.rates)} and production K={k}: compared as is"
        )
        return entry.tau, entry.tau_ci, note
    tau_k = 1.0 + sum(entry.rates[:k])
    shift = tau_k - entry.tau
    ci = (entry.tau_ci[0] + shift, entry.tau_ci[1] + shift) if entry.tau_ci else None
    return (
        tau_k,
        ci,
        f"baseline truncated from K={len(entry.rates)} to the served K={k} (an estimate for DFlash blocks)",
    )


def _best_k(rates: list[float] | None, k: int, costs: StepCosts) -> tuple[int, float]:
    """The K' in 0..K with the best priced speedup from the window's own rates (K = 0 is 1.0 by definition)."""
    plain = (0, 1.0)
    if not rates:
        return plain
    speedups: dict[int, float] = {}
    for candidate in range(1, k + 1):
        try:
            speedups[candidate] = costs.speedup(1.0 + sum(rates[:candidate]), candidate)
        except UsageError:  # the cost profile does not cover this K: do not guess it
            continue
    best = best_speedup(speedups) if speedups else plain
    return best if k_that_pays(best) else plain


class Judge:
    """Applies the rules window after window, remembering what each series did before (K, drafting)."""

    def __init__(
        self,
        baseline: Baseline | None,
        thresholds: Thresholds,
        *,
        server_kind: str | None,
        costs: StepCosts | None = None,
    ):
        self.baseline = baseline
        self.thresholds = thresholds
        self.server_kind = server_kind
        self.costs = costs or (baseline.costs if baseline else None)
        self._last_k: dict[Any, int] = {}
        self._has_drafted: set[Any] = set()

    def judge(self, window: Window) -> WindowVerdict:
        counts = window.counts
        verdict = WindowVerdict(window, status="ok")
        verdict.mean_acceptance_length = counts.mean_acceptance_length
        verdict.draft_acceptance_rate = counts.draft_acceptance_rate
        verdict.acceptance_rate_per_pos = counts.acceptance_rate_per_pos
        verdict.k = counts.k or (int(window.reported["configured_k"]) if "configured_k" in window.reported else None)
        verdict.mean_acceptance_length_ci = window_tau_interval(counts, window.units)
        key = window.key
        drafts = counts.num_drafts or 0.0
        generated = counts.num_generated_tokens or 0.0

        if drafts > 0:
            self._has_drafted.add(key)
        if window.is_empty:
            verdict.status = "source-unavailable" if window.source_unavailable else "no-data"
            if window.source_unavailable:
                verdict.notes.append(
                    "the source could not be read in this window; its counts arrive with the next successful scrape"
                )
            else:
                verdict.notes.append(
                    "nothing reported in this window (vLLM logs idle windows "
                    "at DEBUG level: a quiet log is not a stopped draft)"
                )
            return verdict
        if drafts == 0 and generated > 0:
            if key in self._has_drafted:
                verdict.alerts.append(
                    Alert(
                        "drafting-stopped",
                        str(key),
                        f"{key}: {generated:.0f} tokens generated but no draft counted in this "
                        "window (it drafted before): the draft stopped or its counters broke.",
                    )
                )
            else:
                verdict.status = "no-speculation"
                verdict.notes.append(
                    "tokens are generated but no draft has been counted yet: speculation "
                    "is off for this series, or its counters are not exported"
                )
        elif counts.num_drafts is None and "mean_acceptance_length" in window.reported:
            verdict.notes.append(
                "the engine reports averages only (SGLang log lines): shown "
                "as the engine's tau, not judged (no counts for an interval)"
            )
        elif drafts == 0 and counts.mean_acceptance_length is None:
            verdict.status = "idle"
            verdict.notes.append("no tokens generated in this window (idle)")

        self._check_k(verdict)
        if drafts > 0 and drafts < self.thresholds.min_drafts:
            verdict.status = "too-few-drafts"
            verdict.notes.append(
                f"{drafts:.0f} drafts (< min_drafts {self.thresholds.min_drafts}): no acceptance verdict"
            )
        elif drafts > 0:
            self._check_drop(verdict)
            self._check_speedup(verdict)
        if verdict.alerts:
            verdict.status = "alert"
        return verdict

    def _check_k(self, verdict: WindowVerdict) -> None:
        key, k = verdict.window.key, verdict.k
        if k is None:
            return
        previous = self._last_k.get(key)
        configured = verdict.window.reported.get("configured_k")
        if previous is not None and previous != k:
            verdict.alerts.append(
                Alert(
                    "k-changed",
                    str(key),
                    f"{key}: the draft length changed from K={previous} to K={k}; re-run "
                    "`dflash-doctor sweep` for the new K before trusting the old baseline.",
                )
            )
        elif configured is not None and verdict.window.counts.k not in (None, int(configured)):
            verdict.alerts.append(
                Alert(
                    "k-changed", str(key), f"{key}: the engine is configured for K={int(configured)} but drafts K={k}."
                )
            )
        self._last_k[key] = k

    def _check_drop(self, verdict: WindowVerdict) -> None:
        if self.baseline is None or verdict.mean_acceptance_length is None:
            return
        entry = self.baseline.for_class(verdict.window.key.cls)
        if entry is None:
            return
        base_tau, base_ci, note = _baseline_at_k(entry, verdict.k)
        if note:
            verdict.notes.append(note)
        verdict.baseline_tau, verdict.baseline_tau_ci = base_tau, base_ci
        tau, ci = verdict.mean_acceptance_length, verdict.mean_acceptance_length_ci
        if ci is None or tau is None:
            return
        drop = base_tau - tau
        separated = ci[1] < (base_ci[0] if base_ci else base_tau)
        if drop > self.thresholds.threshold_tau and separated:
            key = verdict.window.key
            ci_text = f"[{ci[0]:.2f}, {ci[1]:.2f}]"
            base_text = f"{base_tau:.2f}" + (f" [{base_ci[0]:.2f}, {base_ci[1]:.2f}]" if base_ci else "")
            verdict.alerts.append(
                Alert(
                    "acceptance-drop",
                    str(key),
                    f"{key}: tau {tau:.2f} {ci_text} is below the baseline {base_text} ({self.baseline.description}) "
                    f"by {drop:.2f} > {self.thresholds.threshold_tau:g}, intervals separated.",
                    fallback_advice(self.server_kind, verdict, self.baseline) if self.costs is None else (),
                )
            )

    def _check_speedup(self, verdict: WindowVerdict) -> None:
        if self.costs is None or verdict.mean_acceptance_length is None or not verdict.k:
            return
        try:
            verdict.speedup = self.costs.speedup(verdict.mean_acceptance_length, verdict.k)
        except UsageError as exc:
            verdict.notes.append(f"no net speedup: {exc.message}")
            return
        verdict.best_k, verdict.best_speedup = _best_k(verdict.acceptance_rate_per_pos, verdict.k, self.costs)
        if verdict.speedup < self.thresholds.speedup_floor:
            key = verdict.window.key
            verdict.alerts.append(
                Alert(
                    "fallback",
                    str(key),
                    f"{key}: fall back - net speedup {verdict.speedup:.2f}x at K={verdict.k} (tau "
                    f"{verdict.mean_acceptance_length:.2f}) is below the floor {self.thresholds.speedup_floor:g}x.",
                    fallback_advice(
                        self.server_kind, verdict, self.baseline, self.costs, self.thresholds.speedup_floor
                    ),
                )
            )


def fallback_advice(
    server_kind: str | None,
    verdict: WindowVerdict,
    baseline: Baseline | None,
    costs: StepCosts | None = None,
    floor: float = DEFAULT_SPEEDUP_FLOOR,
) -> tuple[str, ...]:
    """The exact engine change, for a human to apply: a smaller K that still pays, else speculation off."""
    k_now = verdict.k or 0
    best_k = verdict.best_k if verdict.best_k is not None else 0
    k_new = k_that_pays((best_k, verdict.best_speedup), floor) if verdict.best_speedup is not None else 0
    pays = k_new > 0
    why = (
        f"K={k_new} prices at {verdict.best_speedup:.2f}x from this window's per-position rates"
        if pays
        else "no K pays at this acceptance"
        if costs is not None
        else "no step costs given (--cost-profile or a baseline run with a sweep) to price a smaller K"
    )
    running = verdict.window.reported.get("running_requests")
    batch_hi = max(1, int(running)) if running else 256
    lines: list[str] = [f"why: {why}."]
    if server_kind in (None, "vllm"):
        if k_new:
            lines.append(f"vLLM: --speculative-config '{{..., \"num_speculative_tokens\": {k_new}}}' (now {k_now})")
        lines.append(
            "vLLM: --speculative-config '{..., "
            f'"num_speculative_tokens_per_batch_size": [[1, {batch_hi}, {k_new}]]}}\' '
            f"(K={k_new} for batch sizes "
            f"1..{batch_hi}{', the most requests seen running in this window' if running else ''}; keep other ranges)"
        )
    if server_kind in (None, "sglang"):
        if k_new:
            lines.append(f"SGLang: --speculative-num-draft-tokens {k_new + 1} (SGLang counts the anchor: K + 1)")
        else:
            lines.append(
                "SGLang: restart without --speculative-algorithm, or (EAGLE/EAGLE3) "
                "--speculative-adaptive with a tier of 0 steps for this batch range"
            )
    if server_kind in (None, "llamacpp"):
        lines.append(
            f"llama.cpp: --spec-draft-n-max {k_new}"
            if k_new
            else "llama.cpp: restart llama-server without the draft model (-md) / --spec-type"
        )
    if server_kind in (None, "trtllm"):
        lines.extend(_trtllm_gate(verdict, baseline, costs, floor))
    return tuple(lines)


def _trtllm_gate(verdict: WindowVerdict, baseline: Baseline | None, costs: StepCosts | None, floor: float) -> list[str]:
    """TensorRT-LLM's own fallback gate, set from the baseline: the threshold where speculation stops
    paying, and a window of completed requests long enough that the baseline stays clear of it."""
    k = verdict.k
    if not k or costs is None:
        return [
            "TensorRT-LLM: speculative_config acceptance_rate_threshold / "
            "acceptance_rate_window_size need step costs (--cost-profile) to be computed"
        ]
    try:
        tau_break_even = floor * (costs.draft_s(k) + costs.verify_s(k)) / costs.t_decode_s
    except UsageError:
        return [f"TensorRT-LLM: the step costs do not cover K={k}; add it to the cost profile to compute the gate"]
    accepted_per_step = max(tau_break_even - 1.0, 0.0)
    rate_threshold = min(accepted_per_step / k, 1.0)
    window = MIN_GATE_WINDOW_REQUESTS
    entry = baseline.for_class(verdict.window.key.cls) if baseline else None
    if entry is not None and entry.request_tau_sd and entry.tau > tau_break_even:
        z = NormalDist().inv_cdf(0.99)  # a false disable (permanent in TensorRT-LLM) should be rare
        window = max(window, math.ceil((z * entry.request_tau_sd / (entry.tau - tau_break_even)) ** 2))
    return [
        f"TensorRT-LLM: speculative_config acceptance_rate_threshold: {rate_threshold:.3f} "
        f"(accepted/drafted at break-even tau {tau_break_even:.2f}, K={k}), "
        f"acceptance_rate_window_size: {window} (completed requests; builds whose gate "
        f"averages accepted tokens per step take threshold {accepted_per_step:.2f})"
    ]
