"""Why the draft is rejected, in aggregate: deviation patterns per request class.

The token viewer shows one request at a time; this module answers the question a user asks before
spending GPU days on retraining: *which* deviations cost the most accepted tokens across the workload,
and could better training fix them? Everything is computed from a run directory's tables (``tokens``,
``steps``, ``requests``) with vectorised pandas/numpy, so a 1M-token run takes seconds
(``benchmarks/deviations.py`` prints the time).

Definitions (the reports print them next to the numbers):

* A step's **first rejection** is its drafted token at slot ``num_accepted + 1``, in a step that
  verification ended by rejecting a token. Steps ended by an accepted stop token or by the end of the
  known output (``bonus_token == -1``) have none. Slots after the first rejection were never verified
  on the committed context, so they count nowhere here.
* Its **lost tokens** are the drafted tokens the step threw away, ``num_drafted - num_accepted`` (the
  rejected token and every slot after it). Patterns are ranked by lost tokens, not by counts: a miss at
  slot 1 of a 15-token block costs 15, a miss at slot 15 costs 1.
* A drafted token is **decided** when verification looked at it: it was accepted or it is its step's
  first rejection. The acceptance rate of a category or a bin is ``accepted / decided``: the chance the
  draft gets that token right *given it got that far*, which is what a slot-independent view needs.
* A first rejection is a **confident miss** when the target was sure of its own token: entropy at most
  ``max_entropy`` nats *and* top-1 margin ``p1 - p2`` at least ``min_margin`` (temperature-1
  distributions, as recorded). Training can fix those. Otherwise it is **uncertain**: the target itself
  was near a tie, and at T = 0 such a miss is irreducible (a draft cannot reliably learn a coin flip,
  and numerics can flip it between engines). Runs recorded before ``target_top1_margin`` existed are
  judged by entropy alone.
* **Attainable tau** (an upper bound): ``1 + (accepted + credited tokens) / num_drafts`` over this run's
  steps, where a step whose first rejection is a confident miss is credited what accepting its confident
  misses would add. In a teacher-forced run (``check``, ``sweep``) the slots after a first rejection still
  hold the draft's guess and the target's token on the committed context, so the credit walks on through
  matches and confident misses up to the first uncertain miss. Live-loop rows (``replay``) after a
  rejection were drafted on the rejected prefix, so there the whole remaining block is credited. Either
  way every confident miss is assumed fixed and nothing else changed, and the schedule is not
  re-simulated: it bounds what such training could buy and is not a prediction. tau is vLLM's (bonus
  token included).

Token categories come from the tokenizer's own token strings (:class:`TokenCategories`), recorded in
the ``target_category`` column when the run is written, because the views load no tokenizer.
"""

from __future__ import annotations

import keyword
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

# ----------------------------------------------------------------------------- token categories

CATEGORIES: dict[str, str] = {
    "special": "special and chat-template tokens (the tokenizer's special / added special tokens)",
    "whitespace": "spaces, newlines and indentation",
    "number": "digits and numbers",
    "punctuation": "punctuation and symbols",
    "code": "code identifiers and keywords",
    "word_start": "natural-language word starts",
    "word_continuation": "word continuations (sub-word pieces)",
    "other": "anything else (byte pieces, mixed scripts, emoji)",
}
UNCATEGORISED = "uncategorised"  # runs recorded before target_category existed

# Byte-level BPE (GPT-2, Llama-3, Qwen, SmolLM) writes a leading space as "Ġ", SentencePiece (Llama-2,
# Gemma, Mistral) as "▁": a piece starting with one begins a word whatever the language.
WORD_START_MARKERS = ("Ġ", "▁")
# Keywords and builtins of common programming languages that are not also everyday English words ("for",
# "if", "return", "class" are left out: in prose they are words). Identifiers are mostly recognised by
# their shape (snake_case, camelCase, dunder, letters mixed with digits), which needs no list.
CODE_WORDS = frozenset(
    {w for w in keyword.kwlist if w not in {"and", "as", "for", "if", "in", "is", "not", "or", "with", "while", "from",
                                            "try", "pass", "break", "continue", "class", "return", "import", "global",
                                            "else", "raise", "yield", "del"}}
    | {"self", "cls", "args", "kwargs", "len", "enumerate", "isinstance", "dict", "str", "int", "bool", "tuple",
       "const", "var", "let", "func", "fn", "void", "null", "nullptr", "undefined", "println", "printf", "std",
       "struct", "typedef", "namespace", "elif", "endif", "ifdef", "bool", "usize", "u8", "i32", "def"}
)
_CODE_SHAPE = re.compile(
    r"^(?=\w*_)(?=\w*[A-Za-z])\w+$"  # an underscore among word characters: snake_case, _private, __dunder__
    r"|^[a-z]{2,}[A-Z][a-z]\w*$"  # camelCase
    r"|^[A-Za-z]+\d+\w*$"  # letters then digits: x1, int32, utf8
)
_WORD_INNER = "'\u2019-"  # apostrophes and hyphens inside words ("'ve", "don't", "well-")


