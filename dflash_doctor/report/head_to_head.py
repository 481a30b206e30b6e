"""Views of a head-to-head (:mod:`dflash_doctor.stats.head_to_head`): the terminal table, Markdown and a
self-contained HTML page, all from the typed :class:`~dflash_doctor.stats.head_to_head.HeadToHead` that
``head_to_head.json`` holds (the dashboard reads it back with ``read_head_to_head``), so every view shows the
same numbers.

The Markdown and HTML pages are the page an engineer forwards: the verdict per class with the setting to
type in each engine, the step costs with their spread, tau and the per-position curves side by side, and
each sub-run's checks with a link to its report, its command, date, machine and tool version. Those facts
are read from each sub-run's run.json when the head-to-head is written (:func:`describe_sub_runs`) and kept
in head_to_head.json, so the dashboard shows the same without reading the sub-runs again. Paths in the
pages are relative to the head-to-head folder: a page moved or mailed with its folder still links, and it
never carries the layout of the machine it ran on.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.models.kind_serving import KindServing, kind_serving
from dflash_doctor.report.sanitize import for_terminal
from dflash_doctor.report.templating import markdown_cell
from dflash_doctor.rundir.load import read_run_meta
from dflash_doctor.rundir.run_record import RunRecord
from dflash_doctor.rundir.status import Status, overall_status
from dflash_doctor.rundir.tables import HEAD_TO_HEAD_JSON, RUN_JSON
from dflash_doctor.rundir.writer import write_text_atomic
from dflash_doctor.stats.head_to_head import (
    ContenderRow,
    DeploySettings,
    HeadToHead,
    Speculator,
    SubRun,
    SubRunCheck,
    Verdict,
)

HEADERS = (
    "scope",
    "speculator",
    "best K",
    "tau [95% CI]",
    "speedup [95% CI]",
    "per-position acceptance (unconditional)",
)
FLAGGED = (Status.FAIL, Status.ERROR, Status.WARN)  # the statuses a sub-run's line names, worst first
ENGINES = ("vLLM", "SGLang", "llama.cpp")


def _num(value: Any, digits: int = 2) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def table_rows(head_to_head: HeadToHead) -> list[list[str]]:
    """One row per (scope, speculator), the verdict's winner first in each scope."""
    rows = []
    for scope, result in head_to_head.scopes.items():
        winner = result.verdict.winner if result.verdict.decisive else None
        for row in sorted(result.rows, key=lambda r: r.speculator != winner):
            tau_lo, tau_hi = [*row.tau_ci, None, None][:2]
            s_lo, s_hi = row.speedup_ci
            curve = " ".join(_num(rate) for rate in row.acceptance_rate_per_pos[:8])
            rows.append(
                [
                    scope,
                    row.speculator + (" *" if row.speculator == winner else ""),
                    str(row.best_k),
                    f"{_num(row.tau)} [{_num(tau_lo)}, {_num(tau_hi)}]",
                    f"{_num(row.speedup)}x [{_num(s_lo)}, {_num(s_hi)}]",
                    curve,
                ]
            )
    return rows


def verdicts(head_to_head: HeadToHead) -> list[str]:
    return [result.verdict.text for result in head_to_head.scopes.values()]


def _ms(seconds: float, bounds: list[float] | None) -> str:
    """'12.3 ms [12.0, 12.6]' (the interval when the costs were timed here)."""
    digits = 3 if seconds < 0.01 else 1
    text = f"{_num(seconds * 1000.0, digits)} ms"
    if bounds is not None and len(bounds) == 2:
        text += f" [{_num(bounds[0] * 1000.0, digits)}, {_num(bounds[1] * 1000.0, digits)}]"
    return text


