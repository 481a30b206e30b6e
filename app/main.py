"""Entry point of the dflash-doctor dashboard: ``streamlit run app/main.py`` (or `dflash-doctor dashboard`).

It only sets the page up, draws the sidebar (run picker, upload) and hands over to the page the user
picked; each page is a small script in ``views/`` that reads the open run through ``ui``.
"""

import streamlit as st

from dflash_doctor.app import ui

st.set_page_config(page_title="dflash-doctor", page_icon="🩺", layout="wide")

PAGES = [
    st.Page(ui.VIEWS / "overview.py", title="Overview", icon=":material/monitor_heart:", default=True),
    st.Page(ui.VIEWS / "rejection.py", title="Rejection by class", icon=":material/bar_chart:"),
    st.Page(ui.VIEWS / "positions.py", title="Positions", icon=":material/stacked_line_chart:"),
    st.Page(ui.VIEWS / "deviations.py", title="Deviations", icon=":material/troubleshoot:"),
    st.Page(ui.VIEWS / "tokens.py", title="Tokens", icon=":material/text_fields:"),
    st.Page(ui.VIEWS / "sweep.py", title="Sweep", icon=":material/speed:"),
    st.Page(ui.VIEWS / "compare.py", title="Compare", icon=":material/compare_arrows:"),
    st.Page(ui.VIEWS / "production.py", title="Production", icon=":material/sensors:"),
    st.Page(ui.VIEWS / "tune.py", title="Tune", icon=":material/tune:"),
    st.Page(ui.VIEWS / "head_to_head.py", title="Head-to-head", icon=":material/sports_score:"),
]

page = st.navigation(PAGES)
ui.sidebar()
page.run()
