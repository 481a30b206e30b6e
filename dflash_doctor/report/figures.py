"""Plotly figure builders shared by report.html, compare.html and the Streamlit dashboard.

Every builder is pure: run data in (the record's typed :class:`~dflash_doctor.rundir.run_record.Summary`,
:class:`~dflash_doctor.rundir.run_record.Sweep` and recommendations, a deviation analysis, or a Parquet table as a
DataFrame), a ``go.Figure`` out. None reads files, prints or mutates its input,
so the HTML report and the dashboard show the same picture of the same numbers.

Conventions: "slot" is the 1-based position inside the drafted block (vLLM's per-pos index + 1);
tau is the mean acceptance length with the bonus token included; a class keeps its colour in every
figure (:func:`class_colors`), and "overall" is always drawn in black.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dflash_doctor.rundir.run_record import OVERALL, Metrics, Recommendation, Summary, Sweep
from dflash_doctor.stats.deviations import BinRow, DeviationAnalysis, SliceAnalysis
from dflash_doctor.stats.head_to_head import ContenderRow

OVERALL_COLOR = "#222222"
_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
)
FIGURE_HEIGHT_PX = 380
_LAYOUT = dict(
    template="plotly_white",
    height=FIGURE_HEIGHT_PX,
    margin=dict(l=60, r=20, t=50, b=50),
    legend=dict(orientation="h", y=-0.2),
)


def class_colors(classes: Iterable[str]) -> dict[str, str]:
    """A stable colour per class (sorted name order), so math is the same colour in every view."""
    colors = {cls: _PALETTE[i % len(_PALETTE)] for i, cls in enumerate(sorted(c for c in set(classes) if c != OVERALL))}
    colors[OVERALL] = OVERALL_COLOR
    return colors


def _empty(title: str, message: str) -> go.Figure:
    """A figure that says why it is empty instead of drawing blank axes."""
    fig = go.Figure(layout=dict(title=title, **_LAYOUT))
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font=dict(size=14))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def _none_to_nan(values: Sequence[Any]) -> list[float]:
    return [np.nan if v is None else float(v) for v in values]


def tau_by_class_figure(summary: Summary) -> go.Figure:
    """Mean acceptance length per class with its 95% bootstrap interval as error bars."""
    title = "Mean acceptance length tau per class (bonus included, 95% CI)"
    series = summary.drafted_scopes()
    if not series:
        return _empty(title, "No drafted steps in this run.")
    colors = class_colors(name for name, _ in series)
    names = [name for name, _ in series]
    tau = _none_to_nan([m.mean_acceptance_length for _, m in series])
    ci = [_none_to_nan(m.mean_acceptance_length_ci) for _, m in series]
    fig = go.Figure(
        go.Bar(
            x=names,
            y=tau,
            marker_color=[colors[n] for n in names],
            error_y=dict(
                type="data",
                symmetric=False,
                array=[hi - t for t, (_, hi) in zip(tau, ci)],
                arrayminus=[t - lo for t, (lo, _) in zip(tau, ci)],
            ),
            customdata=[[lo, hi, m.num_requests] for (lo, hi), (_, m) in zip(ci, series)],
            hovertemplate=(
                "%{x}: tau %{y:.2f} [%{customdata[0]:.2f}, "
                "%{customdata[1]:.2f}]<br>%{customdata[2]} requests<extra></extra>"
            ),
        ),
        layout=dict(title=title, **_LAYOUT),
    )
    fig.update_yaxes(title="tau (tokens per step)", rangemode="tozero")
    return fig


def acceptance_by_position_figure(summary: Summary, *, conditional: bool = False) -> go.Figure:
    """Acceptance per draft slot per class: unconditional r_i (with CI band) or conditional a_i = r_i / r_{i-1}.

    The unconditional curve is what tau is made of (tau = 1 + sum r_i); the conditional one shows at
    which slot the draft starts to lose, independent of the slots before it.
    """
    title = (
        "Conditional acceptance a_i per draft slot"
        if conditional
        else "Acceptance rate r_i per draft slot (unconditional, 95% CI)"
    )

    def rates_of(metrics: Metrics) -> list[float | None]:
        return metrics.conditional_acceptance_rate_per_pos if conditional else metrics.acceptance_rate_per_pos

    series = [(name, m) for name, m in summary.drafted_scopes() if rates_of(m)]
    if not series:
        return _empty(title, "No drafted steps in this run.")
    colors = class_colors(name for name, _ in series)
    fig = go.Figure(layout=dict(title=title, **_LAYOUT))
    for name, metrics in series:
        rates = _none_to_nan(rates_of(metrics))
        slots = list(range(1, len(rates) + 1))
        ci = metrics.acceptance_rate_per_pos_ci if not conditional else None
        if ci:
            lo = _none_to_nan([pair[0] for pair in ci])
            hi = _none_to_nan([pair[1] for pair in ci])
            fig.add_trace(
                go.Scatter(
                    x=slots + slots[::-1],
                    y=hi + lo[::-1],
                    fill="toself",
                    fillcolor=colors[name],
                    opacity=0.15,
                    line=dict(width=0),
                    hoverinfo="skip",
                    showlegend=False,
                    legendgroup=name,
                )
            )
        fig.add_trace(
            go.Scatter(
                x=slots,
                y=rates,
                mode="lines+markers",
                name=name,
                legendgroup=name,
                line=dict(color=colors[name]),
                hovertemplate=f"{name} slot %{{x}}: %{{y:.3f}}<extra></extra>",
            )
        )
    fig.update_xaxes(title="draft slot", dtick=1)
    fig.update_yaxes(title="acceptance", range=[0, 1.02])
    return fig


def head_to_head_positions_figure(scope: str, rows: Sequence[ContenderRow]) -> go.Figure:
    """Each speculator's unconditional acceptance r_i per draft slot in one scope of a head-to-head, at its best K."""
    title = f"Acceptance rate r_i per draft slot, {scope} (unconditional, each at its best K)"
    series = [
        (row.speculator, _none_to_nan(row.acceptance_rate_per_pos)) for row in rows if row.acceptance_rate_per_pos
    ]
    if not series:
        return _empty(title, "No speculator drafted in this scope.")
    colors = class_colors(name for name, _ in series)
    fig = go.Figure(layout=dict(title=title, **_LAYOUT))
    for name, rates in series:
        fig.add_trace(
            go.Scatter(
                x=list(range(1, len(rates) + 1)),
                y=rates,
                mode="lines+markers",
                name=name,
                line=dict(color=colors[name]),
                hovertemplate=f"{name} slot %{{x}}: %{{y:.3f}}<extra></extra>",
            )
        )
    fig.update_xaxes(title="draft slot", dtick=1)
    fig.update_yaxes(title="acceptance", range=[0, 1.02])
    return fig


