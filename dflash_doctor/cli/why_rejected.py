"""The terminal's "Why rejected" summary: the costliest first-rejection patterns of each class.

One line per pattern (top 3 per class), then one line per class saying how much of the loss sits at
confident misses (what training can fix) and the attainable tau upper bound. The numbers come from
:mod:`dflash_doctor.deviations`; report.html / report.md show the full tables.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dflash_doctor.report.templating import fmt, pct

PATTERNS_PER_CLASS = 3


def shown(text: str) -> str:
    """Token text with whitespace made visible and markup escaped (token text is untrusted)."""
    return escape(repr(text))


def print_why_rejected(analysis: dict[str, Any], console: Console, per_class: int = PATTERNS_PER_CLASS) -> None:
    by_class = analysis.get("by_class") or {}
    if not any(summary["top_pairs"] for summary in by_class.values()):
        return
    table = Table(title=f"Why rejected: top {per_class} first-rejection patterns per class, by drafted tokens they threw away")
    for column in ("class", "target token", "drafted instead", "category (target / drafted)", "times", "lost tokens", "confident"):
        table.add_column(column, justify="right" if column in ("times", "lost tokens", "confident") else "left")
    for cls, summary in sorted(by_class.items()):
        for index, pair in enumerate(summary["top_pairs"][:per_class]):
            table.add_row(
                cls if index == 0 else "", shown(pair["target_text"]), shown(pair["draft_text"]),
                f"{pair['category']} / {pair['draft_category']}",
                str(pair["count"]), f"{pair['lost_tokens']} ({pct(pair['share_of_lost'], 0)})",
                f"{pair['num_confident']}/{pair['count']}",
            )
    console.print(table)
    for cls, summary in sorted(by_class.items()):
        worst = summary["costliest_category"]
        worst_text = f"; costliest: {worst['category']} ({pct(worst['share_of_lost'], 0)} of lost, {pct(worst['acceptance_rate'], 0)} accepted)" if worst else ""
        console.print(
            f"  {escape(cls)}: tau {fmt(summary['tau'])}, attainable <= {fmt(summary['attainable_tau'])} "
            f"(confident misses {pct(summary['confident']['share_of_lost'], 0)} of lost){worst_text}"
        )
