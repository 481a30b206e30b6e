"""The recommendation of a tune grid, per class and load, written as each engine's own setting.

Per load level and scope (overall, each class) the K *shown to pay* - the low end of its measured
speedup's 95% interval at or above 1 - go through the project's one recommender
(:func:`dflash_doctor.stats.speedup.recommend`: the best K, a conservative K within 95% of it, strict
classes judged at the low end of their interval). Each pick carries a ``verdict`` read off the intervals:

* ``pays``: some K's interval lies wholly at or above 1; that K is set, and the Ks the measurement cannot
  tell from it (:func:`dflash_doctor.stats.speedup.within_noise`) are named, shown to pay or not;
* ``does not pay``: every K's interval lies wholly below 1; speculation off;
* ``within the noise``: neither; the reason names the best measured K with its interval (a point speedup
  of 1.05x whose interval reaches 0.90x is a coin toss on the user's server, not a gain) and the Ks within
  its noise, and the setting stays K = 0 - nothing is turned on that was not shown to pay - while the
  reason says that more requests per cell can tell.

The overall K per load becomes the engine setting (one server serves every class; a class whose best
K differs is named, to route or to accept):

* vLLM: ``num_speculative_tokens`` when one K fits every load, else, for concurrency levels,
  ``num_speculative_tokens_per_batch_size`` with one ``[start, end, K]`` range per measured load (a batch
  size between two measured loads takes the next measured load's K; vLLM carries the last range's K beyond
  it; K may be 0); for request rates, which are not batch sizes, the differing K is stated with the advice
  to measure concurrency levels for the ranges; speculation off at every load is "drop --speculative-config".
* SGLang (DFLASH): ``--speculative-num-draft-tokens K + 1`` (SGLang counts the block's anchor); its
  batch-size tiers (``--speculative-adaptive``) are EAGLE/EAGLE3 only (docs/engines.md), so differing K
  across loads is stated, not configured.
* llama.cpp: ``--spec-draft-n-max K``; off is "restart without -md / --spec-type".
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from dflash_doctor.models.kind_serving import DFLASH, KindServing
from dflash_doctor.report.templating import ci
from dflash_doctor.rundir.run_record import SweepRow
from dflash_doctor.stats.speedup import k_range_text, recommend, within_noise
from dflash_doctor.tune.analysis import OVERALL
from dflash_doctor.tune.loads import CONCURRENCY, load_label, load_of, load_text
from dflash_doctor.tune.prediction import shown_to_pay


def _rows(cells: list[dict[str, Any]], load: Any, scope: str) -> list[dict[str, Any]]:
    rows = []
    for c in cells:
        # tau is informative only (a class on llama.cpp has none: its counters pool the run): the speedup is measured
        if load_of(c) == load and c["scope"] == scope and c["k"] > 0 and c.get("speedup") is not None:
            rows.append(
                {
                    "k": c["k"],
                    "mean_acceptance_length": c.get("tau"),
                    "mean_acceptance_length_ci": c.get("tau_ci"),
                    "speedup": c["speedup"],
                    "speedup_ci": c.get("speedup_ci"),
                }
            )
    return rows


def _sweep_row(row: dict[str, Any]) -> SweepRow:
    """A measured cell as the sweep row :func:`recommend` ranks (its speedup measured, not priced)."""
    return SweepRow(
        k=row["k"],
        mean_acceptance_length=row["mean_acceptance_length"],
        mean_acceptance_length_ci=list(row["mean_acceptance_length_ci"] or [None, None]),
        speedup=row["speedup"],
        estimate="exact",
        speedup_ci=list(row["speedup_ci"] or [None, None]),
    )


PAYS, DOES_NOT_PAY, WITHIN_NOISE = "pays", "does not pay", "within the noise"


def verdict(rows: list[dict[str, Any]]) -> str:
    """The scope's verdict from its measured intervals (module doc): a K without an interval is not shown anything."""
    if any(shown_to_pay(row.get("speedup_ci")) for row in rows):
        return PAYS
    highs = [(row.get("speedup_ci") or [None, None])[1] for row in rows]
    return DOES_NOT_PAY if highs and all(high is not None and high < 1.0 for high in highs) else WITHIN_NOISE


def _noise_text(pick_k: int, rows: list[dict[str, Any]]) -> tuple[list[int], str]:
    """The Ks the measurement cannot tell from ``pick_k`` (itself included) and '; K 2-8 within the noise'."""
    ks = within_noise(pick_k, [_sweep_row(row) for row in sorted(rows, key=lambda row: row["k"])], None)
    return ks, (f"; {k_range_text(ks)} within the noise" if len(ks) > 1 else "")


