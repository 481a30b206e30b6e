"""Views of a tune run (its typed :class:`~dflash_doctor.tune.result.TuneResult`, ``tune.json``): terminal tables,
report.md, report.html, and the figures the report and the dashboard share.

Three tables, one source each: the measured grid (per load, K and scope: tau, net speedup with
intervals, TTFT, TPOT, end-to-end latency, throughput, rollback compute), predicted vs measured (the K
held out of the cost fit marked, the predicted interval carrying the fit's error and tau's, whether the
measured speedup lies inside it, and the step time predicted vs measured so a miss shows where it came
from), and the recommendation with its verdict and the engine settings. Three figures:
speedup vs K per class with intervals, latency (TPOT) vs throughput per K and load, predicted vs measured.
"""

from __future__ import annotations

import html
from pathlib import Path
import plotly.graph_objects as go
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dflash_doctor.report.html import figure_html, plotly_script
from dflash_doctor.report.templating import ci, fmt, markdown_cell, pct
from dflash_doctor.tune.analysis import OVERALL
from dflash_doctor.tune.loads import CONCURRENCY, load_label, load_text
from dflash_doctor.tune.result import Load, TuneResult

DRIFT_WARNING = 0.15  # baseline drift beyond which the report says the speedups are unsteady

MEASURED_COLUMNS = (
    "load",
    "K",
    "class",
    "req",
    "tau",
    "tau 95% CI",
    "speedup",
    "speedup 95% CI",
    "TTFT ms",
    "TPOT ms",
    "e2e s",
    "out tok/s",
    "req/s",
    "rollback/token",
)
PREDICTION_COLUMNS = (
    "load",
    "K",
    "class",
    "fit/held out",
    "tau pred",
    "tau meas",
    "step ms pred / meas",
    "speedup pred",
    "pred 95% CI (fit + tau)",
    "speedup meas",
    "meas 95% CI",
    "meas in pred CI?",
    "error",
    "rel. error",
    "pays? pred / meas",
)


def _ms(value: float | None) -> str:
    return fmt(value * 1000.0 if value is not None else None, 1)


def measured_rows(result: TuneResult) -> list[tuple[str, ...]]:
    return [
        (
            load_text(c.load),
            str(c.k),
            c.scope,
            str(c.num_requests),
            fmt(c.tau),
            ci(c.tau_ci),
            fmt(c.speedup),
            ci(c.speedup_ci),
            _ms(c.ttft_s),
            _ms(c.tpot_s),
            fmt(c.e2e_s),
            fmt(c.output_tokens_per_s, 1),
            fmt(c.requests_per_s),
            fmt(c.rollback_per_token),
        )
        for c in result.cells
    ]


def prediction_rows(result: TuneResult) -> list[tuple[str, ...]]:
    return [
        (
            load_text(p.load),
            str(p.k),
            p.scope,
            "held out" if p.held_out else "fit",
            fmt(p.predicted_tau),
            fmt(p.measured_tau),
            f"{_ms(p.predicted_step_s)} / {_ms(p.measured_step_s)}",
            fmt(p.predicted_speedup),
            ci(p.predicted_speedup_ci),
            fmt(p.measured_speedup),
            ci(p.measured_speedup_ci),
            _yes_no(p.within_interval),
            fmt(p.speedup_error),
            pct(p.speedup_relative_error),
            f"{_yes_no(p.predicted_pays)} / {_yes_no(p.measured_pays)}",
        )
        for p in result.prediction
    ]


def _yes_no(value: bool | None) -> str:
    return "?" if value is None else "yes" if value else "no"


def _short(kind: str, load: Load) -> str:
    """A load level in a figure's legend: c8 (concurrency), r2/s (request rate)."""
    return f"c{load_text(load)}" if kind == CONCURRENCY else f"r{load_text(load)}/s"


def grid_line(result: TuneResult) -> str:
    """The grid in one sentence: K, the loads and how they were sent, requests per cell, the fit K."""
    grid = result.grid
    loads = ", ".join(load_text(load) for load in grid.loads)
    sent = (
        f"loads: concurrency {loads} (closed loop: that many requests in flight)"
        if result.load_kind == CONCURRENCY
        else (
            f"loads: request rate {loads} per second (open loop: gamma "
            f"arrivals of burstiness {fmt(grid.burstiness)}, 1 = Poisson; "
        )
        + (
            "no cap on requests in flight)"
            if grid.max_concurrency is None
            else f"at most {grid.max_concurrency} in flight)"
        )
    )
    return (
        f"K grid {grid.k} (0 = speculation off), {sent}, {grid.num_requests} requests per cell, "
        f"costs fitted from K {grid.fit_k}."
    )