def acceptance_histogram_figure(summary: Summary) -> go.Figure:
    """Share of steps that accepted 0, 1, ..., K draft tokens, per class (grouped bars).

    A spike at 0 means the first draft token is already wrong (template, tokenizer or layer
    offset problems); a spike at K means K is too small for this class.
    """
    title = "Accepted draft tokens per step (share of steps)"
    series = [(name, m) for name, m in summary.drafted_scopes() if sum(m.acceptance_histogram)]
    if not series:
        return _empty(title, "No drafted steps in this run.")
    colors = class_colors(name for name, _ in series)
    fig = go.Figure(layout=dict(title=title, barmode="group", **_LAYOUT))
    for name, metrics in series:
        counts = np.asarray(metrics.acceptance_histogram, dtype=float)
        fig.add_trace(
            go.Bar(
                x=list(range(len(counts))),
                y=counts / counts.sum(),
                name=name,
                marker_color=colors[name],
                customdata=counts,
                hovertemplate=f"{name}: %{{x}} accepted in %{{y:.1%}} of steps (%{{customdata:.0f}})<extra></extra>",
            )
        )
    fig.update_xaxes(title="accepted draft tokens in the step", dtick=1)
    fig.update_yaxes(title="share of steps", tickformat=".0%")
    return fig