def recommend_grid(
    cells: list[dict[str, Any]],
    *,
    strict_classes: tuple[str, ...] = (),
    strict_max_k: int = 4,
    conservative_share: float = 0.95,
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{load text: {scope: recommendation}}`` from the measured speedups (load text: :func:`load_text`)."""
    advice: dict[str, dict[str, dict[str, Any]]] = {}
    for load in sorted({load_of(c) for c in cells}):
        scopes = sorted({c["scope"] for c in cells if load_of(c) == load}, key=lambda s: (s != OVERALL, s))
        rows = {scope: _rows(cells, load, scope) for scope in scopes}
        paying = {
            scope: [row for row in scope_rows if shown_to_pay(row.get("speedup_ci"))]
            for scope, scope_rows in rows.items()
        }
        picks = recommend(
            {scope: [_sweep_row(row) for row in scope_rows] for scope, scope_rows in paying.items()},
            conservative_share=conservative_share,
            strict_classes=strict_classes,
            strict_max_k=strict_max_k,
        )
        # a strict class is judged on the K it may serve only
        eligible = {
            scope: [row for row in scope_rows if scope not in strict_classes or row["k"] <= strict_max_k]
            for scope, scope_rows in rows.items()
        }
        chosen: dict[str, dict[str, Any]] = {
            scope: dataclasses.asdict(pick) | {"verdict": verdict(eligible[scope])} for scope, pick in picks.items()
        }
        for scope, pick in chosen.items():
            if not eligible[scope]:
                continue
            if pick["verdict"] == PAYS:
                # the recommender saw the paying Ks only; the Ks within the noise of its pick are named among all
                among_paying = pick.get("ks_within_noise") or []
                pick["ks_within_noise"], noise = _noise_text(pick["k"], eligible[scope])
                named = f"; {k_range_text(among_paying)} within the noise" if len(among_paying) > 1 else ""
                if named and named in pick["reason"]:
                    pick["reason"] = pick["reason"].replace(named, noise, 1)
                elif noise:
                    pick["reason"] = pick["reason"].rstrip(".") + noise + "."
                continue
            best = max(eligible[scope], key=lambda row: row["speedup"])
            pick["ks_within_noise"], noise = _noise_text(best["k"], eligible[scope])
            measured = (
                f"the best measured, K={best['k']}, ran at {best['speedup']:.2f}x {ci(best['speedup_ci'])}{noise}"
            )
            if pick["verdict"] == DOES_NOT_PAY:
                pick["reason"] = (
                    f"Speculation off: every K is shown not to pay (the high end of its speedup's "
                    f"95% interval below 1); {measured}."
                )
            else:
                pick["confidence"] = "uncertain"
                pick["reason"] = (
                    f"Within the noise: no K is shown to pay (the low end of its speedup's 95% "
                    f"interval at or above 1) nor not to pay (the high end below 1); {measured}. The setting stays K=0 "
                    f"until more requests per cell (--max-requests) tell."
                )
        advice[load_text(load)] = chosen
    return advice


def batch_ranges(k_by_load: dict[int, int]) -> list[list[int]]:
    """vLLM ``num_speculative_tokens_per_batch_size`` entries: one inclusive range per measured load."""
    ranges, start = [], 1
    for load in sorted(k_by_load):
        ranges.append([start, load, k_by_load[load]])
        start = load + 1
    return ranges


def settings_per_server(
    advice: dict[str, dict[str, dict[str, Any]]], serving: KindServing = DFLASH, kind: str = CONCURRENCY
) -> dict[str, str]:
    """The overall recommendation per load (of ``kind``) as vLLM, SGLang and llama.cpp settings (exact flag text)
    for the draft kind ``serving`` declares: its vLLM method, DRAFT as the config's ``"model"`` only for a kind
    with a checkpoint of its own, and the SGLang / llama.cpp flags where that engine serves the kind."""
    k_by_load = {float(load): int(picks[OVERALL]["k"]) for load, picks in advice.items() if OVERALL in picks}
    ks = set(k_by_load.values())
    loads = ", ".join(f"{load_label(kind, load)}: K={k}" for load, k in sorted(k_by_load.items()))
    if ks == {0}:
        return {
            "vllm": "speculation off: drop --speculative-config (no K shown to pay at any measured load)",
            "sglang": "speculation off: drop --speculative-algorithm / --speculative-draft-model-path",
            "llama.cpp": "speculation off: restart llama-server without -md / --spec-type",
        }
    if len(ks) == 1:
        k = ks.pop()
        return {
            "vllm": f"--speculative-config '{json.dumps(serving.vllm_config(k))}'",
            "sglang": serving.flags("sglang", k),
            "llama.cpp": serving.flags("llamacpp", k),
        }
    differs = f"K differs by load ({loads})"
    if kind == CONCURRENCY:
        spec = {
            **serving.vllm_config(max(ks)),
            "num_speculative_tokens_per_batch_size": batch_ranges({int(load): k for load, k in k_by_load.items()}),
        }
        vllm = f"--speculative-config '{json.dumps(spec)}'"
    else:
        vllm = (
            f"{differs}; num_speculative_tokens_per_batch_size keys on batch size, not arrival rate: measure "
            f"--concurrency levels for its ranges, or num_speculative_tokens K for the rate you serve most"
        )

    def one_k_per_server(engine: str, name: str) -> str:
        if not serving.serves(engine):
            return serving.flags(engine, None)
        return f"{differs}; {name} takes one K per server: {serving.flags(engine, None)} for the load you serve most"

    return {
        "vllm": vllm,
        "sglang": one_k_per_server("sglang", "SGLang"),
        "llama.cpp": one_k_per_server("llamacpp", "llama.cpp"),
    }
