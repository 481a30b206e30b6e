"""The deviation analysis of a run as a typed record: per class and overall, the costliest first-rejection
pairs, acceptance per token category and along the sequence, confident vs uncertain misses and the
attainable-tau bound (the definitions are :mod:`dflash_doctor.stats.deviations`' docstring).

:class:`DeviationAnalysis` is what every view reads: the terminal's "why rejected", report.html / .md, the
dashboard's Deviations page; report.json holds :meth:`DeviationAnalysis.to_json` under ``why_rejected``.
The statistics are grouped counts over :class:`~dflash_doctor.stats.deviations.decided.DeviationTables`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from dflash_doctor.stats.deviations.categories import CATEGORIES
from dflash_doctor.stats.deviations.decided import DeviationTables, class_names, frame_records, run_tables, select

# Bins for acceptance along the sequence: lower edges (tokens). The last bin is open.
CONTEXT_LENGTH_EDGES = (0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
OUTPUT_POSITION_EDGES = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_TOP_N = 10

# ----------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class MissShare:
    """First rejections of one kind (confident or uncertain misses) and the drafted tokens they threw away."""

    num_first_rejections: int
    lost_tokens: int
    share_of_lost: float | None  # of all lost tokens of the slice; None when nothing was lost


@dataclass(frozen=True)
class MissSplit:
    """Confident vs uncertain first rejections, tau and the attainable-tau upper bound of one slice."""

    num_drafts: int
    num_accepted_tokens: int
    num_first_rejections: int
    lost_tokens: int
    tau: float | None  # vLLM's mean acceptance length (bonus included); None without drafts
    attainable_tau: float | None
    confident: MissShare
    uncertain: MissShare


@dataclass(frozen=True)
class PatternExample:
    """Where a rejection pair first occurred, with the output text just before it."""

    request_id: str
    step: int
    position: int
    context: str


@dataclass(frozen=True)
class RejectionPair:
    """One first-rejection pattern: the target's token, the token drafted instead, how often and what it cost."""

    target_token: int
    draft_token: int
    target_text: str
    draft_text: str
    category: str  # of the target token
    draft_category: str
    count: int
    lost_tokens: int
    share_of_lost: float
    num_confident: int
    example: PatternExample


@dataclass(frozen=True)
class CategoryRow:
    """Acceptance and lost tokens of one target-token category (:data:`~dflash_doctor.stats.deviations.CATEGORIES`)."""

    category: str
    num_decided: int
    num_accepted: int
    num_first_rejections: int
    lost_tokens: int
    acceptance_rate: float  # accepted / decided
    share_of_lost: float  # NaN when the slice lost nothing


@dataclass(frozen=True)
class BinRow:
    """Acceptance and lost tokens of one bin along the sequence (context length, output position, turn)."""

    bin: str
    num_decided: int
    num_accepted: int
    lost_tokens: int
    acceptance_rate: float


@dataclass(frozen=True)
class SliceAnalysis(MissSplit):
    """Every statistic of one slice of a run (a class, the whole run, or a dashboard filter)."""

    num_decided_tokens: int
    top_pairs: list[RejectionPair]
    categories: list[CategoryRow]  # most lost first
    costliest_category: CategoryRow | None  # the first category that lost tokens
    by_context_length: list[BinRow]
    by_output_position: list[BinRow]
    by_turn: list[BinRow]


@dataclass(frozen=True)
class Definitions:
    """How each figure is computed, stored next to the figures (report.json readers need no docs)."""

    lost_tokens: str
    acceptance_rate: str
    confident_miss: str
    attainable_tau: str
    confident_max_entropy: float
    confident_min_margin: float | None  # None when the run recorded no top-1 margin
    categories: dict[str, str]


@dataclass(frozen=True)
class DeviationAnalysis:
    """The deviation analysis of a run: per class and overall (the reports' "Why rejected" section)."""

    definitions: Definitions
    overall: SliceAnalysis
    by_class: dict[str, SliceAnalysis]

    def to_json(self) -> dict[str, Any]:
        """report.json's ``why_rejected`` object."""
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- statistics of one slice


def _bin_labels(edges: tuple[int, ...]) -> list[str]:
    labels = [f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])]
    return labels + [f">={edges[-1]}"]


def _bin(values: pd.Series, edges: tuple[int, ...]) -> pd.Series:
    """Each value's bin label (an ordered categorical, on ``values``' index)."""
    codes = np.searchsorted(np.asarray(edges), values.to_numpy(), side="right") - 1
    labels = pd.Categorical.from_codes(
        np.clip(codes, 0, len(edges) - 1), categories=pd.Index(_bin_labels(edges)), ordered=True
    )
    return pd.Series(labels, index=values.index)


def _share(part: float, whole: float) -> float | None:
    return float(part) / float(whole) if whole else None


