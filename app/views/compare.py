"""Compare: the open run (NEW) against another (BASE), per class: tau and per-slot rates side by side
with intervals, regressions highlighted (same rule as `dflash-doctor compare`), and which model or
environment facts changed between the two."""

import streamlit as st

from dflash_doctor.report import figures
from dflash_doctor.stats import gate
from dflash_doctor.report.sanitize import for_markdown_text
from dflash_doctor.app import data, ui

new_run = ui.current_run()
ui.run_header(new_run, "Compare")
others = [path for path in ui.available_runs() if path != str(new_run.path)]
if not others:
    st.info(
        "Comparing needs a second run: start the dashboard on a folder "
        "holding two runs, or upload another run in the sidebar."
    )
    st.stop()

controls = st.columns([3, 1, 1])
base_path = controls[0].selectbox(
    "BASE run (the open run is NEW)", others, format_func=ui.run_label, key="compare_base"
)
threshold_tau = controls[1].number_input(
    "tau drop threshold", min_value=0.0, value=gate.DEFAULT_THRESHOLD_TAU, step=0.05, key="compare_threshold_tau"
)
threshold_rate = controls[2].number_input(
    "rate drop threshold",
    min_value=0.0,
    max_value=1.0,
    value=gate.DEFAULT_THRESHOLD_RATE,
    step=0.01,
    key="compare_threshold_rate",
)

result = ui.comparison(
    base_path,
    data.run_mtime_ns(base_path),
    str(new_run.path),
    data.run_mtime_ns(new_run.path),
    threshold_tau,
    threshold_rate,
)
for note in result.notes:
    st.caption(for_markdown_text(note))
if not result.rows:
    st.stop()

regressions = sorted((row for row in result.rows if row.regression), key=lambda row: row.slot is not None)  # tau first
if all(row.delta is None for row in result.rows):
    st.warning("No class has drafted steps in both runs, so nothing could be compared; see the notes in the tables.")
elif regressions:
    st.error(
        f"**{len(regressions)} regression(s)** at K={result.k_compared}: "
        + "; ".join(
            f"{for_markdown_text(row.cls)} {for_markdown_text(row.label)} {row.base:.3f} → {row.new:.3f}"
            for row in regressions[:8]
        ),
        icon=ui.STATUS_ICONS["fail"],
    )
else:
    st.success(
        f"No regression at K={result.k_compared}: no class dropped "
        "by more than the thresholds with separated intervals.",
        icon=ui.STATUS_ICONS["pass"],
    )

rows = [row.as_dict() for row in result.rows]
st.plotly_chart(figures.compare_tau_figure(rows), key="compare_tau")

table = data.comparison_table(rows)
st.subheader("tau per class")
tau_table = table[table["metric"] == "tau"].drop(columns="metric")
st.dataframe(
    tau_table.style.apply(data.highlight_regressions, axis=1).format(data.COMPARISON_FORMATS, na_rep="—"),
    hide_index=True,
)
st.subheader("Per-slot acceptance r_i")
slot_table = table[table["metric"] != "tau"]
st.dataframe(
    slot_table.style.apply(data.highlight_regressions, axis=1).format(data.COMPARISON_FORMATS, na_rep="—"),
    hide_index=True,
    height=320,
)

st.subheader("What changed between the runs")
changed = data.changed_facts(ui.load(base_path).record, new_run.record)
if changed.empty:
    st.caption("Models, environment and configuration are identical: the difference comes from the data or chance.")
else:
    st.dataframe(changed, hide_index=True)
