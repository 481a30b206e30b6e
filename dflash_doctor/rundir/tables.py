"""The run directory's layout: run.json and three Parquet tables (``requests``, ``steps``, ``tokens``)
whose columns are fixed here, one row dataclass per table.

Column conventions (shapes and units live in the names):

* ``position`` in ``steps`` is the number of output tokens committed before the step; in ``tokens``
  it is the output index of the token the draft slot predicts (``step position + offset - 1``).
* ``offset`` is the 1-based slot inside the drafted block (vLLM's "position" of
  ``num_accepted_tokens_per_pos`` is ``offset - 1``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_doctor.errors import UsageError

RUN_JSON = "run.json"
TUNE_JSON = "tune.json"  # a `tune` run directory's one result file (its server runs are ordinary runs below it)
HEAD_TO_HEAD_JSON = "head_to_head.json"  # `check --draft A --draft B`: the comparison above one run per speculator


def read_table_or_empty(path: Path, schema: pa.Schema) -> pd.DataFrame:
    """A Parquet table as a frame; a missing file reads as the empty table of ``schema`` (every column,
    no rows), so views need no special case for a table a run never wrote."""
    if not path.is_file():
        return schema.empty_table().to_pandas()
    return conform(read_parquet_table(path), schema, path).to_pandas()


def conform(table: pa.Table, schema: pa.Schema, path: Path) -> pa.Table:
    """``table`` checked against its declared ``schema``: every column there, each of the same kind (integers,
    floats, text, lists, booleans) and its values fitting the declared width, as the schema's table.

    A valid Parquet file with other columns (or a text column where a count belongs) is refused in one sentence
    naming the file and the column, instead of a KeyError in whichever view reads the column first. A narrower
    or wider type of the same kind is read (pandas or an older writer may store int64 where int16 is declared),
    but a value that does not fit is refused, never wrapped; columns beyond the schema are not read.
    """
    missing = [name for name in schema.names if name not in table.column_names]
    if missing:
        raise UsageError(
            f"{path} lacks the column(s) {', '.join(missing)} of its table; re-run the command that wrote it."
        )
    for declared in schema:
        actual = table.schema.field(declared.name).type
        if _kind(actual) != _kind(declared.type):
            raise UsageError(
                f"{path} column {declared.name!r} holds {actual} "
                f"where the run table declares {declared.type}; "
                "re-run the command that wrote it."
            )
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        detail = " ".join(str(exc).split())[:160]
        raise UsageError(
            f"{path} has a value its table's column types cannot hold ({detail}); re-run the command that wrote it."
        ) from None


def _kind(arrow_type: pa.DataType) -> str:
    """The family of an Arrow type, for :func:`conform`: types within one family cast without changing meaning."""
    for name, test in (
        ("integer", pa.types.is_integer),
        ("float", pa.types.is_floating),
        ("boolean", pa.types.is_boolean),
        ("text", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
        ("list", lambda t: pa.types.is_list(t) or pa.types.is_large_list(t)),
    ):
        if test(arrow_type):
            return name if name != "list" else f"list of {_kind(arrow_type.value_type)}"
    return str(arrow_type)


def read_parquet_table(path: Path) -> pa.Table:
    """A Parquet file of a run directory, refused in one sentence when it is truncated or not Parquet."""
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        detail = " ".join(str(exc).split())[:160]
        raise UsageError(
            f"{path} is not a readable Parquet table ({detail}); re-run the command that wrote it or delete the file."
        ) from None


def turn_row_id(request_id: str, turn: int) -> str:
    """A turn's ``request_id`` in the steps / tokens / requests tables: the request's id for its first turn
    (turn 0), ``<id>#t<turn>`` for a later one; the embedded replay and a serving engine name turns alike."""
    return request_id if turn == 0 else f"{request_id}#t{turn}"


def _column(arrow_type: pa.DataType, name: str | None = None) -> Any:
    """A row field with its Arrow type (and its column name when the field name cannot be it, e.g. ``class``)."""
    return field(metadata={"arrow": arrow_type, "column": name})


def arrow_schema(row_type: type) -> pa.Schema:
    """The Arrow schema of a row dataclass: one column per field, in field order."""
    return pa.schema([(f.metadata["column"] or f.name, f.metadata["arrow"]) for f in dataclasses.fields(row_type)])