def categorize(piece: str, text: str, special: bool) -> str:
    """Category of one token from its tokenizer piece (``convert_ids_to_tokens``), its decoded text and
    whether the tokenizer marks it special. Pure, so it is tested on hand-written strings."""
    if special:
        return "special"
    stripped = text.strip()
    if not stripped:
        return "whitespace" if text else "other"
    if "\ufffd" in stripped:  # part of a multi-byte character: the piece is a raw byte, not a symbol
        return "other"
    kinds = {unicodedata.category(char)[0] for char in stripped}
    if any(char.isdigit() for char in stripped) and kinds <= {"N", "P"}:
        return "number"
    if kinds <= {"P", "S"}:
        return "punctuation"
    if stripped in CODE_WORDS or _CODE_SHAPE.match(stripped):
        return "code"
    if any(char.isalpha() for char in stripped) and all(
        char.isalpha() or char in _WORD_INNER or unicodedata.category(char) == "Mn" for char in stripped
    ):
        starts_word = piece.startswith(WORD_START_MARKERS) or text[:1].isspace()
        return "word_start" if starts_word else "word_continuation"
    return "other"


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids the tokenizer itself treats as special: its special tokens and added tokens flagged special
    (chat-template markers such as ``<|im_start|>`` are added special tokens in most chat models)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return frozenset(int(i) for i in ids)


class TokenCategories:
    """Category of every token id of one tokenizer, memoised (a run touches a few thousand ids)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._special = special_token_ids(tokenizer)
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        category = self._cache.get(token_id)
        if category is None:
            piece = self._tokenizer.convert_ids_to_tokens(int(token_id)) or ""
            text = self._tokenizer.decode([int(token_id)])
            category = categorize(piece, text, int(token_id) in self._special)
            self._cache[token_id] = category
        return category


# ----------------------------------------------------------------------------- the decided-token frame


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


# Bins for acceptance along the sequence: lower edges (tokens). The last bin is open.
CONTEXT_LENGTH_EDGES = (0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
OUTPUT_POSITION_EDGES = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
CONTEXT_TOKENS_SHOWN = 12  # output tokens of context printed before an example rejection
DEFAULT_TOP_N = 10

_DECIDED_COLUMNS = (
    "class", "request_id", "step", "position", "offset", "draft_token", "target_token",
    "accepted", "first_rejection", "lost_tokens", "confident", "category", "draft_category", "context_tokens", "turn",
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
    teacher_forced: bool  # rows after a first rejection are on the committed context (check / sweep), not live-loop rows

    def text(self, token_id: int) -> str:
        return self.vocabulary.get(int(token_id), f"<id {int(token_id)}>")

    def context_before(self, request_id: str, position: int) -> str:
        """The output text just before ``position`` (up to :data:`CONTEXT_TOKENS_SHOWN` tokens)."""
        output = self.output_ids.get(request_id)
        if output is None:
            return ""
        return "".join(self.text(t) for t in np.asarray(output)[max(0, position - CONTEXT_TOKENS_SHOWN) : position].tolist())


def _bin_labels(edges: tuple[int, ...]) -> list[str]:
    labels = [f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])]
    return labels + [f">={edges[-1]}"]


def _bin(values: pd.Series, edges: tuple[int, ...]) -> pd.Series:
    """Each value's bin label (an ordered categorical, on ``values``' index)."""
    codes = np.searchsorted(np.asarray(edges), values.to_numpy(), side="right") - 1
    labels = pd.Categorical.from_codes(np.clip(codes, 0, len(edges) - 1), categories=pd.Index(_bin_labels(edges)), ordered=True)
    return pd.Series(labels, index=values.index)


def _vocabulary(tokens: pd.DataFrame) -> dict[int, str]:
    """Token id -> text from the run's own draft/target columns (the views load no tokenizer)."""
    vocabulary: dict[int, str] = {}
    for ids, texts in (("draft_token", "draft_text"), ("target_token", "target_text")):
        first = ~tokens[ids].duplicated().to_numpy()
        vocabulary.update(zip(tokens[ids].to_numpy()[first].tolist(), tokens[texts].iloc[np.flatnonzero(first)].tolist()))
    return vocabulary


