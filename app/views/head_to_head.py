"""Head-to-head page: several speculators on the same prompts and target (`check --draft A --draft B`,
head_to_head.json) - the decision page head_to_head.html is, live: the verdict per class with the setting to
type in each engine, the table the terminal and the reports print (tau and the priced speedup at each one's
best K, with intervals), the per-position acceptance curves side by side, the step costs with their spread,
and each sub-run's checks, report, command, date and machine. Head-to-heads sit beside the other runs under
the dashboard's folder; each speculator's own run is in a sub-folder and opens in the sidebar like any run.

Every string of head_to_head.json comes from a file on disk: Markdown gets it through ``for_markdown_text``,
settings and commands go through ``st.code`` (shown as text, never rendered)."""

import pandas as pd
import streamlit as st

from dflash_doctor.app import ui
from dflash_doctor.errors import UsageError
from dflash_doctor.report import figures
from dflash_doctor.report.head_to_head import (
    HEADERS,
    cost_lines,
    settings_heading,
    settings_lines,
    shown_draft,
    sub_run_rows,
    table_rows,
)
from dflash_doctor.report.sanitize import for_markdown_text
from dflash_doctor.stats.head_to_head import read_head_to_head

st.title("Head-to-head: which speculator to deploy")
found = ui.discovered_head_to_heads(str(ui.runs_dir()))
if not found:
    st.info(
        f"No head-to-head under `{ui.runs_dir()}`. Write one with `dflash-doctor check --draft A --draft ngram "
        f"--out {ui.runs_dir()}/h2h ...` (docs/speculators.md)."
    )
    st.stop()
picked = st.selectbox("Head-to-head", found)
try:
    result = read_head_to_head(picked)
except UsageError as exc:
    st.error(for_markdown_text(exc.message))
    st.stop()
runs = sub_run_rows(result)
st.caption(
    for_markdown_text("Speculators: " + ", ".join(f"{s.name} ({s.kind}, {shown_draft(s)})" for s in result.speculators))
)
if runs:
    st.caption(
        for_markdown_text(f"{runs[0]['created_at']} · {runs[0]['machine']} · dflash-doctor {runs[0]['tool_version']}")
    )

st.header("Verdict")
for scope_result in result.scopes.values():
    verdict = scope_result.verdict
    st.markdown(f"- {for_markdown_text(verdict.text)}")
    if settings_lines(verdict):
        st.caption(for_markdown_text(settings_heading(verdict)))
        st.code("\n".join(f"{engine}: {setting}" for engine, setting in settings_lines(verdict)), language=None)
st.header("Table")
st.caption(
    "The verdict's pick is marked *; speedups priced at each speculator's best K, intervals paired over requests."
)
st.dataframe(pd.DataFrame(table_rows(result), columns=list(HEADERS)), hide_index=True)

st.header("Per-position acceptance")
scope = (
    st.selectbox("Scope", list(result.scopes)) or "overall"
)  # None only for an empty list, which a head-to-head never has
st.plotly_chart(figures.head_to_head_positions_figure(scope, result.scopes[scope].rows), key="head_to_head_positions")

st.header("Step costs")
st.code("\n".join(cost_lines(result)), language=None)

if runs:
    st.header("Sub-runs")
    st.caption(
        "Each speculator's own check: its verdict, what warned or failed, and its folder (open it in the sidebar)."
    )
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "speculator": r["name"],
                    "verdict": r["verdict"],
                    "warnings and failures": r["flagged"],
                    "report": r["report"],
                    "date": r["created_at"],
                    "machine": r["machine"],
                    "tool": r["tool_version"],
                }
                for r in runs
            ]
        ),
        hide_index=True,
    )
    st.caption("Commands (paths relative to the head-to-head folder):")
    st.code("\n".join(f"{r['command']}   # {r['name']}" for r in runs), language=None)
