"""Sweep: estimated speedup against K per class, the recommended K, and the step costs the estimate
rests on. tau alone does not pick K: verification cost grows with K, so the page shows speedup."""

import streamlit as st

from dflash_doctor.report import figures
from dflash_doctor.app import data, ui
from dflash_doctor.report.sanitize import for_markdown_text

run = ui.current_run()
ui.run_header(run, "Sweep")
sweep = run.record.summary.sweep
recommendation = run.record.recommendation
if sweep is None:
    st.info(
        "This run has no K sweep, so there is no speedup curve or recommended K. "
        "Run `dflash-doctor sweep --k 1-15` (same model and workload flags) to measure tau and net speedup for every K."
    )
    st.stop()

st.plotly_chart(figures.speedup_by_k_figure(sweep, recommendation), key="sweep_speedup")
if recommendation:
    st.subheader("Recommended K per class")
    rec = data.recommendation_table(recommendation)
    st.dataframe(
        rec,
        hide_index=True,
        column_config={
            "k": "K",
            "conservative_k": "conservative K",
            "speedup": st.column_config.NumberColumn(format="%.2fx"),
            "reason": st.column_config.TextColumn(width="large"),
        },
    )
    off = rec[rec["k"] == 0]["class"].tolist()
    if off:
        st.warning(
            f"Speculation off recommended for: {for_markdown_text(', '.join(off))} (no K beats plain decoding there)."
        )

table = data.sweep_table(sweep)
st.subheader("Speedup by K")
pivot = table.pivot(index="k", columns="class", values="speedup")
st.dataframe(pivot, column_config={c: st.column_config.NumberColumn(c, format="%.2fx") for c in pivot.columns})
if (table["estimate"] == "truncated").any():
    st.caption(
        "Some rows are truncation estimates: tau(K) read off a run at a larger K. Exact for autoregressive drafts; "
        "for DFlash a shorter block changes the draft's own predictions, so re-run at that K to confirm."
    )

costs = sweep.step_costs()
st.subheader("Step costs behind the estimate")
st.caption(
    f"Source: **{for_markdown_text(costs.source)}** on **{for_markdown_text(costs.device)}**; plain decode step "
    f"{1000 * costs.t_decode_s:.1f} ms. speedup(K) = tau(K) x t_decode / (t_draft(K) + t_verify(K))."
)
cost_table = data.step_cost_table(sweep)
st.dataframe(cost_table, column_config={c: st.column_config.NumberColumn(c, format="%.1f") for c in cost_table.columns})
