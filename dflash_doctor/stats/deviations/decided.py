"""The decided-token frame: a run's ``tokens`` / ``steps`` / ``requests`` tables joined once into the frames
every deviation statistic reads (:class:`DeviationTables`), and the confidence rule that marks a miss as one
training could fix.

Its own module because it is the one expensive, vectorised step (a 1M-token run takes seconds,
``benchmarks/deviations.py``): :mod:`.why_rejected` and :mod:`.patterns` only group and count its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

from dflash_doctor.stats.deviations.categories import UNCATEGORISED


@dataclass(frozen=True)
class ConfidenceRule:
    """When is a first rejection a confident miss? Thresholds on the target's own distribution at T = 1.

    Defaults: at most 1 nat of entropy (the target spreads over about e^1 ~ 3 tokens or fewer) and a
    top-1 lead of at least 0.5 probability over the runner-up. Override in doctor.toml ``[thresholds]``
    with ``confident_max_entropy`` and ``confident_min_margin``.
    """

    max_entropy: float = 1.0
    min_margin: float = 0.5

    @classmethod
    def from_thresholds(cls, thresholds: Mapping[str, Any] | None) -> "ConfidenceRule":
        thresholds = thresholds or {}
        return cls(
            max_entropy=float(thresholds.get("confident_max_entropy", cls.max_entropy)),
            min_margin=float(thresholds.get("confident_min_margin", cls.min_margin)),
        )


CONTEXT_TOKENS_SHOWN = 12  # output tokens of context printed before an example rejection

_DECIDED_COLUMNS = (
    "class",
    "request_id",
    "step",
    "position",
    "offset",
    "draft_token",
    "target_token",
    "accepted",
    "first_rejection",
    "lost_tokens",
    "confident",
    "category",
    "draft_category",
    "context_tokens",
    "turn",
)


@dataclass(frozen=True)
class DeviationTables:
    """What every statistic is computed from: one row per decided token, and the draft steps.

    ``decided``: columns of :data:`_DECIDED_COLUMNS` (``class``, ``request_id`` and ``category`` are
    categoricals); ``lost_tokens`` and ``confident`` only mean something on first rejections (0 / False
    elsewhere). ``drafts``: one row per step that drafted, with ``class``, ``num_accepted`` and
    ``credited_tokens`` (what accepting its confident misses would add, see :func:`_credited_tokens`):
    tau and the attainable bound come from here. ``vocabulary``: token id -> text as the run recorded it.
    """

    decided: pd.DataFrame
    drafts: pd.DataFrame
    vocabulary: dict[int, str]
    output_ids: dict[str, Any]  # request id -> output token ids, for the example contexts
    rule: ConfidenceRule
    margin_recorded: bool
    teacher_forced: (
        bool  # rows after a first rejection are on the committed context (check / sweep), not live-loop rows
    )

    def text(self, token_id: int) -> str:
        return self.vocabulary.get(int(token_id), f"<id {int(token_id)}>")

    def context_before(self, request_id: str, position: int) -> str:
        """The output text just before ``position`` (up to :data:`CONTEXT_TOKENS_SHOWN` tokens)."""
        output = self.output_ids.get(request_id)
        if output is None:
            return ""
        return "".join(
            self.text(t) for t in np.asarray(output)[max(0, position - CONTEXT_TOKENS_SHOWN) : position].tolist()
        )


def _vocabulary(tokens: pd.DataFrame) -> dict[int, str]:
    """Token id -> text from the run's own draft/target columns (the views load no tokenizer)."""
    vocabulary: dict[int, str] = {}
    for ids, texts in (("draft_token", "draft_text"), ("target_token", "target_text")):
        first = ~tokens[ids].duplicated().to_numpy()
        vocabulary.update(
            zip(tokens[ids].to_numpy()[first].tolist(), tokens[texts].iloc[np.flatnonzero(first)].tolist())
        )
    return vocabulary


