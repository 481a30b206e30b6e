"""report.html: one self-contained page (plotly.js embedded once, no CDN) that opens offline; ``--plotly cdn``
links plotly.js from its CDN instead, for pages kept as CI artefacts (4.6 MB less each).

Charts come from :mod:`dflash_doctor.report.figures` (the dashboard draws the same ones); the page layout is
the jinja2 template ``data/templates/report.html`` with autoescaping on, because token text, prompts
and check evidence are untrusted. Plotly's own JSON escapes ``<``, ``>`` and ``/``.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
from functools import lru_cache
from typing import Any, Hashable, Iterable, cast

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import plotly.offline
from markupsafe import Markup

from dflash_doctor.report import figures
from dflash_doctor.stats import deviations
from dflash_doctor.stats.deviations import DeviationAnalysis, PatternExample
from dflash_doctor.inputs.config import parse_plotly_source
from dflash_doctor.report.content import check_counts, class_rows, incomplete_note, verdict
from dflash_doctor.report.templating import html_env
from dflash_doctor.rundir.load import Run

MAX_VIEWER_STEPS_PER_REQUEST = 40
NEWLINE_MARK = "\u21b5"  # shown before a newline inside a token so whitespace stays visible
_PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}


@lru_cache(maxsize=2)
def plotly_script(source: str = "inline") -> Markup:
    """The page's one ``<script>`` for plotly.js (see :data:`dflash_doctor.inputs.config.PLOTLY_SOURCES`). The CDN tag
    names the version bundled with the installed plotly package and pins it with that bundle's SHA-256 (subresource
    integrity), as plotly's own ``include_plotlyjs="cdn"`` does, so the charts draw the same either way."""
    bundle = plotly.offline.get_plotlyjs()
    if parse_plotly_source(source) == "inline":
        return Markup(f"<script>{bundle}</script>")
    integrity = "sha256-" + base64.b64encode(hashlib.sha256(bundle.encode("utf-8")).digest()).decode("ascii")
    url = f"https://cdn.plot.ly/plotly-{plotly.offline.get_plotlyjs_version()}.min.js"
    return Markup(f'<script charset="utf-8" src="{url}" integrity="{integrity}" crossorigin="anonymous"></script>')


def figure_html(fig: go.Figure, div_id: str) -> Markup:
    """A chart div plus its newPlot call, relying on the page's single plotly.js script (:func:`plotly_script`)."""
    return Markup(pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id, config=_PLOTLY_CONFIG))


def _visible(text: str | None) -> str:
    return (text or "").replace("\n", NEWLINE_MARK + "\n")


def _hover(row: dict[Hashable, Any]) -> str:
    return (
        f"slot {row['offset']}: draft {row['draft_text']!r} (target prob {row['target_prob_of_draft']:.3f}) "
        f"vs target {row['target_text']!r} (draft prob "
        f"{row['draft_prob_of_target']:.3f}, rank in draft {row['target_rank_in_draft']})"
    )


def _step_pieces(step_tokens: pd.DataFrame, bonus_token: int | None) -> list[dict[str, str]]:
    """Accepted draft tokens, then the first rejected one with the target's correction, or the bonus
    token when every slot was accepted. Slots after the first rejection were never committed."""
    pieces = []
    for row in step_tokens.sort_values("offset").to_dict("records"):
        if row["accepted"]:
            pieces.append({"kind": "accepted", "text": _visible(row["draft_text"]), "title": _hover(row)})
            continue
        pieces.append({"kind": "rejected", "text": _visible(row["draft_text"]), "title": _hover(row)})
        pieces.append(
            {
                "kind": "correction",
                "text": _visible(row["target_text"]),
                "title": f"target token committed instead: {row['target_text']!r}",
            }
        )
        return pieces
    if bonus_token is not None:
        pieces.append(
            {
                "kind": "bonus",
                "text": "+",
                "title": f"bonus token id {bonus_token} (all {len(pieces)} draft tokens accepted)",
            }
        )
    return pieces


def sample_requests(run: Run) -> list[str]:
    """Request ids for the token viewer: per class, the first request in run order and the one with
    the lowest tau (the worst case is where a reader looks for the cause)."""
    requests = run.requests
    chosen: list[str] = []
    for _, group in requests.groupby("class", sort=True):
        candidates = [group["request_id"].iloc[0]]
        if group["tau"].notna().any():  # requests that never drafted (e.g. answered by a stop token) have no tau
            candidates.append(group["request_id"].iloc[group["tau"].argmin()])
        chosen.extend(rid for rid in dict.fromkeys(candidates) if rid not in chosen)
    return chosen


WHY_REJECTED_EXAMPLES_PER_CLASS = 3  # the "Why rejected" patterns whose example request joins the token viewer


