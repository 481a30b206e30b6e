"""Small frames for the pages: checks and facts (Overview), acceptance per class with filters (Rejection),
per-slot rates (Positions), the K sweep and recommendation (Sweep), and two runs side by side (Compare).

Its own module because these are aggregates of a run's summary and request rows: a page never ships more
than a few hundred rows to the browser, whatever the run's size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import pandas as pd

from dflash_doctor.rundir.run_record import OVERALL
from dflash_doctor.stats.metrics import (
    NUM_BOOTSTRAP_RESAMPLES,
    bootstrap_ratio,
    group_rng,
    interval,
    summarize,
    summary_group,
)
from dflash_doctor.rundir.run_record import Recommendation, RunRecord, Summary, Sweep
from dflash_doctor.rundir.status import STATUS_RANK, VERDICT_NONE, CheckResult, overall_status, status_counts

if TYPE_CHECKING:
    from pandas.io.formats.style_render import ExtFormatter


# Prompt-length buckets for the class filter: lower edges in prompt tokens.
PROMPT_LENGTH_EDGES = (0, 128, 512, 2048, 8192)


def checks_table(checks: Iterable[CheckResult]) -> pd.DataFrame:
    """One row per check, worst status first (what needs attention leads the page)."""
    rows = [
        {"status": check.status, "check": check.id, "summary": check.summary, "findings": len(check.findings)}
        for check in checks
    ]
    frame = pd.DataFrame(rows, columns=["status", "check", "summary", "findings"])
    order = (
        frame["status"].map({status.value: rank for rank, status in enumerate(STATUS_RANK)}).fillna(len(STATUS_RANK))
    )
    return (
        frame.assign(_order=order)
        .sort_values(["_order", "check"], kind="stable")
        .drop(columns="_order")
        .reset_index(drop=True)
    )


def facts_table(facts: dict[str, Any]) -> pd.DataFrame:
    """A flat key/value table of a nested dict (models, environment), lists shown as text."""
    rows: list[dict[str, str]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            rows.append({"key": prefix, "value": "—" if value is None else str(value)})

    walk("", facts)
    return pd.DataFrame(rows, columns=["key", "value"])


def prompt_length_bucket(prompt_num_tokens: pd.Series) -> pd.Series:
    """Label each request with its prompt-length bucket ("<128", "128-511", ..., ">=8192")."""
    edges = list(PROMPT_LENGTH_EDGES) + [np.inf]
    labels = [f"<{edges[1]}"] + [f"{lo}-{hi - 1}" for lo, hi in zip(edges[1:-2], edges[2:-1])] + [f">={edges[-2]}"]
    return pd.cut(prompt_num_tokens.astype("float64"), bins=edges, labels=labels, right=False).astype(str)


def with_length_bucket(requests: pd.DataFrame) -> pd.DataFrame:
    """Requests plus a ``length_bucket`` column (the filter's third dimension)."""
    return requests.assign(length_bucket=prompt_length_bucket(requests["prompt_num_tokens"]))


def filter_requests(
    requests: pd.DataFrame,
    classes: Sequence[str] | None = None,
    subclasses: Sequence[str] | None = None,
    length_buckets: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Keep the requests matching every given filter (None or empty = no filter on that column)."""
    keep = pd.Series(True, index=requests.index)
    for column, allowed in (("class", classes), ("subclass", subclasses), ("length_bucket", length_buckets)):
        if allowed:
            keep &= requests[column].isin(list(allowed))
    return requests[keep]


def bootstrap_ratio_ci(
    numerator: np.ndarray, denominator: np.ndarray, *, seed: int = 0, group: str = OVERALL
) -> tuple[float, float]:
    """95% CI of ``sum(numerator) / sum(denominator)`` resampling requests (rows), through the same
    bootstrap and interval as the summary's (:mod:`dflash_doctor.stats.metrics`)."""
    samples = bootstrap_ratio(numerator, denominator, NUM_BOOTSTRAP_RESAMPLES, group_rng(seed, group))
    lo, hi = interval(samples)
    return (float(lo), float(hi))


CLASS_TABLE_COLUMNS = [
    "class",
    "num_requests",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "tau",
    "tau_lo",
    "tau_hi",
    "rejection_rate",
    "rejection_rate_lo",
    "rejection_rate_hi",
]


def filtered_summary(steps: pd.DataFrame, requests: pd.DataFrame, *, seed: int = 0) -> Summary:
    """The run's summary recomputed over a subset of requests (same metrics code, same CIs)."""
    return summarize(steps[steps["request_id"].isin(requests["request_id"])], requests, seed=seed)


def class_table(summary: Summary, requests: pd.DataFrame, *, seed: int = 0) -> pd.DataFrame:
    """tau and draft-token rejection rate per class with 95% CIs, "overall" first, then worst tau first.

    tau and its CI come from the summary (bonus included, vLLM's mean acceptance length). The rejection
    rate is 1 - accepted / drafted tokens, pooled; its CI resamples the class's requests, as the
    summary's CIs do.
    """
    rows = []
    for cls, metrics in summary.scopes().items():
        if not metrics.num_drafts:
            continue
        members = requests if cls == "overall" else requests[requests["class"] == cls]
        accepted_lo, accepted_hi = bootstrap_ratio_ci(
            members["num_accepted_tokens"].to_numpy(),
            members["num_draft_tokens"].to_numpy(),
            seed=seed,
            group=summary_group(cls),
        )
        tau_lo, tau_hi = metrics.mean_acceptance_length_ci
        rows.append(
            {
                "class": cls,
                "num_requests": metrics.num_requests,
                "num_drafts": metrics.num_drafts,
                "num_draft_tokens": metrics.num_draft_tokens,
                "num_accepted_tokens": metrics.num_accepted_tokens,
                "tau": metrics.mean_acceptance_length,
                "tau_lo": tau_lo,
                "tau_hi": tau_hi,
                "rejection_rate": 1.0 - metrics.draft_acceptance_rate
                if metrics.draft_acceptance_rate is not None
                else None,
                "rejection_rate_lo": 1.0 - accepted_hi,
                "rejection_rate_hi": 1.0 - accepted_lo,
            }
        )
    frame = pd.DataFrame(rows, columns=CLASS_TABLE_COLUMNS).astype({c: "float64" for c in CLASS_TABLE_COLUMNS[5:]})
    frame = frame.assign(_not_overall=frame["class"] != "overall")
    return frame.sort_values(["_not_overall", "tau"], kind="stable").drop(columns="_not_overall").reset_index(drop=True)


def class_requests(requests: pd.DataFrame, cls: str) -> pd.DataFrame:
    """The drill-down: one class's requests, lowest tau first (the worst ones are what to read)."""
    columns = [
        "request_id",
        "subclass",
        "length_bucket",
        "prompt_num_tokens",
        "num_output_tokens",
        "num_drafts",
        "tau",
        "acceptance_rate",
        "stop_reason",
    ]
    chosen = requests[requests["class"] == cls]
    draft_tokens = chosen["num_draft_tokens"].where(chosen["num_draft_tokens"] > 0)
    chosen = chosen.assign(acceptance_rate=chosen["num_accepted_tokens"] / draft_tokens)
    return chosen.sort_values(["tau", "request_id"], kind="stable")[columns].reset_index(drop=True)


POSITION_COLUMNS = ["class", "slot", "unconditional", "unconditional_lo", "unconditional_hi", "conditional"]


def position_table(summary: Summary) -> pd.DataFrame:
    """Per-slot acceptance for "overall" and every class, long format (1-based draft slot).

    unconditional r_i = P(at least i tokens accepted) per draft; conditional a_i = r_i / r_{i-1}
    = P(slot i accepted | slots before it accepted): where a_i drops is where the draft loses.
    """
    rows = []
    for cls, metrics in summary.scopes().items():
        if not metrics.num_drafts:
            continue  # no drafts: the rates are undefined (NaN), not zero
        rates = metrics.acceptance_rate_per_pos
        cis = metrics.acceptance_rate_per_pos_ci or [[None, None]] * len(rates)  # telemetry may lack the intervals
        conditional = metrics.conditional_acceptance_rate_per_pos
        for slot, (rate, (lo, hi), cond) in enumerate(zip(rates, cis, conditional), start=1):
            rows.append(
                {
                    "class": cls,
                    "slot": slot,
                    "unconditional": rate,
                    "unconditional_lo": lo,
                    "unconditional_hi": hi,
                    "conditional": cond,
                }
            )
    return pd.DataFrame(rows, columns=POSITION_COLUMNS).astype({c: "float64" for c in POSITION_COLUMNS[2:]})


# A slot counts for "weakest slot" only when at least this share of drafts reached it: a_i of a slot
# that 3 drafts reached is noise, not a finding.
MIN_SLOT_REACH = 0.05


def weakest_slots(table: pd.DataFrame, min_reach: float = MIN_SLOT_REACH) -> pd.DataFrame:
    """Per class, the reached slot with the lowest conditional acceptance (rows of ``position_table``).

    Reach of slot i is r_{i-1} (1 for slot 1): the share of drafts whose earlier slots were all accepted.
    """
    reach = table.groupby("class")["unconditional"].shift(1).fillna(1.0)
    reached = table[(reach >= min_reach) & table["conditional"].notna()]
    return reached.loc[reached.groupby("class", sort=False)["conditional"].idxmin()].reset_index(drop=True)


SWEEP_COLUMNS = ["class", "k", "mean_acceptance_length", "tau_lo", "tau_hi", "speedup", "estimate"]


def sweep_table(sweep: Sweep) -> pd.DataFrame:
    """The sweep rows as one long frame ("overall" plus each class)."""
    rows = []
    for cls, entries in sweep.scopes().items():
        for entry in entries:
            lo, hi = entry.mean_acceptance_length_ci
            rows.append(
                {
                    "class": cls,
                    "k": entry.k,
                    "mean_acceptance_length": entry.mean_acceptance_length,
                    "tau_lo": lo,
                    "tau_hi": hi,
                    "speedup": entry.speedup,
                    "estimate": entry.estimate,
                }
            )
    return pd.DataFrame(rows, columns=SWEEP_COLUMNS)


def step_cost_table(sweep: Sweep) -> pd.DataFrame:
    """The draft and verify milliseconds per K behind the sweep's speedups."""
    costs = sweep.step_costs()
    return (
        pd.DataFrame(
            {
                "draft ms": {k: 1000 * v for k, v in costs.t_draft_s.items()},
                "verify ms": {k: 1000 * v for k, v in costs.t_verify_s.items()},
            }
        )
        .rename_axis("K")
        .sort_index()
    )


def recommendation_table(recommendation: dict[str, Recommendation]) -> pd.DataFrame:
    """Recommended K per class ("overall" first); K = 0 means speculation off for that class."""
    rows = [
        {
            "class": cls,
            "k": rec.k,
            "conservative_k": rec.conservative_k,
            "speedup": rec.speedup,
            "reason": rec.reason,
        }
        for cls, rec in recommendation.items()
    ]
    frame = pd.DataFrame(rows, columns=["class", "k", "conservative_k", "speedup", "reason"])
    return (
        frame.assign(_first=frame["class"] != "overall")
        .sort_values(["_first", "class"])
        .drop(columns="_first")
        .reset_index(drop=True)
    )


def run_verdict(checks: Sequence[CheckResult]) -> tuple[str, str]:
    """(verdict, sentence) for the whole run: :func:`dflash_doctor.rundir.status.overall_status` of its checks
    and how many checks ended in each status."""
    statuses = [check.status for check in checks]
    status = overall_status(statuses)
    if status == VERDICT_NONE:
        return (
            status,
            "No checks were recorded in this run (replay/sweep runs have none; `dflash-doctor check` adds them).",
        )
    counts = status_counts(statuses)
    words = {"fail": "failed", "error": "errored", "warn": "warned", "pass": "passed", "skip": "skipped"}
    parts = [f"{counts[s]} {words[s]}" for s in STATUS_RANK if counts[s]]
    return status, f"{len(checks)} checks: " + ", ".join(parts) + "."


COMPARISON_FORMATS: ExtFormatter = {"BASE": "{:.3f}", "NEW": "{:.3f}", "delta": "{:+.3f}"}


def comparison_table(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """``compare_runs`` rows as a table: one line per class and metric, intervals as text."""

    def interval(ci: Sequence[float] | None) -> str:
        return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "—"

    frame = pd.DataFrame(
        [
            {
                "class": row["class"],
                "metric": row["label"],
                "BASE": row["base"],
                "BASE 95% CI": interval(row["base_ci"]),
                "NEW": row["new"],
                "NEW 95% CI": interval(row["new_ci"]),
                "delta": row["delta"],
                "regression": bool(row["regression"]),
                "note": row["note"],
            }
            for row in rows
        ],
        columns=["class", "metric", "BASE", "BASE 95% CI", "NEW", "NEW 95% CI", "delta", "regression", "note"],
    )
    return frame.astype({"BASE": "float64", "NEW": "float64", "delta": "float64"})


def highlight_regressions(row: pd.Series) -> list[str]:
    """Styler rule: a regressed line is red, an improvement beyond noise is left plain."""
    style = "background-color: #fcd9d7; color: #991b1b; font-weight: 600" if row.get("regression") else ""
    return [style] * len(row)


def run_facts(record: RunRecord) -> dict[str, Any]:
    """The facts that say what ran: models (identity and kind facts), environment, config."""
    return {
        "models": {role: info.fields() for role, info in record.models.items()},
        "environment": record.environment,
        "config": record.config,
    }


def changed_facts(base: RunRecord, new: RunRecord) -> pd.DataFrame:
    """Model, environment and config facts that differ between two runs (the usual suspects)."""
    base_facts = facts_table(run_facts(base)).set_index("key")["value"]
    new_facts = facts_table(run_facts(new)).set_index("key")["value"]
    both = pd.concat([base_facts.rename("BASE"), new_facts.rename("NEW")], axis=1).fillna("—")
    return both[both["BASE"] != both["NEW"]].rename_axis("fact").reset_index()
