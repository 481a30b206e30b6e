"""Alarms beside the Judge's rules (telemetry/verdict.py), for failures users report from production.

* ``collapse``: acceptance fell to ~0, tau ~1 (vLLM #46435 lm_head sharing, #49559 ModelRunnerV2 0%,
  #48167 FlashInfer non-causal under CUDA graphs): the window's whole 95% interval is below tau
  ``COLLAPSE_TAU``. Every verify step then pays for K draft tokens and keeps none, slower than no
  speculation, so the advice is the fallback's (K = 0 unless a priced smaller K pays).
* ``position-decay``: decay toward the end of the block - positions whose acceptance interval lies
  wholly under ``DECAY_FACTOR`` of the baseline's rate while position 0 holds (at least ``HELD_FACTOR``
  of its baseline): the first draft token is still right and later ones are not (longer contexts than
  the draft was trained on, a draft attention/sliding-window change, a served K beyond the trained
  block). Needs a baseline run with per-position rates (``check`` writes them).

A draft that silently stopped (tokens generated, no draft counted) is the Judge's ``drafting-stopped``.
The same three failures, over the engines' raw counters, are alert rules in deploy/prometheus/.
"""

from __future__ import annotations

from dflash_doctor.telemetry.counts import rate_intervals
from dflash_doctor.telemetry.verdict import Alert, Judge, WindowVerdict, fallback_advice

COLLAPSE_TAU = 1.1
DECAY_FACTOR = 0.5
HELD_FACTOR = 0.8
MIN_BASELINE_RATE = 0.05  # positions the baseline itself rarely accepts cannot decay measurably


def collapse_alert(verdict: WindowVerdict, judge: Judge) -> Alert | None:
    tau, ci = verdict.mean_acceptance_length, verdict.mean_acceptance_length_ci
    if tau is None or ci is None or ci[1] >= COLLAPSE_TAU:
        return None
    key = verdict.window.key
    return Alert(
        "collapse",
        str(key),
        f"{key}: acceptance collapsed - tau {tau:.2f} [{ci[0]:.2f}, {ci[1]:.2f}] "
        f"over {verdict.window.counts.num_drafts:.0f} drafts at K={verdict.k}: "
        f"drafts are almost never accepted (seen after engine upgrades: vLLM #46435, #49559).",
        fallback_advice(judge.server_kind, verdict, judge.baseline, judge.costs, judge.thresholds.speedup_floor),
    )


def position_decay_alert(verdict: WindowVerdict, judge: Judge) -> Alert | None:
    entry = judge.baseline.for_class(verdict.window.key.cls) if judge.baseline else None
    rates, intervals = verdict.acceptance_rate_per_pos, rate_intervals(verdict.window.counts)
    if entry is None or entry.rates is None or not rates or intervals is None:
        return None
    base = entry.rates
    if rates[0] < HELD_FACTOR * base[0]:
        return None  # the whole block dropped: acceptance-drop / collapse say so
    decayed = [
        i
        for i in range(1, min(len(rates), len(base)))
        if base[i] >= MIN_BASELINE_RATE and intervals[i][1] < DECAY_FACTOR * base[i]
    ]
    if not decayed:
        return None
    key = verdict.window.key
    shown = ", ".join(f"r_{i} {rates[i]:.3f} vs {base[i]:.3f}" for i in decayed[:4]) + (
        ", ..." if len(decayed) > 4 else ""
    )
    return Alert(
        "position-decay",
        str(key),
        f"{key}: decay toward the end of the block - position(s) "
        f"{', '.join(map(str, decayed))} accept under {DECAY_FACTOR:g}x their baseline rate "
        f"({shown}) while position 0 holds ({rates[0]:.3f} vs {base[0]:.3f}).",
        (
            "why: later draft positions lost acceptance while the first held; "
            "compare the window's context lengths with the draft's training, "
            f"and a served K={verdict.k} with the draft's trained block size (`dflash-doctor check` "
            "of the pair on prompts like production's shows where drafts start to miss).",
        ),
    )


def apply_alarms(verdict: WindowVerdict, judge: Judge) -> WindowVerdict:
    """Add this module's alarms to a judged window (windows without an acceptance verdict get none)."""
    if verdict.status not in ("ok", "alert"):
        return verdict
    for alarm in (collapse_alert, position_decay_alert):
        alert = alarm(verdict, judge)
        if alert is not None:
            verdict.alerts.append(alert)
    if verdict.alerts:
        verdict.status = "alert"
    return verdict