def deviation_tables(tokens: pd.DataFrame, steps: pd.DataFrame, requests: pd.DataFrame,
                     rule: ConfidenceRule = ConfidenceRule(), *, teacher_forced: bool = True) -> DeviationTables:
    """Join the three tables once into the frames every statistic reads (vectorised, no per-row Python).

    Request ids are factorised once across the three tables; a token finds its step through an int64
    key ``(request code << 32) + step``, and its request through the code.
    """
    codes, names = pd.factorize(pd.concat([steps["request_id"], tokens["request_id"], requests["request_id"]], ignore_index=True))
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
        (at >= 0) & ~accepted & (tokens["offset"].to_numpy() == num_accepted + 1) & ended_by_rejection & (num_accepted < num_drafted)
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
        tokens[column].iloc[rows].fillna(UNCATEGORISED).astype("category").to_numpy() if column in tokens.columns
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
        steps, at, tokens["offset"].to_numpy(dtype=np.int64), confident_first=first_rejection & target_sure,
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
        decided=decided, drafts=drafts, vocabulary=_vocabulary(tokens),
        output_ids=dict(zip(requests["request_id"], requests["output_token_ids"])) if "output_token_ids" in requests else {},
        rule=rule, margin_recorded=margin_recorded, teacher_forced=teacher_forced,
    )


def _credited_tokens(steps: pd.DataFrame, at: np.ndarray, offset: np.ndarray, confident_first: np.ndarray, uncertain_miss: np.ndarray, teacher_forced: bool) -> np.ndarray:
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


# ----------------------------------------------------------------------------- statistics of one slice


def _share(part: float, whole: float) -> float | None:
    return float(part) / float(whole) if whole else None


def category_table(decided: pd.DataFrame) -> pd.DataFrame:
    """Acceptance and lost tokens per target-token category, most lost first."""
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
    """First-rejection pairs (target token, draft token): count, lost tokens, share, most lost first.

    Each row also names its first occurrence (``example_row``, an index into ``decided``).
    """
    rejections = decided[decided["first_rejection"].to_numpy()]
    total_lost = rejections["lost_tokens"].sum()
    if rejections.empty:
        return pd.DataFrame(columns=["target_token", "draft_token", "count", "lost_tokens", "num_confident",
                                     "share_of_lost", "example_row"])
    grouped = rejections.groupby(["target_token", "draft_token"], sort=False).agg(
        count=("lost_tokens", "size"),
        lost_tokens=("lost_tokens", "sum"),
        num_confident=("confident", "sum"),
    )
    first = rejections.drop_duplicates(["target_token", "draft_token"])
    grouped["example_row"] = pd.Series(first.index.to_numpy(), index=pd.MultiIndex.from_frame(first[["target_token", "draft_token"]]))
    grouped["share_of_lost"] = grouped["lost_tokens"] / total_lost
    grouped = grouped.reset_index().sort_values(["lost_tokens", "count"], ascending=False, kind="stable")
    return grouped.reset_index(drop=True)


def binned_acceptance(decided: pd.DataFrame, column: str, edges: tuple[int, ...] | None) -> pd.DataFrame:
    """Acceptance (accepted / decided) and lost tokens per bin of ``column``; ``edges=None`` groups by value."""
    keys = _bin(decided[column], edges) if edges is not None else decided[column]
    grouped = decided.groupby(keys, observed=True).agg(
        num_decided=("accepted", "size"), num_accepted=("accepted", "sum"), lost_tokens=("lost_tokens", "sum")
    )
    grouped["acceptance_rate"] = grouped["num_accepted"] / grouped["num_decided"]
    grouped.index.name = "bin"
    return grouped.reset_index()


