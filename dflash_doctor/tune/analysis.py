"""Per-class and overall figures of a tune grid, with bootstrap intervals, and the net speedup vs K = 0.

Input: one row per request per (K, load) cell (``requests.parquet``, :meth:`TimedRequest.as_row`; the load
under its kind's name, ``concurrency`` or ``request_rate``)
and the run-level throughput of each cell. Every interval is the project's request-level bootstrap
(:func:`dflash_doctor.stats.metrics.resample_multiplicities`, 95% percentile), seeded per scope:

* ``ttft_s``, ``e2e_s``: means over requests; ``tpot_s``: pooled, decode time over output tokens after the
  first (long answers weigh more, as in a token-rate);
* ``tau`` (vLLM's mean acceptance length, bonus included) = 1 + accepted / drafts, pooled;
* ``rollback_per_token``: target tokens verified and thrown away per output token, (drafted - accepted) /
  output tokens, pooled;
* ``step_s``: decode time per verify step (sum of decode time / sum of drafts): what one speculative step
  costs on the engine at this load; it feeds the cost fit (:mod:`.prediction`);
* overall only: ``per_request``, the per-request figures the cost fit resamples for its intervals (one
  entry per request and pass: request id, pass, decode seconds, tokens after the first, drafts and accepted
  drafts, 0 where the engine reported none), so a cost interval is re-derivable from tune.json alone;
* ``speedup``: net speedup of K against K = 0 at the same load, TPOT(0) / TPOT(K), on the requests both
  runs answered, resampled in pairs (the same requests in both numerator and denominator);
* overall only: ``output_tokens_per_s`` and ``requests_per_s`` of the run, and ``throughput_speedup``,
  the output tokens/s ratio against K = 0 (no interval: one run is one figure).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from dflash_doctor.stats.metrics import (
    NUM_BOOTSTRAP_RESAMPLES,
    bootstrap_pooled,
    group_rng,
    interval,
    ratio_of_sums,
    summary_group,
)
from dflash_doctor.tune.loads import CONCURRENCY, load_kind, load_of, load_text

OVERALL = "overall"


def pooled(
    columns: list[np.ndarray], combine, *, seed: int, group: str, n_boot: int = NUM_BOOTSTRAP_RESAMPLES
) -> tuple[float, list[float]]:
    """``combine`` of the column sums over requests, and its 95% bootstrap interval over requests."""
    if len(columns[0]) == 0:
        return float("nan"), [float("nan"), float("nan")]
    sums = np.array([[float(np.sum(column)) for column in columns]])
    with np.errstate(divide="ignore", invalid="ignore"):
        point = float(combine(sums)[0])
    samples = bootstrap_pooled(columns, combine, n_boot, group_rng(seed, group))
    return point, [float(x) for x in interval(samples)]


def _tau(sums: np.ndarray) -> np.ndarray:
    return 1.0 + ratio_of_sums(sums)


def _paired_speedup(sums: np.ndarray) -> np.ndarray:
    """columns: decode time and tokens at K = 0, then at K: TPOT(0) / TPOT(K)."""
    base = ratio_of_sums(sums[:, 0:2])
    spec = ratio_of_sums(sums[:, 2:4])
    return base / spec


def _figures(rows: pd.DataFrame, seed: int, group: str) -> dict[str, Any]:
    tokens_after_first = (rows["num_output_tokens"] - 1).clip(lower=0).to_numpy()
    ones = np.ones(len(rows))
    figures: dict[str, Any] = {
        "num_requests": int(len(rows)),
        "num_output_tokens": int(rows["num_output_tokens"].sum()),
    }
    for name, column in (("ttft_s", "ttft_s"), ("e2e_s", "e2e_s")):
        figures[name], figures[f"{name}_ci"] = pooled(
            [rows[column].to_numpy(), ones], ratio_of_sums, seed=seed, group=f"{group}:{name}"
        )
    figures["tpot_s"], figures["tpot_s_ci"] = pooled(
        [rows["decode_s"].to_numpy(), tokens_after_first], ratio_of_sums, seed=seed, group=f"{group}:tpot"
    )
    spec = rows.dropna(subset=["num_drafts"])
    spec = spec[spec["num_drafts"] > 0]
    if len(spec):
        accepted, drafts = spec["num_accepted_tokens"].to_numpy(), spec["num_drafts"].to_numpy()
        figures["tau"], figures["tau_ci"] = pooled([accepted, drafts], _tau, seed=seed, group=f"{group}:tau")
        wasted = (spec["num_draft_tokens"] - spec["num_accepted_tokens"]).to_numpy()
        figures["rollback_per_token"], figures["rollback_per_token_ci"] = pooled(
            [wasted, spec["num_output_tokens"].to_numpy()], ratio_of_sums, seed=seed, group=f"{group}:rollback"
        )
        figures["step_s"] = float(spec["decode_s"].sum() / spec["num_drafts"].sum())
    return figures


def _per_request_figures(rows: pd.DataFrame) -> dict[str, list]:
    """The columns :func:`dflash_doctor.tune.prediction.fit_costs` resamples: step times per request, paired
    across K by request id (the same prompts at every K), the pass telling the baseline's two runs apart."""
    repeat = rows["repeat"] if "repeat" in rows else pd.Series(0, index=rows.index)
    return {
        "request_id": [str(x) for x in rows["request_id"]],
        "repeat": [int(x) for x in repeat.fillna(0)],
        "decode_s": [float(x) for x in rows["decode_s"]],
        "tokens": [int(x) for x in (rows["num_output_tokens"] - 1).clip(lower=0)],
        "drafts": [int(x) for x in rows["num_drafts"].fillna(0)],
        "accepted": [int(x) for x in rows["num_accepted_tokens"].fillna(0)],
    }