def speedup_by_k_figure(sweep: Sweep | None, recommendation: Mapping[str, Recommendation]) -> go.Figure:
    """Estimated speedup vs K per class, the recommended K of each class marked with a star.

    Dotted points are truncation estimates (tau(K) read off a run at a larger K); the dashed line at
    1x is plain decoding: below it speculation costs time.
    """
    title = "Estimated speedup vs K (star = recommended K)"
    named = (
        []
        if sweep is None
        else [(cls, sweep.by_class[cls]) for cls in sorted(sweep.by_class)] + [(OVERALL, sweep.overall)]
    )
    rows_by_name = {name: rows for name, rows in named if rows}
    if not rows_by_name:
        return _empty(title, "This run has no K sweep (run `dflash-doctor sweep`).")
    colors = class_colors(rows_by_name)
    fig = go.Figure(layout=dict(title=title, **_LAYOUT))
    for name, rows in rows_by_name.items():
        rows = sorted(rows, key=lambda r: r.k)
        fig.add_trace(
            go.Scatter(
                x=[r.k for r in rows],
                y=_none_to_nan([r.speedup for r in rows]),
                mode="lines+markers",
                name=name,
                legendgroup=name,
                line=dict(color=colors[name]),
                marker=dict(symbol=["circle" if r.estimate == "exact" else "circle-open" for r in rows]),
                error_y=_interval_bars([r.speedup for r in rows], [r.speedup_ci for r in rows]),
                customdata=[[r.mean_acceptance_length, r.estimate] for r in rows],
                hovertemplate=(
                    f"{name} K=%{{x}}: %{{y:.2f}}x, tau %{{customdata[0]:.2f}} (%{{customdata[1]}})<extra></extra>"
                ),
            )
        )
        rec = recommendation.get(name)  # a class may have sweep rows and no recommendation
        chosen = next((r for r in rows if rec and r.k == rec.k), None)
        if chosen is not None:
            fig.add_trace(
                go.Scatter(
                    x=[chosen.k],
                    y=[chosen.speedup],
                    mode="markers",
                    marker=dict(symbol="star", size=16, color=colors[name], line=dict(width=1, color="black")),
                    name=f"{name}: K={chosen.k}",
                    legendgroup=name,
                    showlegend=False,
                    hovertemplate=f"{name}: recommended K=%{{x}} (%{{y:.2f}}x)<extra></extra>",
                )
            )
    fig.add_hline(y=1.0, line_dash="dash", line_color="grey")
    fig.update_xaxes(title="K (draft tokens per step)", dtick=1)
    fig.update_yaxes(title="speedup over plain decoding (x)", rangemode="tozero")
    return fig


def _interval_bars(points: list[float | None], intervals: list[list[float | None]]) -> dict:
    """Plotly asymmetric error bars from 95% intervals (none where a point or its interval is unknown): the
    speedup's interval carries the timing's noise, and the advice is read from it."""

    def gap(point: float | None, bound: float | None) -> float:
        return float("nan") if point is None or bound is None else abs(bound - point)

    return dict(
        type="data",
        symmetric=False,
        array=[gap(p, ci[1]) for p, ci in zip(points, intervals)],
        arrayminus=[gap(p, ci[0]) for p, ci in zip(points, intervals)],
        thickness=1,
    )