def cost_lines(head_to_head: HeadToHead) -> list[str]:
    """The shared step costs every speedup was priced with, each with its 95% interval: the target's decode and
    verify times (shared by all speculators), then each speculator's draft time; then any timing that broke
    the cost model (the advice is not reliable then)."""
    costs, spread = head_to_head.costs, head_to_head.costs.spread
    lines = [
        f"step costs ({costs.source}, {costs.device}; "
        f"{'95% intervals from the timing bootstrap' if spread else 'a profile: taken as exact'}):",
        "target: decode "
        + _ms(costs.t_decode_s, spread.t_decode_s_ci if spread else None)
        + "".join(
            f"; verify K={k} " + _ms(v, spread.t_verify_s_ci.get(k) if spread else None)
            for k, v in costs.t_verify_s.items()
        ),
    ]
    for name, table in costs.t_draft_s.items():
        bounds = spread.t_draft_s_ci.get(name, {}) if spread else {}
        lines.append(f"draft {name}: " + "; ".join(f"K={k} " + _ms(v, bounds.get(k)) for k, v in table.items()))
    lines += [f"timing not reliable: {violation}" for violation in (spread.timing_violations if spread else [])]
    return lines


# ------------------------------------------------------------------------------------------ sub-runs and settings


def check_verdict(checks: Iterable[tuple[str, str]]) -> tuple[str, list[str]]:
    """A sub-run's verdict (:func:`~dflash_doctor.rundir.status.overall_status`, the one the single ``check``
    prints) and the ids of its checks that warned, failed or errored, worst first: a head-to-head must not
    say "pass" for a speculator whose own check warned."""
    pairs = list(checks)
    flagged = [check_id for status in FLAGGED for check_id, own in pairs if own == status]
    return overall_status(status for _, status in pairs), flagged


def sub_run_line(name: str, verdict: str, flagged: list[str]) -> str:
    """``eagle3: warn (acceptance, eagle3-config)``: one speculator's verdict word and what it names."""
    return f"{name}: {verdict}" + (f" ({', '.join(flagged)})" if flagged else "")


#: the package's built-in drafts: named by their --draft word, not by where the package is installed
_DEMO_FOLDER = Path(__file__).resolve().parent.parent / "demo"
_DEMO_WORDS = {"smollm2-135m-dflash": "demo", "smollm2-135m-eagle3": "demo-eagle3"}


def _shown_path(value: Any, root: Path) -> str:
    """A path as the pages show it: a built-in demo draft by its --draft word, another path relative to the
    head-to-head folder, anything else (a hub id, a speculator's settings) as given.

    A relative path is one the sub-run was given from the working folder (``--target models/x``): the pages
    are written by the same process, from the same folder, so one that exists there is named from ``root``."""
    text = str(value)
    if not os.path.isabs(text) and not Path(text).exists():
        return text
    path = Path(text).resolve()
    if path.parent == _DEMO_FOLDER and path.name in _DEMO_WORDS:
        return _DEMO_WORDS[path.name]
    return os.path.relpath(path, Path(root).resolve())


#: DoctorConfig fields that name a file or folder (shown relative to the head-to-head folder in a command)
_PATH_FIELDS = ("target", "draft", "workload", "chat_template", "cost_profile", "engine_config")
#: the fields a sub-run's command repeats when they differ from the default (those that change what is measured)
_COMMAND_FIELDS = (
    "target",
    "draft",
    "draft_kind",
    "workload",
    "classes",
    "max_requests",
    "max_new_tokens",
    "temperature",
    "k",
    "device",
    "dtype",
    "seed",
    "chat_template",
    "cost_profile",
    "timing_budget_s",
    "end_of_request",
    "engine_config",
    "strict_classes",
)


def _flag_value(name: str, value: Any, root: Path) -> str:
    if name == "k":
        ks = sorted(int(k) for k in value)
        return f"{ks[0]}-{ks[-1]}" if len(ks) > 2 and ks == list(range(ks[0], ks[-1] + 1)) else ",".join(map(str, ks))
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return _shown_path(value, root) if name in _PATH_FIELDS else str(value)


def sub_run_command(record: RunRecord, root: Path) -> str:
    """The ``dflash-doctor check`` that repeats one sub-run alone, from its record's echoed config (the values
    that differ from the defaults; paths relative to the head-to-head folder; no draft: the built-in demo)."""
    defaults = DoctorConfig().as_dict()
    words = ["dflash-doctor", "check"]
    for name in _COMMAND_FIELDS:
        value = record.config.get(name)
        if (
            value is None
            or value == defaults.get(name)
            or (isinstance(value, (list, tuple)) and not value and not defaults.get(name))
        ):
            continue
        flag = "--timing-budget" if name == "timing_budget_s" else "--" + name.replace("_", "-")
        words.append(f"{flag} {_quoted(_flag_value(name, value, root))}")
    return " ".join(words)