def _per_request(rows: pd.DataFrame) -> pd.DataFrame:
    """Decode time and tokens after the first per request id, summed over repeats (the baseline's two passes)."""
    tokens = (rows["num_output_tokens"] - 1).clip(lower=0)
    return rows.assign(tokens=tokens).groupby("request_id", as_index=False)[["decode_s", "tokens"]].sum()


def _speedup(base: pd.DataFrame, spec: pd.DataFrame, seed: int, group: str) -> tuple[float, list[float]]:
    paired = _per_request(base).merge(_per_request(spec), on="request_id", suffixes=("_0", "_k"))
    columns = [paired[f"{name}{side}"].to_numpy() for side in ("_0", "_k") for name in ("decode_s", "tokens")]
    return pooled(columns, _paired_speedup, seed=seed, group=f"{group}:speedup")


def baseline_drift(rows: pd.DataFrame) -> dict[str, float]:
    """Per load: pooled TPOT of the baseline's second pass (after the grid) over its first, minus 1.
    The speedups divide by both passes pooled; a drift of x% puts about x/2% on every speedup."""
    base = rows[rows["k"] == 0]
    drift = {}
    for load, at_load in base.groupby(load_kind(rows)):
        passes = [
            part["decode_s"].sum() / (part["num_output_tokens"] - 1).clip(lower=0).sum()
            for _, part in at_load.groupby("repeat")
        ]
        if len(passes) == 2:
            drift[load_text(load)] = float(passes[1] / passes[0] - 1.0)
    return drift


def analyse(
    rows: pd.DataFrame, throughput: dict[tuple[int, Any], dict[str, float]], *, seed: int = 0
) -> list[dict[str, Any]]:
    """One cell per (load, K, scope): the figures above; ``throughput[(K, load)]`` holds the run-level
    ``output_tokens_per_s`` and ``requests_per_s``."""
    cells: list[dict[str, Any]] = []
    kind = load_kind(rows)
    for load in sorted(rows[kind].unique().tolist()):
        at_load = rows[rows[kind] == load]
        base_all = at_load[at_load["k"] == 0]
        for k in sorted(at_load["k"].unique()):
            cell_rows = at_load[at_load["k"] == k]
            scopes = [(OVERALL, cell_rows, base_all)] + [
                (str(cls), part, base_all[base_all["class"] == cls])
                for cls, part in cell_rows.groupby("class", sort=True)
            ]
            for scope, part, base in scopes:
                group = f"{'c' if kind == CONCURRENCY else 'r'}{load_text(load)}:k{k}:{summary_group(scope)}"
                cell = {kind: load, "k": int(k), "scope": scope, **_figures(part, seed, group)}
                if k == 0:
                    cell["speedup"], cell["speedup_ci"] = 1.0, [1.0, 1.0]
                elif len(base):
                    cell["speedup"], cell["speedup_ci"] = _speedup(base, part, seed, group)
                if scope == OVERALL:
                    cell["per_request"] = _per_request_figures(part)
                    cell.update(throughput[(int(k), load)])
                    base_rate = throughput.get((0, load), {}).get("output_tokens_per_s")
                    if base_rate:
                        cell["throughput_speedup"] = cell["output_tokens_per_s"] / base_rate
                cells.append(_finite(cell) | {kind: load})  # a request rate may be inf (all at once), unlike a figure
    return cells


def _finite(cell: dict[str, Any]) -> dict[str, Any]:
    """NaN figures become None, so tune.json stays strict JSON (a rate of inf
    is written "inf": :func:`dflash_doctor.tune.experiment.strict_json`)."""

    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return {key: clean(value) for key, value in cell.items()}


def cell(cells: list[dict[str, Any]], load: Any, k: int, scope: str = OVERALL) -> dict[str, Any] | None:
    """The cell of one (load, K, scope), or None."""
    return next((c for c in cells if load_of(c) == load and c["k"] == k and c["scope"] == scope), None)


def fill_from_counters(cells: list[dict[str, Any]], rows: pd.DataFrame, counters: dict[tuple[int, Any], Any]) -> None:
    """Overall tau, rollback and step time from the server's /metrics deltas over a run, where its
    responses carried no per-request figures (a server started without them); no interval, no classes.
    ``counters[(K, load)]`` is a :class:`~dflash_doctor.serving.responses.SpecMeasurement`."""
    for c in cells:
        measured = counters.get((c["k"], load_of(c)))
        if c["scope"] != OVERALL or c.get("tau") is not None or measured is None or not measured.num_drafts:
            continue
        part = rows[(rows["k"] == c["k"]) & (rows[load_kind(c)] == load_of(c))]
        c["tau"], c["tau_ci"] = measured.tau, None
        c["rollback_per_token"] = (measured.num_draft_tokens - measured.num_accepted_tokens) / max(
            int(part["num_output_tokens"].sum()), 1
        )
        c["step_s"] = float(part["decode_s"].sum()) / measured.num_drafts
        c["acceptance_from"] = "/metrics counter deltas"
