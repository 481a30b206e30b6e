"""Streamlit glue shared by every page: which runs exist, which one is open, and cached reads of it.

Reads go through :func:`dflash_doctor.rundir.load.load_run`, cached keyed by the run's path and newest
file mtime, so a page switch costs no disk read and a rewritten run is noticed. Derived frames (class
tables, one request's tokens) are ``st.cache_data`` with the same key, so a widget change on a
100k-token run recomputes only what the widget touches.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path

import pandas as pd
import streamlit as st

from dflash_doctor.report.comparison import compare_runs
from dflash_doctor.stats import deviations
from dflash_doctor.stats.gate import Comparison
from dflash_doctor.app import RUNS_DIR_ENV, data
from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.run_record import Summary
from dflash_doctor.report.content import incomplete_note
from dflash_doctor.report.sanitize import for_markdown_text
from dflash_doctor.rundir.load import Run, load_run

DEFAULT_RUNS_DIR = "runs"
RUN_KEY = "run_path"  # session key of the open run (a path string)
UPLOADS_KEY = "uploaded_runs"  # session key: paths of runs uploaded in this session
UPLOAD_DIR_KEY = "upload_dir"

# Page scripts, for st.switch_page from one page to another.
VIEWS = Path(__file__).parent / "views"

# Material icons (the browser needs no emoji font); also the colour of each check status.
STATUS_ICONS = {
    "pass": ":material/check_circle:",
    "warn": ":material/warning:",
    "fail": ":material/cancel:",
    "error": ":material/bug_report:",
    "skip": ":material/skip_next:",
}
STATUS_COLORS = {"pass": "#d3f0dc", "warn": "#fdf0c8", "fail": "#fcd9d7", "error": "#fcd9d7", "skip": "#ececec"}


def runs_dir() -> Path:
    """The folder of runs the dashboard was started on (env var set by `dflash-doctor dashboard`)."""
    return Path(os.environ.get(RUNS_DIR_ENV) or DEFAULT_RUNS_DIR)


@st.cache_data(show_spinner=False, ttl=5)
def discovered_runs(root: str) -> list[str]:
    """Runs under ``root``, re-scanned at most every 5 s so a run that just finished shows up."""
    return [str(path) for path in data.find_runs(root)]


@st.cache_data(show_spinner=False, ttl=5)
def unreadable_runs(root: str) -> list[str]:
    """Folders under ``root`` whose run.json cannot be read, each with the loader's sentence: skipped, and named."""
    skipped: list[tuple[Path, str]] = []
    data.find_runs(root, skipped)
    return [f"{path.name}: {reason}" for path, reason in skipped]


@st.cache_data(show_spinner=False, ttl=5)
def discovered_tune_runs(root: str) -> list[str]:
    """`tune` runs under ``root``, re-scanned at most every 5 s like :func:`discovered_runs`."""
    return [str(path) for path in data.find_tune_runs(root)]


def discovered_head_to_heads(root: str) -> list[str]:
    """Head-to-head folders under ``root`` (``check --draft A --draft B``)."""
    return [str(path) for path in data.find_head_to_heads(root)]


def available_runs() -> list[str]:
    """Uploaded runs of this session first, then the runs found on disk."""
    uploaded = st.session_state.get(UPLOADS_KEY, [])
    return list(dict.fromkeys([*uploaded, *discovered_runs(str(runs_dir()))]))


@st.cache_resource(show_spinner="Reading the run…", max_entries=8)
def _load(path: str, mtime_ns: int, tables: tuple[str, ...]) -> Run:
    """One cached read, shared by every session and never modified by a page.

    A resource cache, not ``st.cache_data``: cache_data pickles its value on every hit, which costs
    about 1 s per visit for a 100k-row tokens table (benchmarks/dashboard_load.py); the small frames
    derived from it below are cache_data. ``mtime_ns`` is only part of the key, so a rewritten run is
    read again.
    """
    return load_run(path, tables=tables)


def load(path: str, tables: tuple[str, ...] = ()) -> Run:
    """The run at ``path`` with the given tables (``()`` = run.json only: cheap for meta pages)."""
    return _load(path, data.run_mtime_ns(path), tuple(sorted(tables)))