def _quoted(text: str) -> str:
    return (
        text if text and all(c.isalnum() or c in "-_./:=,@+" for c in text) else "'" + text.replace("'", "'\\''") + "'"
    )


def _machine(record: RunRecord) -> str:
    """The sub-run's GPU (else its draft's device), platform and library versions. ``environment`` is the
    record's free-form mapping of what :func:`~dflash_doctor.inputs.machine.collect_environment` found (a
    machine without a GPU has no ``gpu``), so its keys are looked up, not required."""
    environment, draft = record.environment, record.models.get("draft")
    parts = [
        environment.get("gpu") or (draft.device if draft is not None else None),
        environment.get("platform"),
        *(f"{name} {environment[name]}" for name in ("python", "torch", "transformers") if environment.get(name)),
    ]
    return ", ".join(str(part) for part in parts if part)


def engine_settings(kind: str, draft: str, facts: Mapping[str, Any], k: int) -> dict[str, str]:
    """What to type in each engine to serve this speculator at K, from the kind's serving declaration
    (:mod:`dflash_doctor.models.kind_serving`): vLLM's ``--speculative-config`` (its method, the draft as DRAFT
    for a kind with a checkpoint, the kind's own settings as the run used them), and SGLang's and llama.cpp's
    flags where the engine serves the kind. A kind this install does not declare is named as vLLM's method,
    with its checkpoint. K is counted as the single ``check``'s speculative-k advice counts it: vLLM and
    llama.cpp the drafted tokens, SGLang with the anchor (K + 1)."""
    serving = kind_serving(kind) or KindServing(name=kind, vllm_method=kind)
    return {
        "vLLM": f"--speculative-config '{json.dumps(serving.vllm_config(k, facts))}'",
        "SGLang": serving.flags("sglang", k),
        "llama.cpp": serving.flags("llamacpp", k),
    }


def describe_sub_runs(root: Path, head_to_head: HeadToHead) -> HeadToHead:
    """The head-to-head with what the pages show beyond the statistics, read from each sub-run's run.json: per
    speculator its report link, command, date, machine, tool version and checks with their verdict; per scope
    whose verdict names a leader, the setting to type in each engine at the verdict's K and what DRAFT stands
    for.

    A speculator without a run folder (or whose folder has no run.json) is left as it is: there is no record
    to describe, and the pages leave the sub-run's facts out. A run.json that is there is read as every view
    reads one (:func:`~dflash_doctor.rundir.load.read_run_meta`, typed by :class:`RunRecord`): one that is not
    a run record, or one an older dflash-doctor wrote, raises that reader's UsageError naming the file and the
    fix, instead of pages built from a record nobody could read.

    Raises:
        UsageError: a sub-run's run.json is not valid JSON, not a run record, of another schema version, or
            has a field of the wrong shape or type.
    """
    facts: dict[str, tuple[str, str, dict[str, Any]]] = {}
    speculators = []
    for speculator in head_to_head.speculators:
        run_dir = speculator.run_dir
        if not run_dir or not (Path(run_dir) / RUN_JSON).is_file():
            speculators.append(speculator)
            continue
        record = RunRecord.from_json(read_run_meta(run_dir))
        checks = [SubRunCheck(c.id, c.status, c.summary) for c in record.checks]
        verdict, flagged = check_verdict((c.id, c.status) for c in checks)
        draft = record.models.get("draft")
        folder = Path(run_dir).resolve()  # a relative --out names it from the working folder, not from root
        sub_run = SubRun(
            folder=_shown_path(folder, root),
            report=_shown_path(folder / "report.html", root),
            command=sub_run_command(record, root),
            created_at=record.meta.created_at,
            machine=_machine(record),
            tool_version=record.meta.tool_version,
            verdict=verdict,
            flagged=flagged,
            checks=checks,
            draft_shown=_shown_path(speculator.draft, root),
        )
        speculators.append(replace(speculator, sub_run=sub_run))
        facts[speculator.name] = (speculator.kind, sub_run.draft_shown, draft.facts if draft is not None else {})
    scopes = {}
    for name, result in head_to_head.scopes.items():
        verdict = result.verdict
        leader = next((row for row in result.rows if row.speculator == verdict.winner), None)
        if leader is not None and verdict.winner in facts:
            kind, draft, draft_facts = facts[verdict.winner]
            k = int(leader.best_k)
            verdict = replace(verdict, deploy=DeploySettings(engine_settings(kind, draft, draft_facts, k), k, draft))
        scopes[name] = replace(result, verdict=verdict)
    return replace(head_to_head, speculators=speculators, scopes=scopes)


