"""Head-to-head page: several speculators on the same prompts and target (`check --draft A --draft B`,
head_to_head.json) - the verdict per class, the table the terminal and the reports print (tau and the priced
speedup at each one's best K, with intervals), and the per-position acceptance curves side by side.
Head-to-heads sit beside the other runs under the dashboard's folder; each speculator's own run is in a
sub-folder and opens in the sidebar like any run."""

import json
from pathlib import Path

import pandas as pd
import streamlit as st

from dflash_doctor.app import ui
from dflash_doctor.report import figures
from dflash_doctor.report.head_to_head import HEADERS, table_rows, verdicts
from dflash_doctor.report.sanitize import for_markdown_text
from dflash_doctor.rundir.tables import HEAD_TO_HEAD_JSON

st.title("Head-to-head: which speculator to deploy")
found = ui.discovered_head_to_heads(str(ui.runs_dir()))
if not found:
    st.info(f"No head-to-head under `{ui.runs_dir()}`. Write one with `dflash-doctor check --draft A --draft ngram "
            f"--out {ui.runs_dir()}/h2h ...` (docs/speculators.md).")
    st.stop()
picked = st.selectbox("Head-to-head", found)
result = json.loads((Path(picked) / HEAD_TO_HEAD_JSON).read_text(encoding="utf-8"))
# names and drafts come from a file on disk: escaped for Markdown
st.caption(for_markdown_text("Speculators: " + ", ".join(f"{s['name']} ({s['kind']}, {s['draft']})" for s in result["speculators"])))

st.header("Verdict")
for text in verdicts(result):
    st.markdown(f"- {for_markdown_text(text)}")
st.header("Table")
st.caption("The verdict's pick is marked *; speedups priced at each speculator's best K, intervals paired over requests.")
st.dataframe(pd.DataFrame(table_rows(result), columns=list(HEADERS)), hide_index=True)

st.header("Per-position acceptance")
scope = st.selectbox("Scope", list(result["scopes"])) or "overall"  # None only for an empty list, which a head-to-head never has
st.plotly_chart(figures.head_to_head_positions_figure(scope, result["scopes"][scope]["rows"]), key="head_to_head_positions")
