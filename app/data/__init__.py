"""The dashboard's data layer: finding runs, accepting uploads, and turning run tables into small frames.

Everything here is plain pandas/numpy with no Streamlit import, so it is tested without a browser and
the pages stay thin. Run directories are read only through :func:`dflash_doctor.rundir.load.load_run`; the
functions below aggregate (per class, per slot, per request page) so that a page never ships more than
a few hundred rows to the browser, even on a run with 100k drafted tokens.

The package, by job: :mod:`.runs` (finding runs, uploads), :mod:`.frames` (the pages' frames) and
:mod:`.tokens` (the token view). Pages import the names below from here (``from dflash_doctor.app import data``).
"""

from dflash_doctor.app.data.runs import MAX_RUN_SEARCH_DEPTH, MAX_UPLOAD_INFLATED_BYTES, RUN_FILE_NAMES, find_head_to_heads, find_runs, find_tune_runs, run_mtime_ns, save_upload
from dflash_doctor.app.data.frames import CLASS_TABLE_COLUMNS, COMPARISON_FORMATS, MIN_SLOT_REACH, POSITION_COLUMNS, PROMPT_LENGTH_EDGES, SWEEP_COLUMNS, bootstrap_ratio_ci, changed_facts, checks_table, class_requests, class_table, comparison_table, facts_table, filter_requests, filtered_summary, highlight_regressions, position_table, prompt_length_bucket, recommendation_table, run_facts, run_verdict, step_cost_table, sweep_table, weakest_slots, with_length_bucket
from dflash_doctor.app.data.tokens import CHIP_CSS, STEPS_PER_TOKEN_PAGE, TokenChip, candidates_table, chips_html, num_pages, page_of_steps, request_chips, slot_status, token_label, token_vocabulary, visible_token_text

__all__ = [
    "MAX_RUN_SEARCH_DEPTH",
    "MAX_UPLOAD_INFLATED_BYTES",
    "RUN_FILE_NAMES",
    "find_head_to_heads",
    "find_runs",
    "find_tune_runs",
    "run_mtime_ns",
    "save_upload",
    "CLASS_TABLE_COLUMNS",
    "COMPARISON_FORMATS",
    "MIN_SLOT_REACH",
    "POSITION_COLUMNS",
    "PROMPT_LENGTH_EDGES",
    "SWEEP_COLUMNS",
    "bootstrap_ratio_ci",
    "changed_facts",
    "checks_table",
    "class_requests",
    "class_table",
    "comparison_table",
    "facts_table",
    "filter_requests",
    "filtered_summary",
    "highlight_regressions",
    "position_table",
    "prompt_length_bucket",
    "recommendation_table",
    "run_facts",
    "run_verdict",
    "step_cost_table",
    "sweep_table",
    "weakest_slots",
    "with_length_bucket",
    "CHIP_CSS",
    "STEPS_PER_TOKEN_PAGE",
    "TokenChip",
    "candidates_table",
    "chips_html",
    "num_pages",
    "page_of_steps",
    "request_chips",
    "slot_status",
    "token_label",
    "token_vocabulary",
    "visible_token_text",
]