def settings_lines(verdict: Verdict) -> list[tuple[str, str]]:
    """(engine, setting) rows for a scope's verdict, the DRAFT placeholder explained last; none without a leader."""
    if verdict.deploy is None or not verdict.deploy.settings:
        return []
    settings = verdict.deploy.settings
    rows = [(engine, settings[engine]) for engine in ENGINES if engine in settings]
    return rows + [("DRAFT", f"the draft {verdict.deploy.draft_shown} on the serving machine")]


def settings_heading(verdict: Verdict) -> str:
    """What the settings are for: the deployment the verdict names, or the leader's when it is not decisive."""
    what = f"{verdict.winner} at K={verdict.deploy.settings_k if verdict.deploy is not None else None}"
    return f"to deploy {what}:" if verdict.decisive else f"if you deploy the leader anyway ({what}; not decided):"


def sub_run_rows(head_to_head: HeadToHead) -> list[dict[str, str]]:
    """One row per sub-run for the pages: its verdict line, the warned/failed checks with their summaries,
    its folder, report link, command, date, machine and tool version."""
    rows = []
    for speculator in head_to_head.speculators:
        run = speculator.sub_run
        if run is None:
            continue
        by_id = {c.id: c for c in run.checks}
        rows.append(
            {
                "name": speculator.name,
                "kind": speculator.kind,
                "line": sub_run_line(speculator.name, run.verdict, run.flagged),
                "verdict": run.verdict,
                "flagged": "; ".join(f"{i} ({by_id[i].status}): {by_id[i].summary}" for i in run.flagged) or "none",
                "report": run.report,
                "folder": run.folder,
                "command": run.command,
                "created_at": run.created_at,
                "machine": run.machine,
                "tool_version": run.tool_version,
            }
        )
    return rows


def shown_draft(speculator: Speculator) -> str:
    """The draft as the pages name it: relative to the head-to-head folder once the sub-run was described."""
    return speculator.sub_run.draft_shown if speculator.sub_run is not None else speculator.draft


# ------------------------------------------------------------------------------------------------- the views


def print_head_to_head(head_to_head: HeadToHead, console: Console) -> None:
    """The same rows as the reports, laid out for a terminal of 80 columns (a CI log's width): the figures in
    one table, the per-position curves (first six slots) in a second, each scope named once. Nothing is
    shortened: two drafts of one target often share a long name prefix, and an ellipsis made them
    indistinguishable."""
    rows = table_rows(head_to_head)

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

    console.print(
        scoped(
            "Head-to-head: the same prompts and target (* = the verdict's pick)",
            ("scope", "speculator", "K", "tau [95% CI]", "speedup [95% CI]"),
            [row[:5] for row in rows],
        )
    )
    console.print(
        scoped(
            "Per-position acceptance (unconditional), slots 1-6",
            ("scope", "speculator", "slots 1-6"),
            [[row[0], row[1], " ".join(row[5].split()[:6])] for row in rows],
        )
    )
    for line in cost_lines(head_to_head):
        console.print(f"  {escape(line)}")
    for result in head_to_head.scopes.values():
        console.print(f"  {for_terminal(result.verdict.text)}")
        if settings_lines(result.verdict):
            console.print(f"    {for_terminal(settings_heading(result.verdict))}")
        for engine, setting in settings_lines(result.verdict):
            console.print(f"    {for_terminal(engine)}: {for_terminal(setting)}", soft_wrap=True)


