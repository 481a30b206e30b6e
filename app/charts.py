"""Dashboard-only plotly figures; the shared ones (tau per class, per-slot curves, histogram, speedup
vs K, BASE vs NEW) come from :mod:`dflash_doctor.report.figures` so the report and the dashboard agree.

Same conventions as there: pure builders, a class keeps its colour (``figures.class_colors``), an
empty input gives a figure that says why it is empty.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dflash_doctor.report.figures import _LAYOUT, _empty, class_colors

TOKEN_STATUS_COLORS = {"accepted": "#2ca02c", "rejected": "#d62728", "unused": "#b0b0b0"}


def rejection_rate_figure(table: pd.DataFrame) -> go.Figure:
    """Draft-token rejection rate per class with its 95% CI (rows of ``data.class_table``)."""
    title = "Rejected share of drafted tokens per class (95% CI)"
    if table.empty:
        return _empty(title, "No drafted tokens in this selection.")
    colors = class_colors(table["class"])
    fig = go.Figure(
        go.Bar(
            x=table["class"],
            y=table["rejection_rate"],
            marker_color=[colors[c] for c in table["class"]],
            error_y=dict(
                type="data",
                symmetric=False,
                array=table["rejection_rate_hi"] - table["rejection_rate"],
                arrayminus=table["rejection_rate"] - table["rejection_rate_lo"],
            ),
            customdata=table[["rejection_rate_lo", "rejection_rate_hi", "num_draft_tokens"]].to_numpy(),
            hovertemplate=(
                "%{x}: %{y:.1%} rejected [%{customdata[0]:.1%}, "
                "%{customdata[1]:.1%}]<br>%{customdata[2]:,} drafted tokens<extra></extra>"
            ),
        ),
        layout=dict(title=title, **_LAYOUT),
    )
    fig.update_yaxes(title="rejected / drafted tokens", tickformat=".0%", range=[0, 1])
    return fig


def request_tau_figure(requests: pd.DataFrame) -> go.Figure:
    """Per-request tau per class as box plots with every request a point (click one to open it).

    Pooled tau hides whether a class is uniformly mediocre or a few requests collapse; the spread
    tells which (vLLM #42690: per-request mean and pooled ratio differ).
    """
    title = "tau per request (each point is a request)"
    drafted = requests[requests["num_drafts"] > 0]
    if drafted.empty:
        return _empty(title, "No drafted requests in this selection.")
    colors = class_colors(drafted["class"])
    fig = go.Figure(layout=dict(title=title, **_LAYOUT))
    for cls in sorted(drafted["class"].unique()):
        group = drafted[drafted["class"] == cls]
        fig.add_trace(
            go.Box(
                y=group["tau"],
                name=cls,
                marker_color=colors[cls],
                boxpoints="all",
                jitter=0.4,
                pointpos=0,
                customdata=group[["request_id"]].to_numpy(),
                hovertemplate="%{customdata[0]}: tau %{y:.2f}<extra></extra>",
            )
        )
    fig.update_layout(showlegend=False)
    fig.update_yaxes(title="tau (tokens per step)", rangemode="tozero")
    return fig


def token_divergence_figure(tokens: pd.DataFrame, status: pd.Series) -> go.Figure:
    """KL(target || draft) of each drafted token along the output, coloured by what happened to it.

    Rejections with a small KL are near-ties (sampling noise); rejections with a large KL are places
    where the draft is confidently wrong, the ones worth reading in the text above.
    """
    title = "Divergence per drafted token: KL(target || draft)"
    if tokens.empty:
        return _empty(title, "This request has no drafted tokens.")
    fig = go.Figure(layout=dict(title=title, **_LAYOUT))
    for name, color in TOKEN_STATUS_COLORS.items():
        chosen = tokens[status == name]
        if chosen.empty:
            continue
        fig.add_trace(
            go.Scattergl(
                x=chosen["position"],
                y=chosen["kl_target_draft"],
                mode="markers",
                name=name,
                marker=dict(color=color, size=6 if name != "unused" else 4),
                customdata=chosen[["step", "offset", "target_prob_of_draft"]].to_numpy(),
                hovertemplate="position %{x} (step %{customdata[0]}, slot %{customdata[1]})<br>KL %{y:.3f}, "
                "p_target(draft) %{customdata[2]:.3f}<extra>" + name + "</extra>",
            )
        )
    fig.update_xaxes(title="output position (tokens)")
    fig.update_yaxes(title="KL(target || draft) (nats)", rangemode="tozero")
    return fig
