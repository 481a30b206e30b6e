"""The Streamlit dashboard: pages that read run directories (no model is loaded).

Kept import-light (no Streamlit import here) because the CLI imports it on every command.
"""

# `dflash-doctor dashboard` passes the folder of runs to the Streamlit process in this variable.
RUNS_DIR_ENV = "DFLASH_DOCTOR_RUNS_DIR"