def markdown(head_to_head: HeadToHead) -> str:
    """head_to_head.md: the decision first (verdicts with the settings to type), then the table and curves,
    the step costs with their spread, and each sub-run's checks, report, command, date and machine."""
    cell = markdown_cell
    names = ", ".join(f"`{cell(s.name)}` ({cell(s.kind)}, {cell(shown_draft(s))})" for s in head_to_head.speculators)
    lines = [
        "# Head-to-head",
        "",
        f"Speculators: {names}; the same prompts and target, one sub-folder each.",
        "",
        "## Verdict",
        "",
    ]
    for result in head_to_head.scopes.values():
        verdict = result.verdict
        lines.append(f"- {cell(verdict.text)}")
        if settings_lines(verdict):
            lines.append(f"  {cell(settings_heading(verdict))}")
            lines += [
                f"  - {cell(engine)}: `{setting.replace('`', '')}`"
                if engine in ENGINES
                else f"  - {cell(engine)}: {cell(setting)}"
                for engine, setting in settings_lines(verdict)
            ]
    lines += ["", "## Table", "", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in table_rows(head_to_head)]
    lines += ["", "## Step costs", ""] + [f"- {cell(line)}" for line in cost_lines(head_to_head)]
    runs = sub_run_rows(head_to_head)
    if runs:
        lines += [
            "",
            "## Sub-runs",
            "",
            "| speculator | verdict | warnings and failures | report | date | machine | tool |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {cell(r['name'])} | {cell(r['verdict'])} | {cell(r['flagged'])} "
            f"| [report.html]({r['report'].replace(' ', '%20')}) "
            f"| {cell(r['created_at'])} | {cell(r['machine'])} | {cell(r['tool_version'])} |"
            for r in runs
        ]
        lines += ["", "Commands (paths relative to this folder):", ""]
        lines += [f"- {cell(r['name'])}: `{r['command'].replace('`', '')}`" for r in runs]
    lines += ["", _METHOD, ""]
    return "\n".join(lines)


_METHOD = (
    "Speedup: tokens emitted x plain decode time / time of the steps, every step priced at the speculator's "
    "draft time plus the target's verify time for the tokens it really drafted (a step that drafted nothing is a "
    "plain decode step); the target's times are shared by all speculators. Intervals: paired bootstrap over "
    'conversations and step timings together. "deploy X" is said only when X\'s speedup interval and the '
    "interval of its ratio to the runner-up both lie above 1, on enough conversations."
)


def _curves_svg(scope: str, rows: Sequence[ContenderRow]) -> str:
    """The per-position acceptance curves of one scope as a small inline SVG (the page opens offline)."""
    width, height, pad = 360, 160, 28
    slots = max((len(row.acceptance_rate_per_pos) for row in rows), default=0)
    if not slots:
        return ""
    colours = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
    step, span = (width - 2 * pad) / max(slots - 1, 1), height - 2 * pad
    parts = [
        f"<svg width='{width}' height='{height}' role='img' aria-label='{html.escape(scope, quote=True)}'>",
        f"<line x1='{pad}' y1='{height - pad}' x2='{width - pad}' y2='{height - pad}' stroke='#999'/>",
        f"<line x1='{pad}' y1='{pad}' x2='{pad}' y2='{height - pad}' stroke='#999'/>",
        f"<text x='{pad}' y='{height - 8}' font-size='10'>slot 1</text>",
        f"<text x='{width - pad - 30}' y='{height - 8}' font-size='10'>slot {slots}</text>",
        f"<text x='2' y='{pad}' font-size='10'>1.0</text>",
    ]
    for index, row in enumerate(rows):
        colour = colours[index % len(colours)]
        points = " ".join(
            f"{pad + step * i:.1f},{height - pad - span * r:.1f}"
            for i, r in enumerate(row.acceptance_rate_per_pos)
            if r is not None and r == r
        )
        parts.append(f"<polyline fill='none' stroke='{colour}' stroke-width='2' points='{points}'/>")
        parts.append(
            f"<text x='{width - pad + 2}' y='{pad + 12 * index}' font-size='10' fill='{colour}'>"
            f"{html.escape(row.speculator)}</text>"
        )
    return "".join(parts) + "</svg>"