def deviation_tables(
    tokens: pd.DataFrame,
    steps: pd.DataFrame,
    requests: pd.DataFrame,
    rule: ConfidenceRule = ConfidenceRule(),
    *,
    teacher_forced: bool = True,
) -> DeviationTables:
    """Join the three tables once into the frames every statistic reads (vectorised, no per-row Python).

    Request ids are factorised once across the three tables; a token finds its step through an int64
    key ``(request code << 32) + step``, and its request through the code.

    Args:
        tokens: the run's ``tokens`` table (drafted tokens with their divergence columns and texts).
        steps: the run's ``steps`` table.
        requests: the run's ``requests`` table (prompt length, turn, output ids where recorded).
        rule: the thresholds that make a first rejection a confident miss.
        teacher_forced: whether the rows come from teacher-forced replay (``check``, ``sweep``), whose rows
            after a first rejection are on the committed context; False for the live loop (``replay``).

    Returns:
        The decided tokens (accepted ones and first rejections), the draft steps with their attainable
        credit, and the run's vocabulary and output ids (:class:`DeviationTables`).
    """
    codes, names = pd.factorize(
        pd.concat([steps["request_id"], tokens["request_id"], requests["request_id"]], ignore_index=True)
    )
    step_codes = codes[: len(steps)].astype(np.int64)
    token_codes = codes[len(steps) : len(steps) + len(tokens)].astype(np.int64)
    request_of_code = np.full(len(names), -1, dtype=np.int64)
    request_of_code[codes[len(steps) + len(tokens) :]] = np.arange(len(requests))

    step_keys = (step_codes << 32) + steps["step"].to_numpy(dtype=np.int64)
    token_keys = (token_codes << 32) + tokens["step"].to_numpy(dtype=np.int64)
    at = pd.Index(step_keys).get_indexer(token_keys)  # row of each token's step, -1 if missing
    num_accepted = steps["num_accepted"].to_numpy(dtype=np.int64)[at]
    num_drafted = steps["num_drafted"].to_numpy(dtype=np.int64)[at]
    ended_by_rejection = steps["bonus_token"].to_numpy()[at] != -1
    accepted = tokens["accepted"].to_numpy(dtype=bool) & (at >= 0)
    first_rejection = (
        (at >= 0)
        & ~accepted
        & (tokens["offset"].to_numpy() == num_accepted + 1)
        & ended_by_rejection
        & (num_accepted < num_drafted)
    )
    rows = np.flatnonzero(accepted | first_rejection)
    rejection = first_rejection[rows]

    target_sure = tokens["target_entropy"].to_numpy(dtype=np.float64) <= rule.max_entropy  # every drafted row
    margin_recorded = "target_top1_margin" in tokens.columns and bool(tokens["target_top1_margin"].notna().any())
    if margin_recorded:
        margin = tokens["target_top1_margin"].to_numpy(dtype=np.float64)
        target_sure &= np.isnan(margin) | (margin >= rule.min_margin)
    confident = rejection & target_sure[rows]

    request_rows = request_of_code[token_codes[rows]]
    has_request = request_rows >= 0
    prompt = np.where(has_request, requests["prompt_num_tokens"].to_numpy(dtype=np.int64)[request_rows], 0)
    turn = np.where(has_request, requests["turn"].to_numpy(dtype=np.int64)[request_rows], 0)
    class_codes, class_names = pd.factorize(steps["class"])
    category, draft_category = (
        tokens[column].iloc[rows].fillna(UNCATEGORISED).astype("category").to_numpy()
        if column in tokens.columns
        else pd.Categorical([UNCATEGORISED] * len(rows))
        for column in ("target_category", "draft_category")
    )
    position = tokens["position"].to_numpy(dtype=np.int64)[rows]
    decided = pd.DataFrame(
        {
            "class": pd.Categorical.from_codes(class_codes[at[rows]], categories=class_names),
            "request_id": pd.Categorical.from_codes(token_codes[rows], categories=names),
            "step": tokens["step"].to_numpy()[rows],
            "position": position,
            "offset": tokens["offset"].to_numpy()[rows],
            "draft_token": tokens["draft_token"].to_numpy(dtype=np.int64)[rows],
            "target_token": tokens["target_token"].to_numpy(dtype=np.int64)[rows],
            "accepted": accepted[rows],
            "first_rejection": rejection,
            "lost_tokens": np.where(rejection, (num_drafted - num_accepted)[rows], 0),
            "confident": confident,
            "category": category,
            "draft_category": draft_category,
            "context_tokens": prompt + position,
            "turn": turn,
        },
        columns=list(_DECIDED_COLUMNS),
    )

    credited = _credited_tokens(
        steps,
        at,
        tokens["offset"].to_numpy(dtype=np.int64),
        confident_first=first_rejection & target_sure,
        uncertain_miss=(tokens["draft_token"].to_numpy() != tokens["target_token"].to_numpy()) & ~target_sure,
        teacher_forced=teacher_forced,
    )
    drafted = steps["num_drafted"].to_numpy() > 0
    drafts = pd.DataFrame(
        {
            "class": pd.Categorical.from_codes(class_codes[drafted], categories=class_names),
            "num_accepted": steps["num_accepted"].to_numpy(dtype=np.int64)[drafted],
            "credited_tokens": credited[drafted],
        }
    )
    return DeviationTables(
        decided=decided,
        drafts=drafts,
        vocabulary=_vocabulary(tokens),
        output_ids=dict(zip(requests["request_id"], requests["output_token_ids"]))
        if "output_token_ids" in requests
        else {},
        rule=rule,
        margin_recorded=margin_recorded,
        teacher_forced=teacher_forced,
    )