def acceptance_along_output_figure(steps: pd.DataFrame, *, bin_size_tokens: int = 32) -> go.Figure:
    """Mean accepted draft tokens per step vs where the step sits in the output, per class.

    Acceptance that falls as the output grows points at long-context drift (position encoding,
    sliding windows, a draft trained on short sequences) rather than at the prompt format.
    """
    title = f"Accepted tokens per step along the output (bins of {bin_size_tokens} tokens)"
    if steps.empty:
        return _empty(title, "No drafted steps in this run.")
    frame = steps.assign(position_bin=(steps["position"] // bin_size_tokens) * bin_size_tokens)
    colors = class_colors(frame["class"].unique())
    fig = go.Figure(layout=dict(title=title, **_LAYOUT))
    for name, group in [(c, frame[frame["class"] == c]) for c in sorted(frame["class"].unique())] + [(OVERALL, frame)]:
        by_bin = group.groupby("position_bin")["num_accepted"].agg(["mean", "size"]).reset_index()
        fig.add_trace(
            go.Scatter(
                x=by_bin["position_bin"],
                y=by_bin["mean"],
                customdata=by_bin["size"],
                mode="lines+markers",
                name=name,
                line=dict(color=colors[name]),
                hovertemplate=(
                    f"{name} from token %{{x}}: %{{y:.2f}} accepted/step (%{{customdata}} steps)<extra></extra>"
                ),
            )
        )
    fig.update_xaxes(title="output position of the step (tokens)")
    fig.update_yaxes(title="accepted draft tokens per step", rangemode="tozero")
    return fig


def compare_tau_figure(rows: Sequence[Mapping[str, Any]]) -> go.Figure:
    """BASE vs NEW tau per class with intervals, from :func:`dflash_doctor.report.comparison.compare_runs` rows."""
    title = "tau per class: BASE vs NEW (95% CI)"
    tau_rows = [
        r for r in rows if r["metric"] == "mean_acceptance_length" and r["base"] is not None and r["new"] is not None
    ]
    if not tau_rows:
        return _empty(title, "No class has drafted steps in both runs.")
    fig = go.Figure(layout=dict(title=title, barmode="group", **_LAYOUT))
    for side, color in (("base", "#9e9e9e"), ("new", "#1f77b4")):
        values = [r[side] for r in tau_rows]
        fig.add_trace(
            go.Bar(
                x=[r["class"] for r in tau_rows],
                y=values,
                name=side.upper(),
                marker_color=color,
                error_y=dict(
                    type="data",
                    symmetric=False,
                    array=[r[f"{side}_ci"][1] - v for r, v in zip(tau_rows, values)],
                    arrayminus=[v - r[f"{side}_ci"][0] for r, v in zip(tau_rows, values)],
                ),
                hovertemplate=f"{side.upper()} %{{x}}: tau %{{y:.2f}}<extra></extra>",
            )
        )
    fig.update_yaxes(title="tau (tokens per step)", rangemode="tozero")
    return fig


def compare_rates_figure(rows: Sequence[Mapping[str, Any]]) -> go.Figure:
    """NEW - BASE per-slot acceptance rate per class, with the bootstrap interval of the difference."""
    title = "Change in acceptance rate r_i per draft slot (NEW - BASE, 95% CI)"
    rate_rows = [r for r in rows if r["metric"] == "acceptance_rate_per_pos" and r["delta"] is not None]
    if not rate_rows:
        return _empty(title, "No class has drafted steps in both runs.")
    names = list(dict.fromkeys(r["class"] for r in rate_rows))
    colors = class_colors(names)
    fig = go.Figure(layout=dict(title=title, **_LAYOUT))
    for name in names:
        mine = sorted((r for r in rate_rows if r["class"] == name), key=lambda r: r["slot"])
        deltas = [r["delta"] for r in mine]
        fig.add_trace(
            go.Scatter(
                x=[r["slot"] for r in mine],
                y=deltas,
                mode="lines+markers",
                name=name,
                line=dict(color=colors[name]),
                marker=dict(
                    symbol=["x" if r["regression"] else "circle" for r in mine],
                    size=[12 if r["regression"] else 7 for r in mine],
                ),
                error_y=dict(
                    type="data",
                    symmetric=False,
                    array=[r["delta_ci"][1] - d for r, d in zip(mine, deltas)],
                    arrayminus=[d - r["delta_ci"][0] for r, d in zip(mine, deltas)],
                ),
                hovertemplate=f"{name} slot %{{x}}: %{{y:+.3f}}<extra></extra>",
            )
        )
    fig.add_hline(y=0.0, line_color="grey")
    fig.update_xaxes(title="draft slot (x = flagged regression)", dtick=1)
    fig.update_yaxes(title="NEW - BASE acceptance rate")
    return fig


def _deviation_series(analysis: DeviationAnalysis) -> list[tuple[str, SliceAnalysis]]:
    """(name, slice) for every class of a deviation analysis, then overall; slices with no drafts left out."""
    by_class = analysis.by_class
    items = [(cls, by_class[cls]) for cls in sorted(by_class)] + [(OVERALL, analysis.overall)]
    return [(name, s) for name, s in items if s.num_drafts]


def category_acceptance_figure(analysis: DeviationAnalysis) -> go.Figure:
    """Acceptance (accepted / decided) by category of the target token, one bar group per class.

    ``analysis`` is :func:`dflash_doctor.stats.deviations.analyze`'s output; hover shows each category's
    share of the lost tokens, which is what ranks a category's importance.
    """
    title = "Acceptance by target-token category (accepted / decided drafted tokens)"
    series = _deviation_series(analysis)
    if not series:
        return _empty(title, "No drafted tokens in this run.")
    colors = class_colors(name for name, _ in series)
    fig = go.Figure(
        layout=dict(
            title=title, barmode="group", yaxis=dict(title="acceptance", range=[0, 1.05], tickformat=".0%"), **_LAYOUT
        )
    )
    for name, data in series:
        rows = data.categories
        fig.add_trace(
            go.Bar(
                name=name,
                marker_color=colors[name],
                x=[r.category for r in rows],
                y=[r.acceptance_rate for r in rows],
                customdata=[[r.num_decided, r.share_of_lost or 0.0] for r in rows],
                hovertemplate=(
                    "%{x}: %{y:.1%} accepted of %{customdata[0]} decided; "
                    "%{customdata[1]:.0%} of lost tokens<extra>" + name + "</extra>"
                ),
            )
        )
    return fig


DEVIATION_AXES = {
    "by_context_length": "context length (prompt + output tokens before the token)",
    "by_output_position": "output position of the drafted token",
    "by_turn": "turn index (0 = first turn)",
}


def _bins(data: SliceAnalysis, key: str) -> list[BinRow]:
    return getattr(data, key)


def acceptance_along_figure(analysis: DeviationAnalysis, key: str) -> go.Figure:
    """Acceptance (accepted / decided) per bin of ``key`` (a :data:`DEVIATION_AXES` name: a field of
    :class:`SliceAnalysis`), one line per class."""
    title = f"Acceptance by {DEVIATION_AXES[key]}"
    series = [(name, data) for name, data in _deviation_series(analysis) if _bins(data, key)]
    if not series:
        return _empty(title, "No drafted tokens in this run.")
    colors = class_colors(name for name, _ in series)
    labels = {r.bin for _, data in series for r in _bins(data, key)}
    order = sorted(
        labels, key=lambda label: int("".join(c for c in label.split("-")[0] if c.isdigit()) or 0)
    )  # by lower edge
    fig = go.Figure(
        layout=dict(
            title=title,
            xaxis=dict(title=DEVIATION_AXES[key], type="category", categoryorder="array", categoryarray=order),
            yaxis=dict(title="acceptance", range=[0, 1.05], tickformat=".0%"),
            **_LAYOUT,
        )
    )
    for name, data in series:
        rows = _bins(data, key)
        fig.add_trace(
            go.Scatter(
                name=name,
                mode="lines+markers",
                line=dict(color=colors[name], width=3 if name == OVERALL else 2),
                x=[r.bin for r in rows],
                y=[r.acceptance_rate for r in rows],
                customdata=[r.num_decided for r in rows],
                hovertemplate="%{x}: %{y:.1%} of %{customdata} decided tokens<extra>" + name + "</extra>",
            )
        )
    return fig