def fit_lines(result: TuneResult) -> list[str]:
    lines = []
    kind = result.load_kind
    for load, f in result.fits.items():
        lines.append(
            f"{load_label(kind, load)}: t_decode {_ms_ci(f.t_decode_s, f.t_decode_s_ci)} ms, "
            f"t_draft {_ms_ci(f.t_draft_s, f.t_draft_s_ci)} ms, verify "
            f"+{_ms_ci(f.verify_slope_s, f.verify_slope_s_ci)} ms per drafted token "
            f"(fitted from K {', '.join(map(str, f.fit_ks))}; {f.note}); "
            f"profile {result.cost_profiles.get(load, '-')}"
        )
    for load, drift in result.baseline_drift.items():
        steadiness = (
            "the machine was steady"
            if abs(drift) <= DRIFT_WARNING
            else "the machine drifted: every speedup carries about half of it as extra error"
        )
        lines.append(
            f"{load_label(kind, load)}: the K=0 baseline measured again after the grid "
            f"ran {abs(drift):.0%} {'slower' if drift > 0 else 'faster'} per token ({steadiness})"
        )
    error = result.held_out_error
    lines.append(
        f"held-out K, overall: mean absolute speedup error {pct(error)}"
        if error is not None
        else "no held-out K: every speculative K was used by the fit (add K to --k or narrow --fit-k)"
    )
    for p in result.prediction:
        if p.held_out and p.scope == OVERALL and p.tau_relative_error is not None:
            inside = {
                True: "inside the predicted interval",
                False: "outside the predicted interval",
                None: "no predicted interval",
            }[p.within_interval]
            lines.append(
                f"{load_label(kind, p.load)}, held-out K={p.k}: predicted "
                f"{fmt(p.predicted_speedup)}x {ci(p.predicted_speedup_ci)}, measured "
                f"{fmt(p.measured_speedup)}x ({inside}); the miss splits into tau "
                f"{pct(p.tau_relative_error)}, step time {pct(p.step_relative_error)}, "
                f"definitions {pct(p.definition_gap)}"
            )
    return lines


def _ms_ci(value: float, bounds: list[float] | None) -> str:
    """A fitted cost in ms with its 95% interval when the fit has one (cells without per-request figures give none)."""
    return _ms(value) + (f" {ci([b * 1000.0 for b in bounds], 1)}" if bounds else "")


def warning_lines(result: TuneResult) -> list[str]:
    """What a server said that puts its K's figures in doubt (a K = 0 server that drafted, another K than asked):
    every view shows them next to the recommendation, which they can invalidate."""
    return [f"K={s.k}: {s.warning}" for s in result.servers if s.warning]


def recommendation_lines(result: TuneResult) -> list[str]:
    lines = []
    kind = result.load_kind
    for load, picks in result.recommendation.items():
        for scope, pick in picks.items():
            # a K = 0 pick's reason starts with its verdict ("Speculation off", "Within the noise")
            what = "" if pick.k == 0 else f"K={pick.k} (conservative K={pick.conservative_k}). "
            lines.append(f"{load_label(kind, load)}, {scope}: {what}{pick.reason}")
    lines += [f"{engine}: {setting}" for engine, setting in result.engine_settings.items()]
    return lines


def print_tune(result: TuneResult, console: Console) -> None:
    for title, columns, rows in (
        (
            "Measured on the engine (speedup = TPOT at K=0 / TPOT at K, same requests and load)",
            MEASURED_COLUMNS,
            measured_rows(result),
        ),
        ("Predicted (fitted step costs x teacher-forced tau) vs measured", PREDICTION_COLUMNS, prediction_rows(result)),
    ):
        table = Table(title=title)
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*(escape(x) for x in row))
        console.print(table)
    for line in fit_lines(result) + recommendation_lines(result):
        console.print(escape(line))
    for line in warning_lines(result):
        console.print(f"[bold yellow]warning[/] {escape(line)}")


def _md_table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(str(markdown_cell(x)) for x in row) + " |\n" for row in rows)


def render_markdown(result: TuneResult) -> str:
    parts = [
        "# dflash-doctor tune\n",
        f"{grid_line(result)} Definitions: vLLM's (tau = 1 + accepted / drafts; TTFT, TPOT as `vllm bench serve`).\n",
        "## Measured\n",
        _md_table(MEASURED_COLUMNS, measured_rows(result)),
        "\n## Predicted vs measured\n",
        _md_table(PREDICTION_COLUMNS, prediction_rows(result)),
        "\n" + "".join(f"- {markdown_cell(line)}\n" for line in fit_lines(result)),
        "\n## Recommendation\n",
        "".join(f"- {markdown_cell(line)}\n" for line in recommendation_lines(result)),
    ]
    if warnings := warning_lines(result):
        parts += ["\n## Warnings\n", "".join(f"- {markdown_cell(w)}\n" for w in warnings)]
    return "".join(parts)


