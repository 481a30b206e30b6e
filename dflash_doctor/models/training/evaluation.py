"""Held-out acceptance at temperature 0: the trained draft's steps on held-out sequences through the same
teacher-forced replay as ``check`` (engine/teacher.py), and tau per class with its interval.

Its own module because it judges a draft rather than training one: ``train-draft`` runs it after the loop,
and scripts compare drafts with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from dflash_doctor.engine.dflash_model import DFlashDraftModel
from dflash_doctor.engine.eagle3_model import Eagle3DraftModel
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.proposers.eagle3 import Eagle3Proposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, walk_schedule
from dflash_doctor.rundir.tables import StepRow, as_row
from dflash_doctor.stats.metrics import tau_with_ci
from dflash_doctor.models.training.sequences import SequenceRecord

if TYPE_CHECKING:
    from dflash_doctor.engine.target import CausalLM


@torch.inference_mode()
def held_out_steps(
    target_model: CausalLM,
    draft: DFlashDraftModel | Eagle3DraftModel,
    records: Sequence[SequenceRecord],
    *,
    stop_ids: frozenset[int],
    k: int | None = None,
) -> list[dict[str, Any]]:
    """Per-step rows (``request_id``, ``class``, ``k``, ``num_drafted``, ``num_accepted``...) of the live loop at T = 0.

    ``k``: the step's K, by default a DFlash draft's block size - 1; an EAGLE-3 head, which has no block, needs it.

    When a record's response is the target's own greedy continuation, the live loop at temperature 0
    commits exactly those tokens, so teacher-forced replay (:mod:`dflash_doctor.engine.teacher`, through
    the proposer interface like every other replay) gives its steps without running it. A response cut
    by the generation limit ends with a token that can only be a bonus; one ended by a stop token can be
    drafted up to the stop. The rows feed :func:`dflash_doctor.stats.metrics.tau_with_ci`; all turns of a
    request share its id (the bootstrap unit).
    """
    target = TargetModel(target_model)
    proposer = Eagle3Proposer(draft, target) if isinstance(draft, Eagle3DraftModel) else DFlashProposer(draft, target)
    k = k or proposer.max_k
    if k is None:
        raise ValueError("held_out_steps needs k for a draft without a block size (an EAGLE-3 head)")
    k = min(k, proposer.max_k or k)
    rows = []
    for record in records:
        prompt, output = list(record.token_ids[: record.prompt_length]), list(record.token_ids[record.prompt_length :])
        if not output:
            continue
        table, _ = slot_table(target, proposer, TeacherSequence(prompt, output), k, record_divergence=False)
        limit = len(output) + (1 if output[-1] in stop_ids else 0)
        rows += [
            as_row(StepRow(request_id=record.request_id, request_class=record.request_class, **vars(step)))
            for step in walk_schedule(table.matches, output, k, limit, stop_ids)
        ]
    return rows


def tau_by_class(steps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pooled tau of :func:`held_out_steps` rows with its bootstrap interval over requests, overall and per class."""
    import pandas as pd

    frame = pd.DataFrame(steps)
    out = {}
    for name, group in [("overall", frame), *sorted(frame.groupby("class"))]:
        tau, interval = tau_with_ci(group, group=str(name))
        out[str(name)] = {"tau": tau, "tau_ci": interval, "num_requests": int(group["request_id"].nunique())}
    return out