def as_row(row: Any) -> dict[str, Any]:
    """A row dataclass as the dict the writer takes (column names as keys)."""
    return {f.metadata["column"] or f.name: getattr(row, f.name) for f in dataclasses.fields(row)}


@dataclass
class RequestRow:
    """One replayed turn of one request (``requests.parquet``)."""

    request_id: str = _column(pa.string())
    request_class: str = _column(pa.string(), "class")
    subclass: str = _column(pa.string())
    turn: int = _column(pa.int16())
    prompt_num_tokens: int = _column(pa.int32())
    output_token_ids: list[int] = _column(pa.list_(pa.int32()))
    output_text: str = _column(pa.string())
    num_output_tokens: int = _column(pa.int32())
    num_steps: int = _column(pa.int32())
    num_drafts: int = _column(pa.int32())
    num_draft_tokens: int = _column(pa.int32())
    num_accepted_tokens: int = _column(pa.int32())
    tau: float | None = _column(pa.float64())
    stop_reason: str = _column(pa.string())
    wall_time_s: float = _column(pa.float64())


@dataclass
class StepRow:
    """One speculative step (``steps.parquet``): the engine's step record plus its request and class."""

    request_id: str = _column(pa.string())
    request_class: str = _column(pa.string(), "class")
    step: int = _column(pa.int32())
    position: int = _column(pa.int32())
    k: int = _column(pa.int16())
    num_drafted: int = _column(pa.int16())
    num_accepted: int = _column(pa.int16())
    bonus_token: int = _column(pa.int32())
    draft_time_s: float = _column(pa.float64())
    verify_time_s: float = _column(pa.float64())


@dataclass
class TokenRow:
    """One drafted token against the target's (``tokens.parquet``): the engine's divergence record."""

    request_id: str = _column(pa.string())
    request_class: str = _column(pa.string(), "class")
    step: int = _column(pa.int32())
    position: int = _column(pa.int32())
    offset: int = _column(pa.int16())
    draft_token: int = _column(pa.int32())
    target_token: int = _column(pa.int32())
    draft_text: str = _column(pa.string())
    target_text: str = _column(pa.string())
    accepted: bool = _column(pa.bool_())
    target_prob_of_draft: float = _column(pa.float32())
    draft_prob_of_target: float = _column(pa.float32())
    target_rank_in_draft: int = _column(pa.int32())
    kl_target_draft: float = _column(pa.float32())
    total_variation: float = _column(pa.float32())
    target_entropy: float = _column(pa.float32())
    target_top1_margin: float = _column(
        pa.float32()
    )  # p1 - p2 of the target at T = 1: a miss near a tie is irreducible
    draft_topk_ids: list[int] = _column(
        pa.list_(pa.int32())
    )  # top 5 by score, ties lowest id first: the first is the argmax
    target_topk_ids: list[int] = _column(pa.list_(pa.int32()))
    target_category: str = _column(
        pa.string()
    )  # dflash_doctor.stats.deviations.CATEGORIES, from the target tokenizer's pieces
    draft_category: str = _column(pa.string())  # the same for the drafted token


@dataclass
class CostRow:
    """One timed step (``costs.parquet``): every raw sample behind ``summary.sweep.costs``, so a report can
    re-derive the fitted costs and their intervals (:mod:`dflash_doctor.stats.step_costs`)."""

    kind: str = _column(pa.string())  # decode | verify | draft
    k: int = _column(pa.int16())  # drafted tokens (0 for a decode step)
    repeat: int = _column(pa.int32())  # the sample's index in the order taken
    seconds: float = _column(pa.float64())
    device: str = _column(pa.string())


COSTS_FILE = "costs.parquet"  # written once, after the timing; not journaled (it is not per request)
COSTS_SCHEMA = arrow_schema(CostRow)
REQUESTS_SCHEMA = arrow_schema(RequestRow)
STEPS_SCHEMA = arrow_schema(StepRow)
TOKENS_SCHEMA = arrow_schema(TokenRow)

TABLES: dict[str, pa.Schema] = {
    "requests": REQUESTS_SCHEMA,
    "steps": STEPS_SCHEMA,
    "tokens": TOKENS_SCHEMA,
}
