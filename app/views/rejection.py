"""Rejection by class: tau and rejection rate per request class with CIs, filters, and a drill-down
from a class to its requests (worst first) and from a request to its tokens."""

import streamlit as st

from dflash_doctor.report import figures
from dflash_doctor.app import charts, data, ui
from dflash_doctor.report.sanitize import for_markdown_text

run = ui.current_run(("requests",))
ui.run_header(run, "Rejection by class")
if not ui.has_requests(run):
    st.stop()

requests = data.with_length_bucket(run.requests)
filters = st.columns(3)
classes = filters[0].multiselect(
    "Class", sorted(requests["class"].unique()), key="filter_class", placeholder="all classes"
)
subclasses = filters[1].multiselect(
    "Subclass", sorted(requests["subclass"].dropna().unique()), key="filter_subclass", placeholder="all subclasses"
)
buckets = filters[2].multiselect(
    "Prompt length (tokens)",
    sorted(requests["length_bucket"].unique(), key=lambda b: int(b.lstrip("<>=").split("-")[0])),
    key="filter_length",
    placeholder="all lengths",
)
summary, table, chosen = ui.class_view(
    str(run.path), data.run_mtime_ns(run.path), tuple(classes), tuple(subclasses), tuple(buckets)
)
if table.empty:
    st.warning("No drafted request matches these filters; clear one of them.")
    st.stop()
if classes or subclasses or buckets:
    st.caption(f"Recomputed over the {len(chosen):,} requests that match the filters (same bootstrap as the report).")

left, right = st.columns(2)
tau_event = left.plotly_chart(
    figures.tau_by_class_figure(summary), key="tau_chart", on_select="rerun", selection_mode="points"
)
right.plotly_chart(charts.rejection_rate_figure(table), key="rejection_chart")

st.dataframe(
    table,
    hide_index=True,
    column_config={
        "num_requests": "requests",
        "num_drafts": "drafts",
        "num_draft_tokens": "drafted tokens",
        "num_accepted_tokens": "accepted tokens",
        "tau": st.column_config.NumberColumn("tau", format="%.2f", help="mean acceptance length, bonus included"),
        "tau_lo": st.column_config.NumberColumn("tau 95% lo", format="%.2f"),
        "tau_hi": st.column_config.NumberColumn("tau 95% hi", format="%.2f"),
        "rejection_rate": st.column_config.NumberColumn("rejected", format="percent"),
        "rejection_rate_lo": st.column_config.NumberColumn("rejected 95% lo", format="percent"),
        "rejection_rate_hi": st.column_config.NumberColumn("rejected 95% hi", format="percent"),
    },
)

st.header("Drill into a class")
drill_options = [c for c in table["class"] if c != "overall"]
picked = [point.get("x") for point in (tau_event.selection.points if tau_event else [])]
if picked and picked[0] in drill_options and picked[0] != st.session_state.get("last_tau_pick"):
    st.session_state["last_tau_pick"] = picked[0]  # a click on a bar picks its class once
    st.session_state["drill_class"] = picked[0]
if st.session_state.get("drill_class") not in drill_options:
    st.session_state["drill_class"] = drill_options[0]  # the table is sorted worst tau first
cls = st.selectbox("Class (or click its bar above)", drill_options, key="drill_class")
assert cls is not None, "drill_options is never empty: the table has a row per class"

st.plotly_chart(charts.request_tau_figure(chosen), key="request_tau_chart")
class_requests = data.class_requests(chosen, cls)
st.caption(
    f"{len(class_requests):,} requests of class **{for_markdown_text(cls)}**, "
    "lowest tau first. Select a row to open its tokens."
)
selection = st.dataframe(
    class_requests,
    hide_index=True,
    on_select="rerun",
    selection_mode="single-row",
    key="drill_table",
    column_config={
        "tau": st.column_config.NumberColumn(format="%.2f"),
        "acceptance_rate": st.column_config.NumberColumn("accepted", format="percent"),
    },
)
rows = selection.selection.rows if selection else []
request_id = class_requests["request_id"].iloc[rows[0]] if rows else class_requests["request_id"].iloc[0]
open_label = f"Open request {for_markdown_text(request_id)} in the token view"  # a button label is Markdown
if st.button(open_label, icon=":material/text_fields:", key="open_tokens"):
    st.session_state["token_class"] = cls
    st.session_state["token_request"] = request_id
    st.switch_page(ui.VIEWS / "tokens.py")