def miss_split(decided: pd.DataFrame, drafts: pd.DataFrame) -> dict[str, Any]:
    """Confident vs uncertain first rejections, their share of lost tokens, tau and the attainable bound."""
    rejections = decided[decided["first_rejection"].to_numpy()]
    total_lost = int(rejections["lost_tokens"].sum())
    confident = rejections["confident"].to_numpy()
    num_drafts = len(drafts)
    accepted = int(drafts["num_accepted"].sum())
    credited = int(drafts["credited_tokens"].sum())

    def part(mask: np.ndarray) -> dict[str, Any]:
        lost = int(rejections["lost_tokens"].to_numpy()[mask].sum())
        return {"num_first_rejections": int(mask.sum()), "lost_tokens": lost, "share_of_lost": _share(lost, total_lost)}

    return {
        "num_drafts": num_drafts,
        "num_accepted_tokens": accepted,
        "num_first_rejections": int(len(rejections)),
        "lost_tokens": total_lost,
        "tau": 1.0 + accepted / num_drafts if num_drafts else None,
        "attainable_tau": 1.0 + (accepted + credited) / num_drafts if num_drafts else None,
        "confident": part(confident),
        "uncertain": part(~confident),
    }


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [{str(k): (v.item() if hasattr(v, "item") else v) for k, v in row.items()} for row in frame.to_dict("records")]


def slice_summary(tables: DeviationTables, decided: pd.DataFrame, drafts: pd.DataFrame, top_n: int = DEFAULT_TOP_N) -> dict[str, Any]:
    """Every statistic of one slice of ``tables`` (a class, or the whole run), JSON-ready."""
    pairs = pair_table(decided).head(top_n)
    top_pairs = []
    for row in pairs.to_dict("records"):
        example = decided.loc[row["example_row"]]
        request_id, position = str(example["request_id"]), int(example["position"])
        top_pairs.append(
            {
                "target_token": int(row["target_token"]),
                "draft_token": int(row["draft_token"]),
                "target_text": tables.text(row["target_token"]),
                "draft_text": tables.text(row["draft_token"]),
                "category": str(example["category"]),
                "draft_category": str(example["draft_category"]),
                "count": int(row["count"]),
                "lost_tokens": int(row["lost_tokens"]),
                "share_of_lost": float(row["share_of_lost"]),
                "num_confident": int(row["num_confident"]),
                "example": {
                    "request_id": request_id,
                    "step": int(example["step"]),
                    "position": position,
                    "context": tables.context_before(request_id, position),
                },
            }
        )
    bins = {
        "by_context_length": binned_acceptance(decided, "context_tokens", CONTEXT_LENGTH_EDGES),
        "by_output_position": binned_acceptance(decided, "position", OUTPUT_POSITION_EDGES),
        "by_turn": binned_acceptance(decided, "turn", None),
    }
    categories = _records(category_table(decided))
    return {
        **miss_split(decided, drafts),
        "num_decided_tokens": int(len(decided)),
        "top_pairs": top_pairs,
        "categories": categories,
        "costliest_category": next((row for row in categories if row["lost_tokens"]), None),
        **{name: _records(frame.astype({"bin": str})) for name, frame in bins.items()},
    }


def class_names(tables: DeviationTables) -> list[str]:
    """The request classes that drafted, sorted."""
    return sorted(str(c) for c in tables.drafts["class"].unique())