def token_viewer(run: Run, extra_request_ids: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The sampled requests (and ``extra_request_ids``) as coloured token pieces per step (first steps
    only, to bound page size)."""
    if run.requests.empty or run.tokens.empty:
        return []
    tokens_by_request = {rid: group for rid, group in run.tokens.groupby("request_id", sort=False)}
    bonus_by_step = {
        (r["request_id"], r["step"]): r["bonus_token"]
        for r in run.steps[["request_id", "step", "bonus_token"]].to_dict("records")
    }
    requests = run.requests.set_index("request_id").to_dict("index")
    viewer = []
    for request_id in dict.fromkeys([*sample_requests(run), *extra_request_ids]):
        request_tokens = tokens_by_request.get(request_id)
        if request_tokens is None:
            continue
        steps = []
        for step, step_tokens in itertools.islice(
            request_tokens.groupby("step", sort=True), MAX_VIEWER_STEPS_PER_REQUEST
        ):
            # pandas types a group key as any scalar; the steps table's "step" column holds ints (schema.py)
            steps.append(
                {
                    "step": int(cast(int, step)),
                    "pieces": _step_pieces(step_tokens, bonus_by_step.get((request_id, step))),
                }
            )
        request = requests[request_id]
        viewer.append(
            {
                "request_id": request_id,
                "class": request["class"],
                "tau": float(request["tau"]),
                "num_steps": int(request["num_steps"]),
                "num_steps_shown": len(steps),
                "steps": steps,
            }
        )
    return viewer


def charts(run: Run) -> list[dict[str, Any]]:
    """Every chart of the report, in page order, with the section it belongs to."""
    summary = run.record.summary
    built = [
        ("acceptance", "tau-by-class", figures.tau_by_class_figure(summary)),
        ("acceptance", "rate-by-slot", figures.acceptance_by_position_figure(summary)),
        ("acceptance", "conditional-rate-by-slot", figures.acceptance_by_position_figure(summary, conditional=True)),
        ("acceptance", "acceptance-histogram", figures.acceptance_histogram_figure(summary)),
        ("acceptance", "acceptance-along-output", figures.acceptance_along_output_figure(run.steps)),
        ("sweep", "speedup-by-k", figures.speedup_by_k_figure(summary.sweep, run.record.recommendation)),
    ]
    return [
        {"section": section, "id": f"chart-{name}", "html": figure_html(fig, f"chart-{name}")}
        for section, name, fig in built
    ]


def why_rejected_section(analysis: DeviationAnalysis, viewer: list[dict[str, Any]]) -> dict[str, Any]:
    """The deviation analysis (the typed record report.json shows as JSON), its charts, and
    ``example_anchor``: where a top pattern's example sits in the token viewer (its step when shown, else
    its request, else None)."""
    shown_steps = {(r["request_id"], s["step"]) for r in viewer for s in r["steps"]}
    shown_requests = {r["request_id"] for r in viewer}

    def example_anchor(example: PatternExample) -> str | None:
        key = (example.request_id, example.step)
        return step_anchor(*key) if key in shown_steps else request_anchor(key[0]) if key[0] in shown_requests else None

    built = [("category", figures.category_acceptance_figure(analysis))]
    built += [
        (key.replace("by_", "").replace("_", "-"), figures.acceptance_along_figure(analysis, key))
        for key in figures.DEVIATION_AXES
    ]
    charts = [{"id": f"chart-why-{name}", "html": figure_html(fig, f"chart-why-{name}")} for name, fig in built]
    return {"analysis": analysis, "charts": charts, "example_anchor": example_anchor}


def request_anchor(request_id: str) -> str:
    """The token viewer's element id of a request (HTML ids hold no whitespace)."""
    return "request-" + "_".join(str(request_id).split())


def step_anchor(request_id: str, step: int) -> str:
    return f"{request_anchor(request_id)}-step-{step}"


def render_html(run: Run, analysis: DeviationAnalysis | None = None, plotly: str = "inline") -> str:
    """report.html; ``analysis`` is the run's :func:`dflash_doctor.stats.deviations.analyze_run` when the caller has it;
    ``plotly``: where the page loads plotly.js from (:data:`dflash_doctor.inputs.config.PLOTLY_SOURCES`)."""
    record = run.record
    analysis = analysis if analysis is not None else deviations.analyze_run(run)
    examples = [
        pair.example.request_id
        for summary in analysis.by_class.values()
        for pair in summary.top_pairs[:WHY_REJECTED_EXAMPLES_PER_CLASS]
    ]
    viewer = token_viewer(run, examples)
    return (
        html_env()
        .get_template("report.html")
        .render(
            run_name=run.name,
            incomplete=incomplete_note(run),
            record=record,
            verdict=verdict(record.checks),
            counts=check_counts(record.checks),
            checks=record.checks,
            rows=class_rows(record),
            step_costs=record.summary.sweep.step_costs() if record.summary.sweep is not None else None,
            charts=charts(run),
            viewer=viewer,
            why=why_rejected_section(analysis, viewer),
            step_anchor=step_anchor,
            request_anchor=request_anchor,
            plotly_script=plotly_script(plotly),
        )
    )
