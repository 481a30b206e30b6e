"""Figures of a watch's time series (windows.parquet): tau with its interval band, the baseline, alert markers.

Pure builders like :mod:`dflash_doctor.report.figures` (same layout and class colours); an empty input gives a
figure that says why it is empty.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from dflash_doctor.report.figures import _LAYOUT, _empty, class_colors


def series_name(row: pd.Series | dict) -> str:
    return row["model"] if row["class"] == "all" else f"{row['model']} [{row['class']}]"


def _times(values: pd.Series) -> list[_dt.datetime]:
    return [_dt.datetime.fromtimestamp(v, _dt.timezone.utc) for v in values]


def _any_alert(kinds: Any) -> bool:
    """A window's ``alerts`` cell (a list of alert kinds, or None for a window read before alerts existed)."""
    return kinds is not None and len(kinds) > 0


def tau_timeline_figure(windows: pd.DataFrame) -> go.Figure:
    """tau per window and series, its 95% band, the baseline (dashed) and a red marker where an alert fired."""
    title = "Mean acceptance length per window (tau, bonus included; band = 95% interval)"
    if windows.empty or windows["mean_acceptance_length"].isna().all():
        return _empty(title, "No window with drafts yet.")
    frame = windows.assign(series=[series_name(r) for r in windows.to_dict("records")], time=_times(windows["end_s"]))
    colors = class_colors(sorted(frame["series"].unique()))
    fig = go.Figure(layout=dict(title=title, **_LAYOUT))
    for key, rows in frame.groupby("series", sort=True):
        name = str(key)
        rows = rows.sort_values("end_s")
        color = colors[name]
        band = rows.dropna(subset=["mean_acceptance_length_lo", "mean_acceptance_length_hi"])
        if not band.empty:
            fig.add_trace(
                go.Scatter(
                    x=list(band["time"]) + list(band["time"])[::-1],
                    y=list(band["mean_acceptance_length_hi"]) + list(band["mean_acceptance_length_lo"])[::-1],
                    fill="toself",
                    line=dict(width=0),
                    fillcolor=color,
                    opacity=0.15,
                    hoverinfo="skip",
                    showlegend=False,
                )
            )
        fig.add_trace(
            go.Scatter(
                x=rows["time"],
                y=rows["mean_acceptance_length"],
                mode="lines+markers",
                name=name,
                line=dict(color=color),
                hovertemplate="%{x}<br>tau %{y:.2f}<extra>" + name + "</extra>",
            )
        )
        if rows["baseline_tau"].notna().any():
            fig.add_trace(
                go.Scatter(
                    x=rows["time"],
                    y=rows["baseline_tau"],
                    mode="lines",
                    name=f"{name} baseline",
                    line=dict(color=color, dash="dash"),
                )
            )
        alerted = rows[rows["alerts"].map(_any_alert)]
        if not alerted.empty:
            fig.add_trace(
                go.Scatter(
                    x=alerted["time"],
                    y=alerted["mean_acceptance_length"].fillna(1.0),
                    mode="markers",
                    name=f"{name} alert",
                    marker=dict(symbol="x", size=12, color="#d62728"),
                    customdata=[", ".join(kinds) for kinds in alerted["alerts"]],
                    hovertemplate="%{x}<br>ALERT: %{customdata}<extra></extra>",
                )
            )
    fig.update_yaxes(title="tau (tokens per step)")
    return fig


def speedup_timeline_figure(windows: pd.DataFrame, floor: float = 1.0) -> go.Figure:
    """Net speedup per window and series against the fallback floor (needs step costs)."""
    title = "Net speedup per window (below the floor: fall back)"
    if windows.empty or windows["speedup"].isna().all():
        return _empty(title, "No step costs: pass --cost-profile or a baseline run with a sweep to price windows.")
    frame = windows.dropna(subset=["speedup"]).assign(series=lambda f: [series_name(r) for r in f.to_dict("records")])
    frame = frame.assign(time=_times(frame["end_s"]))
    colors = class_colors(sorted(frame["series"].unique()))
    fig = go.Figure(layout=dict(title=title, **_LAYOUT))
    for key, rows in frame.groupby("series", sort=True):
        name = str(key)
        fig.add_trace(
            go.Scatter(
                x=rows["time"], y=rows["speedup"], mode="lines+markers", name=name, line=dict(color=colors[name])
            )
        )
    fig.add_hline(y=floor, line=dict(color="#d62728", dash="dot"), annotation_text=f"floor {floor:g}x")
    fig.update_yaxes(title="speedup vs plain decoding", tickformat=".2f")
    return fig