def run_label(path: str) -> str:
    """Selectbox label of a run: its folder name and creation date."""
    try:
        created = load(path).record.meta.created_at[:16].replace("T", " ")
    except UsageError:
        created = "unreadable"
    return f"{Path(path).name}  ·  {created}" if created else Path(path).name


def sidebar() -> None:
    """Run picker and uploader; sets ``st.session_state[RUN_KEY]`` to the run the pages show."""
    with st.sidebar:
        runs = available_runs()
        if runs:
            if st.session_state.get(RUN_KEY) not in runs:
                st.session_state[RUN_KEY] = runs[0]
            st.selectbox(
                "Run",
                runs,
                key=RUN_KEY,
                format_func=run_label,
                help=f"Runs found under {runs_dir()} and runs uploaded here.",
            )
        else:
            st.info(
                f"No runs under `{runs_dir()}`. Upload one below, or write "
                f"one with `dflash-doctor check --out {runs_dir()}/first`."
            )
        unreadable = unreadable_runs(str(runs_dir()))
        if unreadable:
            st.caption(
                for_markdown_text(
                    f"{len(unreadable)} folder(s) skipped, their run.json cannot be read; the first: {unreadable[0]}"
                )
            )
        with st.expander("Upload a run", expanded=not runs):
            uploads = st.file_uploader(
                "A zip of a run directory, or its run.json and .parquet files",
                type=["zip", "json", "parquet"],
                accept_multiple_files=True,
                key="run_upload",
            )
            if uploads:
                _register_upload([(f.name, f.getvalue()) for f in uploads])


class UploadFolder:
    """A session's temp folder of uploaded runs, removed when the session ends.

    Streamlit has no session-end hook, but it drops a session's state when the session ends (the tab closed
    and the reconnect grace period over, or the server stopped): a ``weakref.finalize`` on this object, kept
    only in ``st.session_state``, removes the folder then, and at interpreter exit for a server stopped with
    sessions open. Chosen over sweeping "stale" folders at start, which needs an age threshold that would
    either delete the folder of a session still open in another server or keep a dead one for hours. A server
    killed with SIGKILL runs no finalizer: its folders stay in the system temp folder for the OS to clear.
    """

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="dflash-doctor-upload-"))
        # the finalizer lives in weakref's registry until it runs: nothing else needs to keep it
        weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)


def _register_upload(files: list[tuple[str, bytes]]) -> None:
    """Save an upload as a run directory in this session's temp folder and open it."""
    names = sorted(name for name, _ in files)
    signature = "|".join(f"{name}:{len(payload)}" for name, payload in sorted(files))
    if st.session_state.get("upload_signature") == signature:
        return  # the uploader hands the same files back on every rerun
    if UPLOAD_DIR_KEY not in st.session_state:  # one folder per session, removed with it (UploadFolder)
        st.session_state[UPLOAD_DIR_KEY] = UploadFolder()
    upload_root = st.session_state[UPLOAD_DIR_KEY].path
    stem = Path(names[0]).stem if len(names) == 1 else "uploaded-run"
    dest = upload_root / f"{stem}-{len(st.session_state.get(UPLOADS_KEY, [])) + 1}"
    try:
        run_path = str(data.save_upload(files, dest))
    except UsageError as exc:
        st.error(for_markdown_text(exc.message))
        return
    st.session_state["upload_signature"] = signature
    st.session_state[UPLOADS_KEY] = [run_path, *st.session_state.get(UPLOADS_KEY, [])]
    st.session_state[RUN_KEY] = run_path
    st.rerun()


def current_run(tables: tuple[str, ...] = ()) -> Run:
    """The open run with ``tables`` loaded; stops the page with a clear note when there is none."""
    path = st.session_state.get(RUN_KEY)
    if not path:
        st.info("No run is open. Pick a run directory in the sidebar or upload one (a zip of a run, or its files).")
        st.stop()
    try:
        return load(path, tables)
    except UsageError as exc:
        st.error(for_markdown_text(exc.message))
        st.stop()


def run_header(run: Run, page_title: str) -> None:
    """Page title plus one caption line naming the run, so screenshots say what they show."""
    st.title(page_title)
    target, draft = (info.id if (info := run.record.models.get(role)) else "?" for role in ("target", "draft"))
    st.caption(
        f"Run **{for_markdown_text(run.name)}** · created {for_markdown_text(run.record.meta.created_at or '?')} · "
        f"target {for_markdown_text(target)} · draft {for_markdown_text(draft)}"
    )
    if not run.complete:
        st.warning(for_markdown_text(incomplete_note(run)), icon=":material/hourglass_top:")


