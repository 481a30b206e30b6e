"""The Parquet row declarations against the engine's records: a steps/tokens row is the engine's record
plus what only the replay knows (the request, and the token texts and categories from the tokenizer)."""

from __future__ import annotations

from dataclasses import fields

from dflash_doctor.engine.step_records import StepRecord, TokenRecord
from dflash_doctor.rundir.tables import STEPS_SCHEMA, StepRow, TokenRow, as_row


def _names(row_type) -> list[str]:
    return [f.name for f in fields(row_type)]


def test_a_step_row_is_the_request_then_the_engines_step_record():
    assert _names(StepRow) == ["request_id", "request_class", *_names(StepRecord)]


def test_a_token_row_is_the_engines_token_record_plus_request_texts_and_categories():
    replay_only = {"request_id", "request_class", "draft_text", "target_text", "draft_category", "target_category"}
    assert set(_names(TokenRow)) == replay_only | set(_names(TokenRecord))
    assert not replay_only & set(_names(TokenRecord))


def test_a_walked_step_is_written_with_untimed_columns():
    row = as_row(StepRow(request_id="r", request_class="math", **vars(StepRecord(0, 1, 4, 4, 2, 7))))
    assert list(row) == list(STEPS_SCHEMA.names)
    assert row["class"] == "math" and row["draft_time_s"] != row["draft_time_s"]  # NaN: walked, not timed