def _error_bar(value: float, bounds: list[float | None] | None, side: int) -> float:
    """How far the interval's ``side`` end (0 low, 1 high) lies
    below or above ``value``; 0 where there is no such end."""
    end = (bounds or [None, None])[side]
    return 0 if end is None else (value - end if side == 0 else end - value)


def figures(result: TuneResult) -> list[tuple[str, go.Figure]]:
    """(title, figure) for the report and the dashboard."""
    cells, kind = result.cells, result.load_kind
    speedup = go.Figure()
    for load in result.grid.loads:
        for scope in sorted({c.scope for c in cells}, key=lambda s: (s != OVERALL, s)):
            points = [(c.k, c.speedup, c.speedup_ci) for c in cells if c.load == load and c.scope == scope]
            points = [(k, value, bounds) for k, value, bounds in points if value is not None]
            speedup.add_trace(
                go.Scatter(
                    x=[k for k, _, _ in points],
                    y=[value for _, value, _ in points],
                    mode="lines+markers",
                    name=f"{scope} @ {_short(kind, load)}",
                    error_y={
                        "type": "data",
                        "symmetric": False,
                        "array": [_error_bar(value, bounds, 1) for _, value, bounds in points],
                        "arrayminus": [_error_bar(value, bounds, 0) for _, value, bounds in points],
                    },
                )
            )
    speedup.add_hline(y=1.0, line_dash="dot")
    speedup.update_layout(xaxis_title="K (draft tokens per step; 0 = off)", yaxis_title="net speedup vs K=0 (95% CI)")

    tradeoff = go.Figure()
    for k in result.grid.k:
        points = [c for c in cells if c.k == k and c.scope == OVERALL and c.output_tokens_per_s]
        tradeoff.add_trace(
            go.Scatter(
                x=[c.output_tokens_per_s for c in points],
                y=[(c.tpot_s or 0) * 1000 for c in points],
                mode="lines+markers+text",
                text=[_short(kind, c.load) for c in points],
                name=f"K={k}",
            )
        )
    tradeoff.update_layout(xaxis_title="output tokens/s", yaxis_title="TPOT (ms)")

    held = go.Figure()
    for held_out in (False, True):
        points = [p for p in result.prediction if p.held_out == held_out and p.measured_speedup is not None]
        held.add_trace(
            go.Scatter(
                x=[p.measured_speedup for p in points],
                y=[p.predicted_speedup for p in points],
                mode="markers",
                text=[f"K={p.k} {p.scope} {_short(kind, p.load)}" for p in points],
                name="held-out K" if held_out else "fit K",
            )
        )
    values = [v for p in result.prediction for v in (p.measured_speedup, p.predicted_speedup) if v is not None]
    if values:
        low, high = min(values + [1.0]) * 0.9, max(values + [1.0]) * 1.1
        held.add_trace(
            go.Scatter(x=[low, high], y=[low, high], mode="lines", line={"dash": "dot"}, name="predicted = measured")
        )
    held.update_layout(xaxis_title="measured speedup", yaxis_title="predicted speedup")
    return [
        ("Net speedup vs K per class", speedup),
        ("Latency vs throughput per K and load", tradeoff),
        ("Predicted vs measured speedup", held),
    ]


def _html_table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _items(lines: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>"


def render_html(result: TuneResult) -> str:
    charts = "".join(
        f"<h2>{html.escape(title)}</h2>{figure_html(fig, f'tune-fig-{i}')}"
        for i, (title, fig) in enumerate(figures(result))
    )
    warnings = warning_lines(result)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>dflash-doctor tune</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px "
        "solid #ccc;padding:2px 6px}</style>"
        f"{plotly_script()}</head><body><h1>dflash-doctor tune</h1>"
        f"<h2>Recommendation</h2>{_items(recommendation_lines(result))}"
        f"{f'<h2>Warnings</h2>{_items(warnings)}' if warnings else ''}{charts}"
        f"<h2>Measured</h2>{_html_table(MEASURED_COLUMNS, measured_rows(result))}"
        "<h2>Predicted vs "
        f"measured</h2>{_html_table(PREDICTION_COLUMNS, prediction_rows(result))}{_items(fit_lines(result))}"
        "</body></html>"
    )


def write_reports(run_dir: Path, result: TuneResult) -> list[Path]:
    md, page = run_dir / "report.md", run_dir / "report.html"
    md.write_text(render_markdown(result), encoding="utf-8")
    page.write_text(render_html(result), encoding="utf-8")
    return [md, page]