def html_page(head_to_head: HeadToHead) -> str:
    """head_to_head.html, self-contained (no script, no remote asset): the same sections as :func:`markdown`,
    with the per-position curves drawn per scope beside the table's figures."""
    e = html.escape
    names = ", ".join(f"<code>{e(s.name)}</code> ({e(s.kind)}, {e(shown_draft(s))})" for s in head_to_head.speculators)
    runs = sub_run_rows(head_to_head)
    first = runs[0] if runs else None
    header = (
        (
            f"<p class='muted'>{e(first['created_at'])} &middot; {e(first['machine'])} &middot; dflash-doctor "
            f"{e(first['tool_version'])}</p>"
        )
        if first
        else ""
    )
    verdict_items = []
    for result in head_to_head.scopes.values():
        verdict = result.verdict
        item = f"<li class='{'decided' if verdict.decisive else 'open'}'>{e(verdict.text)}"
        if settings_lines(verdict):
            item += (
                f"<div>{e(settings_heading(verdict))}</div><table class='settings'>"
                + "".join(
                    f"<tr><th>{e(engine)}</th>"
                    f"<td>{'<code>' + e(setting) + '</code>' if engine in ENGINES else e(setting)}</td></tr>"
                    for engine, setting in settings_lines(verdict)
                )
                + "</table>"
            )
        verdict_items.append(item + "</li>")
    head = "".join(f"<th>{e(h)}</th>" for h in HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in table_rows(head_to_head))
    curves = "".join(
        f"<figure><figcaption>{e(scope)}</figcaption>{_curves_svg(scope, result.rows)}</figure>"
        for scope, result in head_to_head.scopes.items()
    )
    costs = "".join(f"<li>{e(line)}</li>" for line in cost_lines(head_to_head))
    sub_runs = ""
    if runs:
        sub_runs = (
            "<h2>Sub-runs</h2><table><tr><th>speculator</th><th>verdict</th><th>warnings and failures</th>"
            "<th>report</th>"
            "<th>date</th><th>machine</th><th>tool</th></tr>"
            + "".join(
                f"<tr><td>{e(r['name'])}</td><td class='{e(r['verdict'])}'>{e(r['verdict'])}</td>"
                f"<td>{e(r['flagged'])}</td>"
                f"<td><a href='{e(r['report'], quote=True)}'>{e(r['report'])}</a></td><td>{e(r['created_at'])}</td>"
                f"<td>{e(r['machine'])}</td><td>{e(r['tool_version'])}</td></tr>"
                for r in runs
            )
            + "</table><p>Commands (paths relative to this folder):</p><ul>"
            + "".join(f"<li>{e(r['name'])}: <code>{e(r['command'])}</code></li>" for r in runs)
            + "</ul>"
        )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>Head-to-head</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:80em}table{border-collapse:collapse;margin:.5em 0}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}.muted{color:#666}"
        "li.decided{font-weight:bold}.fail,.error{color:#b00}.warn{color:#a60}.pass{color:#070}"
        "figure{display:inline-block;margin:0 1em 1em 0}code{white-space:pre-wrap}</style></head><body>"
        f"<h1>Head-to-head</h1>{header}<p>Speculators: {names}; the same prompts and target, one sub-folder each.</p>"
        f"<h2>Verdict</h2><ul>{''.join(verdict_items)}</ul>"
        f"<h2>Table</h2><table><tr>{head}</tr>{body}</table>"
        f"<h2>Per-position acceptance (unconditional, each at its best K)</h2>{curves}"
        f"<h2>Step costs</h2><ul>{costs}</ul>{sub_runs}<p class='muted'>{e(_METHOD)}</p></body></html>"
    )


def write_head_to_head(root: Path, head_to_head: HeadToHead) -> None:
    """``head_to_head.json``, ``head_to_head.md`` and ``head_to_head.html`` in the head-to-head's folder (the
    pages show the sub-runs' facts and engine settings once :func:`describe_sub_runs` has added them)."""
    write_text_atomic(root / HEAD_TO_HEAD_JSON, json.dumps(head_to_head.to_json(), indent=2, allow_nan=True))
    write_text_atomic(root / "head_to_head.md", markdown(head_to_head))
    write_text_atomic(root / "head_to_head.html", html_page(head_to_head))