def category_table(decided: pd.DataFrame) -> pd.DataFrame:
    """Acceptance and lost tokens per target-token category, most lost first: which kind of token costs the
    draft most.

    Args:
        decided: decided tokens (:attr:`DeviationTables.decided`, possibly narrowed by :func:`select`).

    Returns:
        One row per category: ``category``, ``num_decided``, ``num_accepted``, ``num_first_rejections``,
        ``lost_tokens``, ``acceptance_rate`` and ``share_of_lost`` (NaN when nothing was lost), by lost
        tokens then decided count, descending.
    """
    total_lost = decided["lost_tokens"].sum()
    grouped = decided.groupby("category", observed=True).agg(
        num_decided=("accepted", "size"),
        num_accepted=("accepted", "sum"),
        num_first_rejections=("first_rejection", "sum"),
        lost_tokens=("lost_tokens", "sum"),
    )
    grouped["acceptance_rate"] = grouped["num_accepted"] / grouped["num_decided"]
    grouped["share_of_lost"] = grouped["lost_tokens"] / total_lost if total_lost else np.nan
    grouped = grouped.reset_index().sort_values(["lost_tokens", "num_decided"], ascending=False, kind="stable")
    grouped["category"] = grouped["category"].astype(str)
    return grouped.reset_index(drop=True)


def pair_table(decided: pd.DataFrame) -> pd.DataFrame:
    """First-rejection pairs (target token, draft token): the exact confusions that cost the most.

    Args:
        decided: decided tokens (:attr:`DeviationTables.decided`, possibly narrowed).

    Returns:
        One row per pair: ``target_token``, ``draft_token``, ``count``, ``lost_tokens``, ``num_confident``,
        ``share_of_lost`` and ``example_row`` (the index in ``decided`` of its first occurrence), most lost
        first; empty, with those columns, when there is no first rejection.
    """
    rejections = decided[decided["first_rejection"].to_numpy()]
    total_lost = rejections["lost_tokens"].sum()
    if rejections.empty:
        return pd.DataFrame(
            columns=[
                "target_token",
                "draft_token",
                "count",
                "lost_tokens",
                "num_confident",
                "share_of_lost",
                "example_row",
            ]
        )
    grouped = rejections.groupby(["target_token", "draft_token"], sort=False).agg(
        count=("lost_tokens", "size"),
        lost_tokens=("lost_tokens", "sum"),
        num_confident=("confident", "sum"),
    )
    first = rejections.drop_duplicates(["target_token", "draft_token"])
    grouped["example_row"] = pd.Series(
        first.index.to_numpy(), index=pd.MultiIndex.from_frame(first[["target_token", "draft_token"]])
    )
    grouped["share_of_lost"] = grouped["lost_tokens"] / total_lost
    grouped = grouped.reset_index().sort_values(["lost_tokens", "count"], ascending=False, kind="stable")
    return grouped.reset_index(drop=True)


def binned_acceptance(decided: pd.DataFrame, column: str, edges: tuple[int, ...] | None) -> pd.DataFrame:
    """Acceptance (accepted / decided) and lost tokens along one column, e.g. context length or turn.

    Args:
        decided: decided tokens (:attr:`DeviationTables.decided`, possibly narrowed).
        column: the column binned, e.g. ``context_tokens``, ``position`` or ``turn``.
        edges: the bins' lower edges in tokens, ascending (the last bin is open); None groups by value.

    Returns:
        One row per non-empty bin, in bin order: ``bin`` (its label, or the value), ``num_decided``,
        ``num_accepted``, ``lost_tokens`` and ``acceptance_rate``.
    """
    keys = _bin(decided[column], edges) if edges is not None else decided[column]
    grouped = decided.groupby(keys, observed=True).agg(
        num_decided=("accepted", "size"), num_accepted=("accepted", "sum"), lost_tokens=("lost_tokens", "sum")
    )
    grouped["acceptance_rate"] = grouped["num_accepted"] / grouped["num_decided"]
    grouped.index.name = "bin"
    return grouped.reset_index()


def miss_split(decided: pd.DataFrame, drafts: pd.DataFrame) -> MissSplit:
    """Confident vs uncertain first rejections, their share of lost tokens, tau and the attainable bound: how
    much training that fixes confident misses could gain.

    Args:
        decided: decided tokens of the slice.
        drafts: draft steps of the slice (:attr:`DeviationTables.drafts`), with their credited tokens.

    Returns:
        The split; tau and the attainable tau are None without drafts, a share None when nothing was lost.
    """
    rejections = decided[decided["first_rejection"].to_numpy()]
    total_lost = int(rejections["lost_tokens"].sum())
    confident = rejections["confident"].to_numpy()
    num_drafts = len(drafts)
    accepted = int(drafts["num_accepted"].sum())
    credited = int(drafts["credited_tokens"].sum())

    def part(mask: np.ndarray) -> MissShare:
        lost = int(rejections["lost_tokens"].to_numpy()[mask].sum())
        return MissShare(num_first_rejections=int(mask.sum()), lost_tokens=lost, share_of_lost=_share(lost, total_lost))

    return MissSplit(
        num_drafts=num_drafts,
        num_accepted_tokens=accepted,
        num_first_rejections=int(len(rejections)),
        lost_tokens=total_lost,
        tau=1.0 + accepted / num_drafts if num_drafts else None,
        attainable_tau=1.0 + (accepted + credited) / num_drafts if num_drafts else None,
        confident=part(confident),
        uncertain=part(~confident),
    )