def select(tables: DeviationTables, classes: Iterable[str] = (), categories: Iterable[str] = ()) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Decided tokens and drafts of the given classes (all when empty), decided tokens further narrowed
    to target categories (the dashboard's filters; tau and the bound stay per class)."""
    decided, drafts = tables.decided, tables.drafts
    classes, categories = list(classes), list(categories)
    if classes:
        decided = decided[decided["class"].isin(classes).to_numpy()]
        drafts = drafts[drafts["class"].isin(classes).to_numpy()]
    if categories:
        decided = decided[decided["category"].isin(categories).to_numpy()]
    return decided, drafts


def analyze(tables: DeviationTables, top_n: int = DEFAULT_TOP_N) -> dict[str, Any]:
    """The deviation analysis of a run: per class and overall (the report's "Why rejected" section)."""
    return {
        "definitions": definitions(tables),
        "overall": slice_summary(tables, tables.decided, tables.drafts, top_n),
        "by_class": {cls: slice_summary(tables, *select(tables, [cls]), top_n) for cls in class_names(tables)},
    }


def definitions(tables: DeviationTables) -> dict[str, Any]:
    """How each figure is computed, stored next to the figures (report.json readers need no docs)."""
    return {
        "lost_tokens": "drafted tokens a step threw away at its first rejection: num_drafted - num_accepted",
        "acceptance_rate": "accepted / decided, where decided = accepted or first rejection",
        "confident_miss": (
            f"first rejection with target entropy <= {tables.rule.max_entropy} nats"
            + (f" and top-1 margin >= {tables.rule.min_margin}" if tables.margin_recorded else " (no margin recorded in this run)")
        ),
        "attainable_tau": (
            "upper bound: 1 + (accepted + credited) / num_drafts, tau being vLLM's mean acceptance length (bonus included); "
            + ("a step whose first rejection is a confident miss is credited the slots after it up to its first uncertain miss "
               "(teacher-forced rows: the draft's guesses on the committed context)" if tables.teacher_forced else
               "a step whose first rejection is a confident miss is credited its whole remaining block (live-loop rows after "
               "a rejection are not on the committed context)")
        ),
        "confident_max_entropy": tables.rule.max_entropy,
        "confident_min_margin": tables.rule.min_margin if tables.margin_recorded else None,
        "categories": CATEGORIES,
    }


def run_tables(run: Any) -> DeviationTables:
    """:func:`deviation_tables` of a loaded :class:`~dflash_doctor.rundir.load.Run`, with the confidence
    thresholds it was configured with. ``check`` and ``sweep`` replay teacher-forced; ``replay`` runs
    the live loop."""
    thresholds = run.record.config.get("thresholds") or {}
    return deviation_tables(run.tokens, run.steps, run.requests, ConfidenceRule.from_thresholds(thresholds),
                            teacher_forced=run.record.meta.command != "replay")


def analyze_run(run: Any, top_n: int = DEFAULT_TOP_N) -> dict[str, Any]:
    """:func:`analyze` of a loaded run (all three tables loaded)."""
    return analyze(run_tables(run), top_n)


# ----------------------------------------------------------------------------- patterns that grew


GROWTH_MIN_LOST_PER_DRAFT = 0.05  # tokens per draft step: smaller changes are noise on demo-sized runs
GROWTH_MIN_COUNT = 2  # first rejections NEW must show of a pattern before it is listed
GROWTH_TOP_N = 3  # patterns listed per class and kind


# What ``compare`` groups first rejections by: the target token's category, and the drafted token's
# category (a draft ending the turn early shows as drafted "special"). Exact token pairs are left out:
# two runs that decode different text share few pairs, so every pair of NEW would look "grown".
PATTERN_KINDS = {"category": "category", "drafted category": "draft_category"}


def pattern_costs(tables: DeviationTables) -> pd.DataFrame:
    """Lost tokens per draft step of every pattern (:data:`PATTERN_KINDS`), per class and overall: the
    unit ``compare`` diffs. Per draft step so runs of different sizes compare."""
    decided, drafts = tables.decided, tables.drafts
    num_drafts = drafts.groupby("class", observed=True).size()
    num_drafts.index = num_drafts.index.astype(str)
    num_drafts["overall"] = len(drafts)
    rejections = decided[decided["first_rejection"].to_numpy()]
    frames = []
    for kind, column in PATTERN_KINDS.items():
        for scope in ("class", "overall"):
            by = (["class"] if scope == "class" else []) + [column]
            grouped = rejections.groupby(by, observed=True)["lost_tokens"].agg(lost_tokens="sum", count="size").reset_index()
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


def grown_patterns(base: DeviationTables, new: DeviationTables, *, min_growth: float = GROWTH_MIN_LOST_PER_DRAFT,
                   min_count: int = GROWTH_MIN_COUNT, top_n: int = GROWTH_TOP_N) -> list[dict[str, Any]]:
    """Patterns whose lost tokens per draft step grew by at least ``min_growth`` from BASE to NEW and that
    NEW saw at least ``min_count`` times (a single new pair is chance): at most ``top_n`` per class and
    kind, classes in name order then overall, largest growth first (e.g. special tokens after a template change)."""
    keys = ["class", "kind", "pattern"]
    base_costs = pattern_costs(base).set_index(keys)
    new_costs = pattern_costs(new).set_index(keys)
    merged = pd.concat(
        {"lost_per_draft_base": base_costs["lost_per_draft"], "lost_per_draft_new": new_costs["lost_per_draft"],
         "count_new": new_costs["count"]},
        axis=1,
    ).fillna(0.0).reset_index()
    merged["growth"] = merged["lost_per_draft_new"] - merged["lost_per_draft_base"]
    grown = merged[(merged["growth"] >= min_growth) & (merged["count_new"] >= min_count)]
    grown = grown.assign(is_overall=grown["class"] == "overall").sort_values(
        ["is_overall", "class", "kind", "growth"], ascending=[True, True, True, False], kind="stable"
    )
    grown = grown.groupby(["class", "kind"], sort=False).head(top_n).astype({"count_new": int})
    return _records(grown[keys + ["lost_per_draft_base", "lost_per_draft_new", "growth", "count_new"]])
