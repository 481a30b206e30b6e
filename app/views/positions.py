"""Positions: acceptance per draft slot per class. The unconditional rate r_i is what tau is made of;
the conditional rate a_i shows the slot where the draft starts to lose; acceptance along the output
separates long-context drift from a bad prompt format."""

import streamlit as st

from dflash_doctor.report import figures
from dflash_doctor.report.sanitize import for_markdown_text
from dflash_doctor.app import data, ui
from dflash_doctor.rundir.run_record import Summary

run = ui.current_run(("steps",))
ui.run_header(run, "Positions")
summary = run.record.summary
table = data.position_table(summary)
if table.empty:
    st.info("This run has no per-slot acceptance (no drafted steps were recorded).")
    st.stop()

groups = list(dict.fromkeys(table["class"]))
shown = st.multiselect("Classes", groups, default=groups, key="positions_classes")
if not shown:
    st.warning("Pick at least one class to draw.")
    st.stop()
subset = Summary(
    overall=summary.overall if "overall" in shown else None,
    by_class={cls: metrics for cls, metrics in summary.by_class.items() if cls in shown},
)
left, right = st.columns(2)
left.plotly_chart(figures.acceptance_by_position_figure(subset), key="positions_unconditional")
right.plotly_chart(figures.acceptance_by_position_figure(subset, conditional=True), key="positions_conditional")

chosen = table[table["class"].isin(shown)]
weakest = data.weakest_slots(chosen)
st.caption(
    "Weakest slot (lowest conditional acceptance among slots "
    f"reached by at least {data.MIN_SLOT_REACH:.0%} of drafts): "
    + ", ".join(
        f"**{for_markdown_text(row['class'])}** slot {int(row['slot'])} ({row['conditional']:.0%})"
        for _, row in weakest.iterrows()
    )
)
shown_classes = [c for c in shown if c != "overall"]
shown_steps = run.steps[run.steps["class"].isin(shown_classes)] if shown_classes else run.steps
st.plotly_chart(figures.acceptance_along_output_figure(shown_steps), key="positions_along_output")

st.subheader("Per-slot rates")
metric = st.segmented_control(
    "Rate", ["unconditional", "conditional"], default="unconditional", key="positions_metric", required=True
)
pivot = chosen.pivot(index="slot", columns="class", values=metric)[[c for c in shown if c in set(chosen["class"])]]
st.dataframe(pivot, column_config={c: st.column_config.NumberColumn(c, format="percent") for c in pivot.columns})