def has_requests(run: Run) -> bool:
    """True when the run holds requests with drafts; otherwise explains why the page is empty."""
    if run.requests.empty or int(run.requests["num_drafts"].sum()) == 0:
        st.info(
            "This run has no drafted requests yet (empty or interrupted "
            "before the first request finished); nothing to break down."
        )
        return False
    return True


@st.cache_data(show_spinner="Recomputing for the filter…", max_entries=64)
def class_view(
    path: str, mtime_ns: int, classes: tuple[str, ...], subclasses: tuple[str, ...], buckets: tuple[str, ...]
) -> tuple[Summary, pd.DataFrame, pd.DataFrame]:
    """(summary, per-class table, requests) for one filter, cached per filter.

    With no filter the summary is run.json's own (the numbers the report shows); a filter recomputes
    it over the kept requests with the same metrics code and seed.
    """
    run = _load(path, mtime_ns, ("requests", "steps"))
    seed = run.record.seed
    requests = data.with_length_bucket(run.requests)
    chosen = data.filter_requests(requests, classes, subclasses, buckets)
    if classes or subclasses or buckets:
        summary = data.filtered_summary(run.steps, chosen, seed=seed)
    else:
        summary = run.record.summary
    return summary, data.class_table(summary, chosen, seed=seed), chosen


@st.cache_data(show_spinner=False, max_entries=4)
def vocabulary(path: str, mtime_ns: int) -> dict[int, str]:
    """Token id -> text learned from the run's tokens table (the dashboard loads no tokenizer)."""
    return data.token_vocabulary(_load(path, mtime_ns, ("steps", "tokens")).tokens)  # same read as request_slice


@st.cache_data(show_spinner=False, max_entries=64)
def request_slice(path: str, mtime_ns: int, request_id: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One request's steps and drafted tokens (a few thousand rows at most, out of the whole run)."""
    run = _load(path, mtime_ns, ("steps", "tokens"))
    steps = run.steps[run.steps["request_id"] == request_id].reset_index(drop=True)
    tokens = run.tokens[run.tokens["request_id"] == request_id].reset_index(drop=True)
    return steps, tokens


@st.cache_data(show_spinner="Comparing runs…", max_entries=16)
def comparison(
    base_path: str, base_mtime_ns: int, new_path: str, new_mtime_ns: int, threshold_tau: float, threshold_rate: float
) -> Comparison:
    """`dflash-doctor compare` of two runs (same rule and bootstrap), cached per pair and thresholds."""
    base = _load(base_path, base_mtime_ns, ("requests", "steps", "tokens"))  # tokens: the patterns that grew
    new = _load(new_path, new_mtime_ns, ("requests", "steps", "tokens"))
    return compare_runs(base, new, threshold_tau=threshold_tau, threshold_rate=threshold_rate)


@st.cache_resource(show_spinner="Finding rejection patterns…", max_entries=4)
def deviation_tables(path: str, mtime_ns: int) -> deviations.DeviationTables:
    """The run's decided tokens and drafts (:mod:`dflash_doctor.stats.deviations`), built once per run version.

    A resource cache for the same reason as :func:`_load`: the frame has a row per decided token.
    """
    return deviations.run_tables(_load(path, mtime_ns, ("requests", "steps", "tokens")))


@st.cache_data(show_spinner="Recomputing for the filter…", max_entries=64)
def deviation_view(
    path: str, mtime_ns: int, classes: tuple[str, ...], categories: tuple[str, ...]
) -> deviations.DeviationAnalysis:
    """The Deviations page's analysis for one filter: ``overall`` is the selection pooled, ``by_class``
    each selected class (every class when none is selected), cached per filter."""
    tables = deviation_tables(path, mtime_ns)
    shown = classes or tuple(deviations.class_names(tables))
    return deviations.DeviationAnalysis(
        definitions=deviations.definitions(tables),
        overall=deviations.slice_summary(tables, *deviations.select(tables, classes, categories)),
        by_class={
            cls: deviations.slice_summary(tables, *deviations.select(tables, (cls,), categories)) for cls in shown
        },
    )