def slice_summary(
    tables: DeviationTables, decided: pd.DataFrame, drafts: pd.DataFrame, top_n: int = DEFAULT_TOP_N
) -> SliceAnalysis:
    """Every statistic of one slice of ``tables`` (a class, or the whole run).

    Args:
        tables: the run's deviation tables (for token texts and example contexts).
        decided: the slice's decided tokens.
        drafts: the slice's draft steps.
        top_n: the most first-rejection pairs listed.

    Returns:
        The slice's pairs (each with its first example), categories, acceptance by context length, output
        position and turn, and the miss split.
    """
    pairs = pair_table(decided).head(top_n)
    top_pairs = []
    for row in pairs.to_dict("records"):
        example = decided.loc[row["example_row"]]
        request_id, position = str(example["request_id"]), int(example["position"])
        top_pairs.append(
            RejectionPair(
                target_token=int(row["target_token"]),
                draft_token=int(row["draft_token"]),
                target_text=tables.text(row["target_token"]),
                draft_text=tables.text(row["draft_token"]),
                category=str(example["category"]),
                draft_category=str(example["draft_category"]),
                count=int(row["count"]),
                lost_tokens=int(row["lost_tokens"]),
                share_of_lost=float(row["share_of_lost"]),
                num_confident=int(row["num_confident"]),
                example=PatternExample(
                    request_id=request_id,
                    step=int(example["step"]),
                    position=position,
                    context=tables.context_before(request_id, position),
                ),
            )
        )

    def bin_rows(column: str, edges: tuple[int, ...] | None) -> list[BinRow]:
        return [BinRow(**row) for row in frame_records(binned_acceptance(decided, column, edges).astype({"bin": str}))]

    categories = [CategoryRow(**row) for row in frame_records(category_table(decided))]
    split = miss_split(decided, drafts)
    return SliceAnalysis(
        **{field.name: getattr(split, field.name) for field in dataclasses.fields(split)},
        num_decided_tokens=int(len(decided)),
        top_pairs=top_pairs,
        categories=categories,
        costliest_category=next((row for row in categories if row.lost_tokens), None),
        by_context_length=bin_rows("context_tokens", CONTEXT_LENGTH_EDGES),
        by_output_position=bin_rows("position", OUTPUT_POSITION_EDGES),
        by_turn=bin_rows("turn", None),
    )


def analyze(tables: DeviationTables, top_n: int = DEFAULT_TOP_N) -> DeviationAnalysis:
    """The deviation analysis of a run: per class and overall (the report's "Why rejected" section).

    Args:
        tables: the run's deviation tables.
        top_n: the most first-rejection pairs listed per slice.

    Returns:
        The definitions, the overall slice and one slice per class that drafted.
    """
    return DeviationAnalysis(
        definitions=definitions(tables),
        overall=slice_summary(tables, tables.decided, tables.drafts, top_n),
        by_class={cls: slice_summary(tables, *select(tables, [cls]), top_n) for cls in class_names(tables)},
    )


def definitions(tables: DeviationTables) -> Definitions:
    """How each figure is computed for this run's confidence rule and rows, so that every view states the
    same definitions.

    Args:
        tables: the run's deviation tables (their rule, whether a margin was recorded, whether the rows are
            teacher-forced).

    Returns:
        The definitions' texts and the thresholds in force (the margin's None when the run recorded none).
    """
    return Definitions(
        lost_tokens="drafted tokens a step threw away at its first rejection: num_drafted - num_accepted",
        acceptance_rate="accepted / decided, where decided = accepted or first rejection",
        confident_miss=(
            f"first rejection with target entropy <= {tables.rule.max_entropy} nats"
            + (
                f" and top-1 margin >= {tables.rule.min_margin}"
                if tables.margin_recorded
                else " (no margin recorded in this run)"
            )
        ),
        attainable_tau=(
            "upper bound: 1 + (accepted + credited) / num_drafts, tau "
            "being vLLM's mean acceptance length (bonus included); "
            + (
                "a step whose first rejection is a confident miss is "
                "credited the slots after it up to its first uncertain miss "
                "(teacher-forced rows: the draft's guesses on the committed context)"
                if tables.teacher_forced
                else "a step whose first rejection is a confident miss is "
                "credited its whole remaining block (live-loop rows after "
                "a rejection are not on the committed context)"
            )
        ),
        confident_max_entropy=tables.rule.max_entropy,
        confident_min_margin=tables.rule.min_margin if tables.margin_recorded else None,
        categories=dict(CATEGORIES),
    )


def analyze_run(run: Any, top_n: int = DEFAULT_TOP_N) -> DeviationAnalysis:
    """:func:`analyze` of a loaded run.

    Args:
        run: a loaded :class:`~dflash_doctor.rundir.load.Run` with all three tables loaded.
        top_n: the most first-rejection pairs listed per slice.

    Returns:
        The run's deviation analysis.
    """
    return analyze(run_tables(run), top_n)
