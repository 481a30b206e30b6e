"""Read the few DFlash facts several checks need from a draft's ``config.json`` (docs/draft-formats.md).

Checkpoints disagree on where things live: older ones keep ``block_size`` at the top level and the mask
in ``dflash_config``; DFlash2 may move ``block_size`` into ``dflash_config``. These helpers look in both
places so each check states its rule once.
"""

from __future__ import annotations

from typing import Any

from dflash_doctor.checks.base import CheckContext
from dflash_doctor.models.loading import is_dflash_config


def _dflash_section(draft_config: dict[str, Any] | None) -> dict[str, Any]:
    return dict((draft_config or {}).get("dflash_config") or {})


def is_dflash(ctx: CheckContext) -> bool:
    """True when the context names a DFlash draft, explicitly or by its config's shape."""
    if ctx.draft_kind in ("dflash", "autoregressive"):
        return ctx.draft_kind == "dflash"
    return is_dflash_config(ctx.draft_config or {})


def mask_token_id(draft_config: dict[str, Any] | None) -> int | None:
    """The embedding row DFlash fills the block's masked slots with, or None when not recorded."""
    value = _dflash_section(draft_config).get("mask_token_id", (draft_config or {}).get("mask_token_id"))
    return None if value is None else int(value)


def block_size(draft_config: dict[str, Any] | None) -> int | None:
    """Tokens per drafted block B (the last committed token plus B - 1 masked slots)."""
    value = (draft_config or {}).get("block_size", _dflash_section(draft_config).get("block_size"))
    return None if value is None else int(value)


def target_layer_ids(draft_config: dict[str, Any] | None) -> list[int] | None:
    """Target layers whose hidden states feed the draft (HF convention: layer l = hidden_states[l + 1])."""
    value = _dflash_section(draft_config).get("target_layer_ids", (draft_config or {}).get("target_layer_ids"))
    return None if value is None else [int(x) for x in value]


def output_token_ids(ctx: CheckContext) -> set[int] | None:
    """The distinct ids the target produced in the run (``ctx.output_token_ids``), None when not given."""
    return None if ctx.output_token_ids is None else {int(token) for token in ctx.output_token_ids}