def _credited_tokens(
    steps: pd.DataFrame,
    at: np.ndarray,
    offset: np.ndarray,
    confident_first: np.ndarray,
    uncertain_miss: np.ndarray,
    teacher_forced: bool,
) -> np.ndarray:
    """Tokens each step would add if its confident misses were accepted (the attainable-tau credit), per step.

    Teacher-forced rows after the first rejection still hold the draft's guess and the target's token on
    the committed context, so the step walks on from a confident first rejection until its first
    *uncertain* miss (slots that match or are confident misses count). Live-loop rows after it were
    drafted and verified on the rejected prefix and say nothing, so the step gets its whole remaining
    block. Both assume every confident miss fixed and nothing else changed: an upper bound.
    """
    num_accepted = steps["num_accepted"].to_numpy(dtype=np.int64)
    credited = np.zeros(len(steps), dtype=np.int64)
    starts = at[confident_first]  # steps whose first rejection is a confident miss
    if not teacher_forced:
        credited[starts] = (steps["num_drafted"].to_numpy(dtype=np.int64) - num_accepted)[starts]
        return credited
    known = at >= 0
    stop = np.zeros(len(steps), dtype=np.int64)  # first slot the walk cannot pass: an uncertain miss, or past the rows
    np.maximum.at(stop, at[known], offset[known] + 1)
    blocked = known & uncertain_miss & (offset > num_accepted[np.where(known, at, 0)] + 1)
    np.minimum.at(stop, at[blocked], offset[blocked])
    credited[starts] = stop[starts] - (num_accepted[starts] + 1)
    return credited


def frame_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """A frame's rows as dicts of plain Python values (numpy scalars unwrapped), ready for JSON.

    Args:
        frame: any data frame.

    Returns:
        One dict per row, column name -> value.
    """
    return [
        {str(k): (v.item() if hasattr(v, "item") else v) for k, v in row.items()} for row in frame.to_dict("records")
    ]


def class_names(tables: DeviationTables) -> list[str]:
    """The request classes that drafted, sorted (the ones a view offers).

    Args:
        tables: one run's deviation tables.

    Returns:
        The classes of the draft steps, as strings in name order.
    """
    return sorted(str(c) for c in tables.drafts["class"].unique())


def select(
    tables: DeviationTables, classes: Iterable[str] = (), categories: Iterable[str] = ()
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Decided tokens and drafts narrowed to the dashboard's filters; tau and the bound stay per class, so
    drafts are narrowed by class only.

    Args:
        tables: one run's deviation tables.
        classes: request classes to keep; empty keeps all.
        categories: target-token categories the decided tokens are narrowed to; empty keeps all.

    Returns:
        (decided tokens, drafts) after the filters.
    """
    decided, drafts = tables.decided, tables.drafts
    classes, categories = list(classes), list(categories)
    if classes:
        decided = decided[decided["class"].isin(classes).to_numpy()]
        drafts = drafts[drafts["class"].isin(classes).to_numpy()]
    if categories:
        decided = decided[decided["category"].isin(categories).to_numpy()]
    return decided, drafts


def run_tables(run: Any) -> DeviationTables:
    """:func:`deviation_tables` of a loaded run, with the confidence thresholds it was configured with.

    Args:
        run: a loaded :class:`~dflash_doctor.rundir.load.Run`; its command says how its rows were made
            (``check`` and ``sweep`` replay teacher-forced; ``replay`` runs the live loop).

    Returns:
        The run's deviation tables.
    """
    thresholds = run.record.config.get("thresholds") or {}
    return deviation_tables(
        run.tokens,
        run.steps,
        run.requests,
        ConfidenceRule.from_thresholds(thresholds),
        teacher_forced=run.record.meta.command != "replay",
    )
