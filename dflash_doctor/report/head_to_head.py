"""Views of a head-to-head (:mod:`dflash_doctor.stats.head_to_head`): the terminal table, Markdown and a
self-contained HTML page, all from its JSON form (``head_to_head.json`` in the run directory), so every
view shows the same numbers."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dflash_doctor.rundir.tables import HEAD_TO_HEAD_JSON
from dflash_doctor.rundir.writer import write_text_atomic

HEADERS = ("scope", "speculator", "best K", "tau [95% CI]", "speedup [95% CI]", "per-position acceptance (unconditional)")


def _num(value: Any, digits: int = 2) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def table_rows(data: dict[str, Any]) -> list[list[str]]:
    """One row per (scope, speculator), the verdict's winner first in each scope."""
    rows = []
    for scope, result in data["scopes"].items():
        verdict = result["verdict"]
        winner = verdict["winner"] if verdict["decisive"] else None
        for row in sorted(result["rows"], key=lambda r: r["speculator"] != winner):
            tau_lo, tau_hi = (row["tau_ci"] + [None, None])[:2]
            s_lo, s_hi = row["speedup_ci"]
            curve = " ".join(_num(rate) for rate in row["acceptance_rate_per_pos"][:8])
            rows.append([scope, row["speculator"] + (" *" if row["speculator"] == winner else ""), str(row["best_k"]),
                         f"{_num(row['tau'])} [{_num(tau_lo)}, {_num(tau_hi)}]", f"{_num(row['speedup'])}x [{_num(s_lo)}, {_num(s_hi)}]", curve])
    return rows


def verdicts(data: dict[str, Any]) -> list[str]:
    return [result["verdict"]["text"] for result in data["scopes"].values()]


def _ms(seconds: Any, bounds: Any) -> str:
    """'12.3 ms [12.0, 12.6]' (the interval when the costs were timed here)."""
    text = f"{_num(seconds * 1000.0, 3 if seconds < 0.01 else 1)} ms"
    if isinstance(bounds, list) and len(bounds) == 2 and None not in bounds:
        text += f" [{_num(bounds[0] * 1000.0, 3 if seconds < 0.01 else 1)}, {_num(bounds[1] * 1000.0, 3 if seconds < 0.01 else 1)}]"
    return text


def cost_lines(data: dict[str, Any]) -> list[str]:
    """The shared step costs every speedup was priced with, each with its 95% interval: the target's decode and
    verify times (shared by all speculators), then each speculator's draft time; then any timing that broke
    the cost model (the advice is not reliable then)."""
    costs = data["costs"]
    timed = "t_decode_s_ci" in costs
    where = f"{costs.get('source', 'measured')}, {costs.get('device', 'unknown device')}"
    lines = [f"step costs ({where}; {'95% intervals from the timing bootstrap' if timed else 'a profile: taken as exact'}):",
             "target: decode " + _ms(costs["t_decode_s"], costs.get("t_decode_s_ci"))
             + "".join(f"; verify K={k} " + _ms(v, costs.get("t_verify_s_ci", {}).get(k)) for k, v in costs["t_verify_s"].items())]
    for name, table in costs["t_draft_s"].items():
        bounds = costs.get("t_draft_s_ci", {}).get(name, {})
        lines.append(f"draft {name}: " + "; ".join(f"K={k} " + _ms(v, bounds.get(k)) for k, v in table.items()))
    lines += [f"timing not reliable: {violation}" for violation in costs.get("timing_violations", [])]
    return lines


def print_head_to_head(data: dict[str, Any], console: Console) -> None:
    """The same rows as the reports, laid out for a terminal of 80 columns (a CI log's width): the figures in
    one table, the per-position curves (first six slots) in a second, each scope named once. Nothing is
    shortened: two drafts of one target often share a long name prefix, and an ellipsis made them
    indistinguishable."""
    rows = table_rows(data)

    def scoped(title: str, headers: tuple[str, ...], cells: list[list[str]]) -> Table:
        table = Table(title=title, pad_edge=False)
        for header in headers:
            table.add_column(header, no_wrap=True)
        for index, row in enumerate(cells):
            first = index == 0 or row[0] != cells[index - 1][0]
            if first and index:
                table.add_section()
            table.add_row(*(escape(cell) for cell in [row[0] if first else "", *row[1:]]))
        return table

    console.print(scoped("Head-to-head: the same prompts and target (* = the verdict's pick)",
                         ("scope", "speculator", "K", "tau [95% CI]", "speedup [95% CI]"), [row[:5] for row in rows]))
    console.print(scoped("Per-position acceptance (unconditional), slots 1-6", ("scope", "speculator", "slots 1-6"),
                         [[row[0], row[1], " ".join(row[5].split()[:6])] for row in rows]))
    for line in cost_lines(data):
        console.print(f"  {escape(line)}")
    for text in verdicts(data):
        console.print(f"  {escape(text)}")


def markdown(data: dict[str, Any]) -> str:
    names = ", ".join(f"`{s['name']}` ({s['kind']}, {s['draft']})" for s in data["speculators"])
    lines = ["# Head-to-head", "", f"Speculators: {names}. Runs: one sub-folder each.", "",
             "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table_rows(data)]
    lines += ["", "## Verdict", ""] + [f"- {text}" for text in verdicts(data)]
    lines += ["", "## Step costs", ""] + [f"- {line}" for line in cost_lines(data)]
    lines += ["", "Speedup: tokens emitted x plain decode time / time of the steps, every step priced at the speculator's "
              "draft time plus the target's verify time for the tokens it really drafted (a step that drafted nothing is a "
              "plain decode step); the target's times are shared by all speculators. Intervals: paired bootstrap over "
              "conversations and step timings together.", ""]
    return "\n".join(lines)


def html_page(data: dict[str, Any]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in table_rows(data))
    items = "".join(f"<li>{html.escape(text)}</li>" for text in verdicts(data))
    costs = "".join(f"<li>{html.escape(line)}</li>" for line in cost_lines(data))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>Head-to-head</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}</style>"
            f"</head><body><h1>Head-to-head</h1><table><tr>{head}</tr>{body}</table><h2>Verdict</h2><ul>{items}</ul>"
            f"<h2>Step costs</h2><ul>{costs}</ul></body></html>")


def write_head_to_head(root: Path, data: dict[str, Any]) -> None:
    """``head_to_head.json``, ``head_to_head.md`` and ``head_to_head.html`` in the head-to-head's folder."""
    write_text_atomic(root / HEAD_TO_HEAD_JSON, json.dumps(data, indent=2, allow_nan=True))
    write_text_atomic(root / "head_to_head.md", markdown(data))
    write_text_atomic(root / "head_to_head.html", html_page(data))
