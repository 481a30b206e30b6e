"""Rejection patterns that grew between two runs: what ``compare`` adds beside its gate.

A pattern is a category of first rejections (the target token's, or the drafted token's), costed in lost
tokens per draft step so runs of different sizes compare. Its own module because only ``compare`` reads it,
and it diffs two runs where the rest of the analysis describes one.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from dflash_doctor.stats.deviations.decided import DeviationTables, frame_records

GROWTH_MIN_LOST_PER_DRAFT = 0.05  # tokens per draft step: smaller changes are noise on demo-sized runs
GROWTH_MIN_COUNT = 2  # first rejections NEW must show of a pattern before it is listed
GROWTH_TOP_N = 3  # patterns listed per class and kind


# What ``compare`` groups first rejections by: the target token's category, and the drafted token's
# category (a draft ending the turn early shows as drafted "special"). Exact token pairs are left out:
# two runs that decode different text share few pairs, so every pair of NEW would look "grown".
PATTERN_KINDS = {"category": "category", "drafted category": "draft_category"}


def pattern_costs(tables: DeviationTables) -> pd.DataFrame:
    """Lost tokens per draft step of every pattern (:data:`PATTERN_KINDS`), per class and overall: the unit
    ``compare`` diffs. Per draft step so runs of different sizes compare.

    Args:
        tables: one run's deviation tables (its decided slots and its drafts).

    Returns:
        One row per (class, kind, pattern) with lost tokens > 0: ``class`` (or ``overall``), ``kind`` (a
        key of :data:`PATTERN_KINDS`), ``pattern`` (the category), ``lost_tokens``, ``count`` (first
        rejections), ``num_drafts`` of the class and ``lost_per_draft``.
    """
    decided, drafts = tables.decided, tables.drafts
    num_drafts = drafts.groupby("class", observed=True).size()
    num_drafts.index = num_drafts.index.astype(str)
    num_drafts["overall"] = len(drafts)
    rejections = decided[decided["first_rejection"].to_numpy()]
    frames = []
    for kind, column in PATTERN_KINDS.items():
        for scope in ("class", "overall"):
            by = (["class"] if scope == "class" else []) + [column]
            grouped = (
                rejections.groupby(by, observed=True)["lost_tokens"].agg(lost_tokens="sum", count="size").reset_index()
            )
            grouped = grouped[grouped["lost_tokens"] > 0]
            grouped["pattern"] = grouped[column].astype(str)
            grouped["class"] = grouped["class"].astype(str) if scope == "class" else "overall"
            grouped["kind"] = kind
            frames.append(grouped[["class", "kind", "pattern", "lost_tokens", "count"]])
    costs = pd.concat(frames, ignore_index=True).astype({"class": str, "kind": str, "pattern": str})
    costs = costs.groupby(["class", "kind", "pattern"], as_index=False)[["lost_tokens", "count"]].sum()
    costs["num_drafts"] = costs["class"].map(num_drafts).astype(float)
    costs["lost_per_draft"] = costs["lost_tokens"] / costs["num_drafts"]
    return costs


def grown_patterns(
    base: DeviationTables,
    new: DeviationTables,
    *,
    min_growth: float = GROWTH_MIN_LOST_PER_DRAFT,
    min_count: int = GROWTH_MIN_COUNT,
    top_n: int = GROWTH_TOP_N,
) -> list[dict[str, Any]]:
    """Patterns whose lost tokens per draft step grew from BASE to NEW (e.g. special tokens after a template
    change): what ``compare`` lists beside its gate, never a regression by itself.

    Args:
        base: the BASE run's deviation tables.
        new: the NEW run's deviation tables.
        min_growth: the smallest growth listed, in lost tokens per draft step.
        min_count: the fewest first rejections NEW must show of a pattern (a single new pair is chance).
        top_n: the most patterns listed per class and kind.

    Returns:
        Records (``class``, ``kind``, ``pattern``, ``lost_per_draft_base``, ``lost_per_draft_new``,
        ``growth``, ``count_new``): classes in name order then overall, largest growth first within a class
        and kind.
    """
    keys = ["class", "kind", "pattern"]
    base_costs = pattern_costs(base).set_index(keys)
    new_costs = pattern_costs(new).set_index(keys)
    merged = (
        pd.concat(
            {
                "lost_per_draft_base": base_costs["lost_per_draft"],
                "lost_per_draft_new": new_costs["lost_per_draft"],
                "count_new": new_costs["count"],
            },
            axis=1,
        )
        .fillna(0.0)
        .reset_index()
    )
    merged["growth"] = merged["lost_per_draft_new"] - merged["lost_per_draft_base"]
    grown = merged[(merged["growth"] >= min_growth) & (merged["count_new"] >= min_count)]
    grown = grown.assign(is_overall=grown["class"] == "overall").sort_values(
        ["is_overall", "class", "kind", "growth"], ascending=[True, True, True, False], kind="stable"
    )
    grown = grown.groupby(["class", "kind"], sort=False).head(top_n).astype({"count_new": int})
    return frame_records(grown[keys + ["lost_per_draft_base", "lost_per_draft_new", "growth", "count_new"]])
