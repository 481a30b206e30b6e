"""What the engine's loops emit: one :class:`StepRecord` per speculative step and one :class:`TokenRecord`
per drafted token, typed, from the live loop (:mod:`dflash_doctor.engine.live`) and teacher-forced
replay (:mod:`dflash_doctor.engine.teacher`) alike.

They are the engine's part of a row of ``steps.parquet`` / ``tokens.parquet``: :mod:`dflash_doctor.rundir.tables`
declares ``StepRow`` / ``TokenRow`` as the request's identity (and the token texts and categories, which
need the tokenizer) plus these fields, by name, and ``replay`` joins them. The engine knows no request.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_TIME = float("nan")  # a step that was walked, not timed (teacher-forced replay, a serving engine's record)


@dataclass(frozen=True)
class StepRecord:
    """One speculative step: where it started (``position``: output tokens committed before it), the K asked
    and the tokens actually drafted (the schedule may draft fewer near the end), the accepted prefix, the
    bonus token (-1 when the step ended the request without one), and the live loop's times."""

    step: int
    position: int
    k: int
    num_drafted: int
    num_accepted: int
    bonus_token: int
    draft_time_s: float = NO_TIME
    verify_time_s: float = NO_TIME


@dataclass(frozen=True)
class TokenRecord:
    """One drafted token against the target's token at the same position, with the divergence columns of
    :mod:`dflash_doctor.engine.divergence` (models' own distributions at T = 1)."""

    step: int
    position: int
    offset: int  # 1-based slot in the drafted block
    draft_token: int
    target_token: int
    accepted: bool
    target_prob_of_draft: float
    draft_prob_of_target: float
    target_rank_in_draft: int
    kl_target_draft: float
    total_variation: float
    target_entropy: float
    target_top1_margin: float
    draft_topk_ids: list[int]
    target_topk_ids: list[int]
