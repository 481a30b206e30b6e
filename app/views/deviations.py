"""Deviations: why the draft is rejected across the whole run, per class (dflash_doctor.stats.deviations).

First rejections weighted by the drafted tokens they threw away, acceptance by category of the target
token, confident vs uncertain misses with the attainable-tau upper bound, and acceptance against context
length, output position and turn. Filters narrow it to classes and target-token categories; a pattern's
example opens in the Tokens page at its step.
"""

import dataclasses

import pandas as pd
import streamlit as st

from dflash_doctor.report import figures
from dflash_doctor.stats import deviations
from dflash_doctor.app import data, ui
from dflash_doctor.report.sanitize import for_markdown_text

run = ui.current_run(("requests",))
ui.run_header(run, "Deviations")
if not ui.has_requests(run):
    st.stop()
path, mtime_ns = str(run.path), data.run_mtime_ns(run.path)
tables = ui.deviation_tables(path, mtime_ns)
if tables.decided.empty:
    st.info(
        "This run recorded no drafted tokens (a replay written "
        "without token detail), so there are no rejection patterns."
    )
    st.stop()

filters = st.columns(2)
classes = filters[0].multiselect(
    "Class", deviations.class_names(tables), key="deviation_class", placeholder="all classes"
)
categories = filters[1].multiselect(
    "Target-token category",
    sorted(str(c) for c in tables.decided["category"].unique()),
    key="deviation_category",
    placeholder="all categories",
    help="\n".join(f"- **{name}**: {text}" for name, text in deviations.CATEGORIES.items()),
)
view = ui.deviation_view(path, mtime_ns, tuple(classes), tuple(categories))
selection = view.overall
definitions = view.definitions

facts = st.columns(4)
facts[0].metric(
    "tau",
    f"{selection.tau:.2f}" if selection.tau is not None else "n/a",
    help="mean acceptance length, bonus included (vLLM)",
)
facts[1].metric(
    "Attainable tau (upper bound)",
    f"{selection.attainable_tau:.2f}" if selection.attainable_tau is not None else "n/a",
    help=definitions.attainable_tau,
)
facts[2].metric(
    "Lost tokens at confident misses",
    f"{(selection.confident.share_of_lost or 0):.0%}",
    help=definitions.confident_miss,
)
facts[3].metric("Lost tokens", f"{selection.lost_tokens:,}", help=definitions.lost_tokens)
if categories:
    st.caption(
        "tau and the attainable bound cover the selected classes; "
        "the category filter narrows the patterns and charts below."
    )

st.subheader("Costliest first rejections")
pairs = pd.DataFrame(
    [
        {
            "target token": repr(p.target_text),
            "drafted instead": repr(p.draft_text),
            "category": p.category,
            "drafted category": p.draft_category,
            "times": p.count,
            "lost tokens": p.lost_tokens,
            "share of lost": p.share_of_lost,
            "confident": p.num_confident,
            "example": f"{p.example.request_id} step {p.example.step}",
            "context": p.example.context,
        }
        for p in selection.top_pairs
    ]
)
if pairs.empty:
    st.caption("No first rejection matches these filters.")
else:
    picked = st.dataframe(
        pairs,
        hide_index=True,
        on_select="rerun",
        selection_mode="single-row",
        key="deviation_pairs",
        column_config={"share of lost": st.column_config.NumberColumn(format="percent")},
    )
    rows = picked.selection.rows if picked else []
    example = selection.top_pairs[rows[0] if rows else 0].example
    open_label = f"Open {for_markdown_text(example.request_id)} at step {example.step} in the token view"  # Markdown
    if st.button(open_label, icon=":material/text_fields:", key="deviation_open"):
        st.session_state["token_class"] = "all classes"
        st.session_state["token_request"] = example.request_id
        st.session_state[f"token_page_{example.request_id}"] = example.step // data.STEPS_PER_TOKEN_PAGE + 1
        st.switch_page(ui.VIEWS / "tokens.py")

st.plotly_chart(figures.category_acceptance_figure(view), key="deviation_categories")
st.dataframe(
    pd.DataFrame([dataclasses.asdict(row) for row in selection.categories]),
    hide_index=True,
    column_config={
        "acceptance_rate": st.column_config.NumberColumn("accepted", format="percent"),
        "share_of_lost": st.column_config.NumberColumn("share of lost", format="percent"),
    },
)

st.subheader("Acceptance along the sequence")
along = st.columns(2)
along[0].plotly_chart(figures.acceptance_along_figure(view, "by_context_length"), key="deviation_context")
along[1].plotly_chart(figures.acceptance_along_figure(view, "by_output_position"), key="deviation_position")
if len(selection.by_turn) > 1:
    st.plotly_chart(figures.acceptance_along_figure(view, "by_turn"), key="deviation_turn")
