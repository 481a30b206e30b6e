"""Tune page: a `dflash-doctor tune` run (tune.json) - speedup vs K per class with intervals, latency vs
throughput per K and load, predicted vs measured, the measured grid and the recommended engine setting.
Tune runs sit beside the other runs under the dashboard's folder; they are picked here, not in the sidebar
(they hold a grid of server runs, not one run.json)."""

import pandas as pd
import streamlit as st

from dflash_doctor.report.sanitize import for_markdown_text
from dflash_doctor.app import ui
from dflash_doctor.errors import UsageError
from dflash_doctor.tune.result import read_tune_result
from dflash_doctor.tune.views import (
    MEASURED_COLUMNS,
    PREDICTION_COLUMNS,
    figures,
    fit_lines,
    grid_line,
    measured_rows,
    prediction_rows,
    recommendation_lines,
    warning_lines,
)

st.title("Tune: K on your engine")
found = ui.discovered_tune_runs(str(ui.runs_dir()))
if not found:
    st.info(
        f"No tune run under `{ui.runs_dir()}`. Write one with "
        f"`dflash-doctor tune --out {ui.runs_dir()}/tune ...` (docs/tune.md)."
    )
    st.stop()
picked = st.selectbox("Tune run", found)
try:
    result = read_tune_result(picked)
except UsageError as exc:
    st.error(for_markdown_text(exc.message))
    st.stop()
st.caption(for_markdown_text(grid_line(result)))

st.header("Recommendation")
for line in recommendation_lines(result):
    # tune.json is a file from disk (and its lines name the server's model): an engine setting is shown as a code
    # block, which Streamlit renders as text (a code span in Markdown ends at a blank line and its rest is live)
    if line.split(":")[0] in result.engine_settings:
        st.code(line, language=None)
    else:
        st.markdown(f"- {for_markdown_text(line)}")
for line in warning_lines(result):
    st.warning(for_markdown_text(line))
for i, (title, fig) in enumerate(figures(result)):
    st.subheader(for_markdown_text(title))
    st.plotly_chart(fig, key=f"tune_fig_{i}")
st.header("Measured")
st.dataframe(pd.DataFrame(measured_rows(result), columns=list(MEASURED_COLUMNS)), hide_index=True)
st.header("Predicted vs measured")
st.dataframe(pd.DataFrame(prediction_rows(result), columns=list(PREDICTION_COLUMNS)), hide_index=True)
for line in fit_lines(result):
    st.markdown(f"- {for_markdown_text(line)}")
