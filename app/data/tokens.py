"""The token view: one request's steps as chips (accepted, rejected, bonus, correction), paged, with the
candidates the draft and the target weighed at a slot; token text made visible and inert for HTML.

Its own module because it is the one page that reads token rows, and the one that builds HTML.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd


# Steps of one request rendered per page of the token view (each step is up to K+1 chips).
STEPS_PER_TOKEN_PAGE = 64


def token_vocabulary(tokens: pd.DataFrame) -> dict[int, str]:
    """Token id -> text, learned from the run's own drafted/target tokens (no tokenizer is loaded).

    Lets the token view print the bonus token and top-k candidate ids as text wherever the run saw
    them; ids it never saw are shown as ``#id``.
    """
    draft = tokens[["draft_token", "draft_text"]].set_axis(["id", "text"], axis=1)
    target = tokens[["target_token", "target_text"]].set_axis(["id", "text"], axis=1)
    pairs = pd.concat([draft, target], ignore_index=True).dropna().drop_duplicates("id")
    return dict(zip(pairs["id"].astype(int), pairs["text"].astype(str)))


def token_label(token_id: int | None, vocabulary: dict[int, str]) -> str:
    """Readable text of a token id: its text when known, ``#id`` otherwise."""
    if token_id is None or (isinstance(token_id, float) and np.isnan(token_id)):
        return ""
    return vocabulary.get(int(token_id), f"#{int(token_id)}")


@dataclass(frozen=True)
class TokenChip:
    """One token of the rendered request: what was shown, why (kind) and its evidence (tooltip)."""

    text: str
    kind: str  # accepted | rejected (draft token the target refused) | target (committed by the target)
    step: int
    offset: int  # 1-based draft slot; 0 for the target's bonus/correction token
    tooltip: str


def request_chips(steps: pd.DataFrame, tokens: pd.DataFrame, vocabulary: dict[int, str]) -> list[list[TokenChip]]:
    """The request as committed, one list of chips per step.

    Per step: the accepted draft tokens, then (if one was refused) the refused draft token, then the
    token the target committed instead (the bonus token: the target's choice after the accepted prefix).
    Slots after the first refusal were never used and are not shown.
    """
    by_step = {step: group.sort_values("offset") for step, group in tokens.groupby("step", sort=True)}
    blocks: list[list[TokenChip]] = []
    for step in steps.sort_values("step").to_dict("records"):
        chips: list[TokenChip] = []
        slots = by_step.get(step["step"])
        num_accepted = int(step["num_accepted"])
        if slots is not None:
            for slot in slots.to_dict("records"):
                if slot["offset"] > num_accepted + 1:
                    break
                evidence = (
                    f"step {step['step']} slot {slot['offset']} | draft "
                    f"{slot['draft_text']!r} target {slot['target_text']!r} | "
                    f"p_target(draft)={slot['target_prob_of_draft']:.3f} "
                    f"KL={slot['kl_target_draft']:.3f} TV={slot['total_variation']:.3f}"
                )
                kind = "accepted" if slot["accepted"] else "rejected"
                chips.append(TokenChip(str(slot["draft_text"]), kind, int(step["step"]), int(slot["offset"]), evidence))
        bonus_text = token_label(step["bonus_token"], vocabulary)
        chips.append(
            TokenChip(
                bonus_text,
                "target",
                int(step["step"]),
                0,
                f"step {step['step']}: token committed by the target after {num_accepted} accepted",
            )
        )
        blocks.append(chips)
    return blocks


CHIP_CSS = """
<style>
.dd-tokens{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:0.86rem;line-height:1.9;\
white-space:pre-wrap;word-break:break-word}
.dd-step{border-left:2px solid #c9ced6;padding-left:1px;margin-left:1px}
.dd-tok{border-radius:3px;padding:1px 1px}
.dd-accepted{background:#d3f0dc;color:#14532d}
.dd-rejected{background:#fcd9d7;color:#991b1b;text-decoration:line-through}
.dd-target{background:#dde7f7;color:#1e3a8a}
.dd-legend span{margin-right:0.8rem}
</style>
"""


def visible_token_text(text: str) -> str:
    """Make whitespace tokens visible (a newline as ↵, a bare space as ·) so no chip is empty."""
    if text == "":
        return "∅"
    shown = text.replace("\n", "↵").replace("\t", "⇥")
    return "·" if shown.strip() == "" and " " in shown and len(shown) == 1 else shown


def chips_html(blocks: Sequence[Sequence[TokenChip]]) -> str:
    """HTML of the coloured request. Every token text and tooltip is escaped: token text is untrusted."""
    parts = [
        CHIP_CSS,
        '<div class="dd-legend"><span class="dd-tok dd-accepted">accepted draft</span>'
        '<span class="dd-tok dd-rejected">rejected draft</span><span class="dd-tok dd-target">target token</span>'
        '<span>│ = step boundary</span></div><div class="dd-tokens">',
    ]
    for chips in blocks:
        parts.append('<span class="dd-step">')
        for chip in chips:
            parts.append(
                f'<span class="dd-tok dd-{chip.kind}" title="{html.escape(chip.tooltip, quote=True)}">'
                f"{html.escape(visible_token_text(chip.text))}</span>"
            )
        parts.append("</span>")
    parts.append("</div>")
    return "".join(parts)


def page_of_steps(steps: pd.DataFrame, page: int, steps_per_page: int = STEPS_PER_TOKEN_PAGE) -> pd.DataFrame:
    """The 1-based ``page`` of a request's steps, in step order."""
    ordered = steps.sort_values("step")
    start = (page - 1) * steps_per_page
    return ordered.iloc[start : start + steps_per_page]


def num_pages(num_rows: int, rows_per_page: int = STEPS_PER_TOKEN_PAGE) -> int:
    """Pages needed for ``num_rows`` (at least one, so an empty request still has a page)."""
    return max(1, -(-num_rows // rows_per_page))


def slot_status(tokens: pd.DataFrame, steps: pd.DataFrame) -> pd.Series:
    """accepted / rejected / unused per drafted token (unused: after the step's first refusal)."""
    accepted_per_step = steps.set_index("step")["num_accepted"]
    num_accepted = tokens["step"].map(accepted_per_step)
    status = np.where(
        tokens["accepted"], "accepted", np.where(tokens["offset"] == num_accepted + 1, "rejected", "unused")
    )
    return pd.Series(status, index=tokens.index, name="status")


def candidates_table(slot: pd.Series, vocabulary: dict[int, str]) -> pd.DataFrame:
    """Draft's top candidates beside the target's for one drafted token, by rank (ids as text)."""
    draft_ids = list(slot["draft_topk_ids"] if slot["draft_topk_ids"] is not None else [])
    target_ids = list(slot["target_topk_ids"] if slot["target_topk_ids"] is not None else [])
    depth = max(len(draft_ids), len(target_ids))
    rows = []
    for rank in range(depth):
        draft_id = int(draft_ids[rank]) if rank < len(draft_ids) else None
        target_id = int(target_ids[rank]) if rank < len(target_ids) else None
        rows.append(
            {
                "rank": rank + 1,
                "draft candidate": token_label(draft_id, vocabulary) if draft_id is not None else "",
                "draft id": draft_id,
                "target candidate": token_label(target_id, vocabulary) if target_id is not None else "",
                "target id": target_id,
                "same": draft_id is not None and draft_id == target_id,
            }
        )
    return pd.DataFrame(rows, columns=["rank", "draft candidate", "draft id", "target candidate", "target id", "same"])
