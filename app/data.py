"""The dashboard's data layer: finding runs, accepting uploads, and turning run tables into small frames.

Everything here is plain pandas/numpy with no Streamlit import, so it is tested without a browser and
the pages stay thin. Run directories are read only through :func:`dflash_doctor.rundir.load.load_run`; the
functions below aggregate (per class, per slot, per request page) so that a page never ships more than
a few hundred rows to the browser, even on a run with 100k drafted tokens.
"""

from __future__ import annotations

import html
import io
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import numpy as np
import pandas as pd

from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.run_record import OVERALL
from dflash_doctor.stats.metrics import NUM_BOOTSTRAP_RESAMPLES, bootstrap_ratio, group_rng, interval, summarize, summary_group
from dflash_doctor.rundir.run_record import Recommendation, RunRecord, Summary, Sweep
from dflash_doctor.rundir.load import read_run_meta
from dflash_doctor.rundir.tables import RUN_JSON, TABLES, TUNE_JSON
from dflash_doctor.rundir.writer import run_data_files
from dflash_doctor.rundir.status import STATUS_RANK, VERDICT_NONE, CheckResult, overall_status, status_counts
from dflash_doctor.telemetry.watch_record import UNITS_FILE, WINDOWS_FILE

if TYPE_CHECKING:
    from pandas.io.formats.style_render import ExtFormatter

# Folder depth searched below RUNS_DIR: runs/<name>/run.json and runs/<group>/<name>/run.json.
MAX_RUN_SEARCH_DEPTH = 2
# Files a run directory may hold; an upload is reduced to exactly these (anything else is ignored).
# A watch run adds its time series (windows) and raw counts (units): the Production page and a canary
# compare read them.
RUN_FILE_NAMES = (RUN_JSON, *(f"{name}.parquet" for name in TABLES), WINDOWS_FILE, UNITS_FILE)
# A zip that inflates past this is refused rather than filling the disk (zip bomb guard).
MAX_UPLOAD_INFLATED_BYTES = 2 * 1024**3
# Prompt-length buckets for the class filter: lower edges in prompt tokens.
PROMPT_LENGTH_EDGES = (0, 128, 512, 2048, 8192)
# Steps of one request rendered per page of the token view (each step is up to K+1 chips).
STEPS_PER_TOKEN_PAGE = 64


# ---------------------------------------------------------------------------------------------
# Finding runs and reading uploads
# ---------------------------------------------------------------------------------------------


def find_runs(root: Path | str) -> list[Path]:
    """Run directories under ``root`` (``root`` itself when it is a run), newest ``created_at`` first.

    A folder whose run.json does not parse or has another schema version is skipped here; opening it
    directly still shows the loader's one-sentence reason.
    """
    root = Path(root)
    if (root / RUN_JSON).is_file():
        return [root]
    if not root.is_dir():
        return []
    found: list[tuple[str, Path]] = []
    for run_json in _files_below(root, RUN_JSON):
        try:
            created_at = str(read_run_meta(run_json.parent).get("created_at", ""))
        except UsageError:
            continue
        found.append((created_at, run_json.parent))
    found.sort(key=lambda item: (item[0], str(item[1])), reverse=True)
    return [path for _, path in found]


def find_tune_runs(root: Path | str) -> list[Path]:
    """`tune` run directories (tune.json) under ``root``, as deep as :func:`find_runs` looks, last name first
    (the default names carry the time)."""
    return sorted((path.parent for path in _files_below(Path(root), TUNE_JSON)), key=str, reverse=True)


def _files_below(root: Path, name: str) -> Iterator[Path]:
    """Files called ``name`` one to :data:`MAX_RUN_SEARCH_DEPTH` folders below ``root``: where runs are looked for."""
    for depth in range(1, MAX_RUN_SEARCH_DEPTH + 1):
        yield from root.glob("/".join(["*"] * depth) + "/" + name)


def run_mtime_ns(run_dir: Path | str) -> int:
    """Newest modification time of the run's files (journal included): the cache key that notices a
    rewritten run, and a run in progress growing."""
    return max((path.stat().st_mtime_ns for path in run_data_files(run_dir)), default=0)


def save_upload(files: Sequence[tuple[str, bytes]], dest: Path) -> Path:
    """Turn uploaded files into a run directory at ``dest`` and return it.

    ``files`` is ``(file name, bytes)`` pairs: one zip of a run directory, or the run's own files
    (run.json plus any of the Parquet tables). Only the known run file names are written, by base
    name, so a hostile zip cannot write outside ``dest`` (no path traversal) or fill the disk.
    """
    if not files:
        raise UsageError("No file was uploaded; upload a zip of a run directory or its run.json and .parquet files.")
    chosen: dict[str, bytes] = {}
    for file_name, payload in files:
        base = Path(file_name).name
        if base.lower().endswith(".zip"):
            chosen.update(_run_files_from_zip(base, payload))
        elif base in RUN_FILE_NAMES:
            chosen[base] = payload
        else:
            raise UsageError(
                f"Uploaded file {base!r} is not part of a run; upload a .zip of a run directory or files named {', '.join(RUN_FILE_NAMES)}."
            )
    if RUN_JSON not in chosen:
        raise UsageError(f"The upload has no {RUN_JSON}; include the run directory's {RUN_JSON} (it holds the summary and checks).")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for base, payload in chosen.items():
        (dest / base).write_bytes(payload)
    read_run_meta(dest)  # fail now, with the loader's sentence, rather than on every page
    return dest


def _run_files_from_zip(zip_name: str, payload: bytes) -> dict[str, bytes]:
    """The run files inside a zip; when it holds several runs, the shallowest run.json wins."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(payload))
    except zipfile.BadZipFile:
        raise UsageError(f"{zip_name} is not a valid zip file; zip the run directory again (e.g. `zip -r run.zip RUN_DIR`).") from None
    with archive:
        members = [m for m in archive.infolist() if not m.is_dir()]
        if sum(m.file_size for m in members) > MAX_UPLOAD_INFLATED_BYTES:
            raise UsageError(f"{zip_name} inflates to more than {MAX_UPLOAD_INFLATED_BYTES // 1024**3} GiB; upload only run.json and the .parquet files.")
        run_jsons = sorted((m for m in members if Path(m.filename).name == RUN_JSON), key=lambda m: m.filename.count("/"))
        if not run_jsons:
            raise UsageError(f"{zip_name} holds no {RUN_JSON}; zip a run directory written by `dflash-doctor check`, `replay` or `sweep`.")
        run_folder = Path(run_jsons[0].filename).parent
        return {
            Path(m.filename).name: archive.read(m)
            for m in members
            if Path(m.filename).parent == run_folder and Path(m.filename).name in RUN_FILE_NAMES
        }


# ---------------------------------------------------------------------------------------------
# Overview
# ---------------------------------------------------------------------------------------------



def checks_table(checks: Iterable[CheckResult]) -> pd.DataFrame:
    """One row per check, worst status first (what needs attention leads the page)."""
    rows = [{"status": check.status, "check": check.id, "summary": check.summary, "findings": len(check.findings)} for check in checks]
    frame = pd.DataFrame(rows, columns=["status", "check", "summary", "findings"])
    order = frame["status"].map({status.value: rank for rank, status in enumerate(STATUS_RANK)}).fillna(len(STATUS_RANK))
    return frame.assign(_order=order).sort_values(["_order", "check"], kind="stable").drop(columns="_order").reset_index(drop=True)


def facts_table(facts: dict[str, Any]) -> pd.DataFrame:
    """A flat key/value table of a nested dict (models, environment), lists shown as text."""
    rows: list[dict[str, str]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            rows.append({"key": prefix, "value": "—" if value is None else str(value)})

    walk("", facts)
    return pd.DataFrame(rows, columns=["key", "value"])


# ---------------------------------------------------------------------------------------------
# Rejection by class
# ---------------------------------------------------------------------------------------------


def prompt_length_bucket(prompt_num_tokens: pd.Series) -> pd.Series:
    """Label each request with its prompt-length bucket ("<128", "128-511", ..., ">=8192")."""
    edges = list(PROMPT_LENGTH_EDGES) + [np.inf]
    labels = [f"<{edges[1]}"] + [f"{lo}-{hi - 1}" for lo, hi in zip(edges[1:-2], edges[2:-1])] + [f">={edges[-2]}"]
    return pd.cut(prompt_num_tokens.astype("float64"), bins=edges, labels=labels, right=False).astype(str)


def with_length_bucket(requests: pd.DataFrame) -> pd.DataFrame:
    """Requests plus a ``length_bucket`` column (the filter's third dimension)."""
    return requests.assign(length_bucket=prompt_length_bucket(requests["prompt_num_tokens"]))


def filter_requests(
    requests: pd.DataFrame,
    classes: Sequence[str] | None = None,
    subclasses: Sequence[str] | None = None,
    length_buckets: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Keep the requests matching every given filter (None or empty = no filter on that column)."""
    keep = pd.Series(True, index=requests.index)
    for column, allowed in (("class", classes), ("subclass", subclasses), ("length_bucket", length_buckets)):
        if allowed:
            keep &= requests[column].isin(list(allowed))
    return requests[keep]


def bootstrap_ratio_ci(numerator: np.ndarray, denominator: np.ndarray, *, seed: int = 0, group: str = OVERALL) -> tuple[float, float]:
    """95% CI of ``sum(numerator) / sum(denominator)`` resampling requests (rows), through the same
    bootstrap and interval as the summary's (:mod:`dflash_doctor.stats.metrics`)."""
    samples = bootstrap_ratio(numerator, denominator, NUM_BOOTSTRAP_RESAMPLES, group_rng(seed, group))
    lo, hi = interval(samples)
    return (float(lo), float(hi))


CLASS_TABLE_COLUMNS = [
    "class", "num_requests", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
    "tau", "tau_lo", "tau_hi", "rejection_rate", "rejection_rate_lo", "rejection_rate_hi",
]


def filtered_summary(steps: pd.DataFrame, requests: pd.DataFrame, *, seed: int = 0) -> Summary:
    """The run's summary recomputed over a subset of requests (same metrics code, same CIs)."""
    return summarize(steps[steps["request_id"].isin(requests["request_id"])], requests, seed=seed)


def class_table(summary: Summary, requests: pd.DataFrame, *, seed: int = 0) -> pd.DataFrame:
    """tau and draft-token rejection rate per class with 95% CIs, "overall" first, then worst tau first.

    tau and its CI come from the summary (bonus included, vLLM's mean acceptance length). The rejection
    rate is 1 - accepted / drafted tokens, pooled; its CI resamples the class's requests, as the
    summary's CIs do.
    """
    rows = []
    for cls, metrics in summary.scopes().items():
        if not metrics.num_drafts:
            continue
        members = requests if cls == "overall" else requests[requests["class"] == cls]
        accepted_lo, accepted_hi = bootstrap_ratio_ci(
            members["num_accepted_tokens"].to_numpy(), members["num_draft_tokens"].to_numpy(), seed=seed, group=summary_group(cls)
        )
        tau_lo, tau_hi = metrics.mean_acceptance_length_ci
        rows.append(
            {
                "class": cls,
                "num_requests": metrics.num_requests,
                "num_drafts": metrics.num_drafts,
                "num_draft_tokens": metrics.num_draft_tokens,
                "num_accepted_tokens": metrics.num_accepted_tokens,
                "tau": metrics.mean_acceptance_length,
                "tau_lo": tau_lo,
                "tau_hi": tau_hi,
                "rejection_rate": 1.0 - metrics.draft_acceptance_rate if metrics.draft_acceptance_rate is not None else None,
                "rejection_rate_lo": 1.0 - accepted_hi,
                "rejection_rate_hi": 1.0 - accepted_lo,
            }
        )
    frame = pd.DataFrame(rows, columns=CLASS_TABLE_COLUMNS).astype({c: "float64" for c in CLASS_TABLE_COLUMNS[5:]})
    frame = frame.assign(_not_overall=frame["class"] != "overall")
    return frame.sort_values(["_not_overall", "tau"], kind="stable").drop(columns="_not_overall").reset_index(drop=True)


def class_requests(requests: pd.DataFrame, cls: str) -> pd.DataFrame:
    """The drill-down: one class's requests, lowest tau first (the worst ones are what to read)."""
    columns = ["request_id", "subclass", "length_bucket", "prompt_num_tokens", "num_output_tokens", "num_drafts", "tau", "acceptance_rate", "stop_reason"]
    chosen = requests[requests["class"] == cls]
    draft_tokens = chosen["num_draft_tokens"].where(chosen["num_draft_tokens"] > 0)
    chosen = chosen.assign(acceptance_rate=chosen["num_accepted_tokens"] / draft_tokens)
    return chosen.sort_values(["tau", "request_id"], kind="stable")[columns].reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# Positions
# ---------------------------------------------------------------------------------------------

POSITION_COLUMNS = ["class", "slot", "unconditional", "unconditional_lo", "unconditional_hi", "conditional"]


def position_table(summary: Summary) -> pd.DataFrame:
    """Per-slot acceptance for "overall" and every class, long format (1-based draft slot).

    unconditional r_i = P(at least i tokens accepted) per draft; conditional a_i = r_i / r_{i-1}
    = P(slot i accepted | slots before it accepted): where a_i drops is where the draft loses.
    """
    rows = []
    for cls, metrics in summary.scopes().items():
        if not metrics.num_drafts:
            continue  # no drafts: the rates are undefined (NaN), not zero
        rates = metrics.acceptance_rate_per_pos
        cis = metrics.acceptance_rate_per_pos_ci or [[None, None]] * len(rates)  # telemetry may lack the intervals
        conditional = metrics.conditional_acceptance_rate_per_pos
        for slot, (rate, (lo, hi), cond) in enumerate(zip(rates, cis, conditional), start=1):
            rows.append({"class": cls, "slot": slot, "unconditional": rate, "unconditional_lo": lo, "unconditional_hi": hi, "conditional": cond})
    return pd.DataFrame(rows, columns=POSITION_COLUMNS).astype({c: "float64" for c in POSITION_COLUMNS[2:]})


# A slot counts for "weakest slot" only when at least this share of drafts reached it: a_i of a slot
# that 3 drafts reached is noise, not a finding.
MIN_SLOT_REACH = 0.05


def weakest_slots(table: pd.DataFrame, min_reach: float = MIN_SLOT_REACH) -> pd.DataFrame:
    """Per class, the reached slot with the lowest conditional acceptance (rows of ``position_table``).

    Reach of slot i is r_{i-1} (1 for slot 1): the share of drafts whose earlier slots were all accepted.
    """
    reach = table.groupby("class")["unconditional"].shift(1).fillna(1.0)
    reached = table[(reach >= min_reach) & table["conditional"].notna()]
    return reached.loc[reached.groupby("class", sort=False)["conditional"].idxmin()].reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# Tokens
# ---------------------------------------------------------------------------------------------


def token_vocabulary(tokens: pd.DataFrame) -> dict[int, str]:
    """Token id -> text, learned from the run's own drafted/target tokens (no tokenizer is loaded).

    Lets the token view print the bonus token and top-k candidate ids as text wherever the run saw
    them; ids it never saw are shown as ``#id``.
    """
    draft = tokens[["draft_token", "draft_text"]].set_axis(["id", "text"], axis=1)
    target = tokens[["target_token", "target_text"]].set_axis(["id", "text"], axis=1)
    pairs = pd.concat([draft, target], ignore_index=True).dropna().drop_duplicates("id")
    return dict(zip(pairs["id"].astype(int), pairs["text"].astype(str)))


def token_label(token_id: int | None, vocabulary: dict[int, str]) -> str:
    """Readable text of a token id: its text when known, ``#id`` otherwise."""
    if token_id is None or (isinstance(token_id, float) and np.isnan(token_id)):
        return ""
    return vocabulary.get(int(token_id), f"#{int(token_id)}")


@dataclass(frozen=True)
class TokenChip:
    """One token of the rendered request: what was shown, why (kind) and its evidence (tooltip)."""

    text: str
    kind: str  # accepted | rejected (draft token the target refused) | target (committed by the target)
    step: int
    offset: int  # 1-based draft slot; 0 for the target's bonus/correction token
    tooltip: str


def request_chips(steps: pd.DataFrame, tokens: pd.DataFrame, vocabulary: dict[int, str]) -> list[list[TokenChip]]:
    """The request as committed, one list of chips per step.

    Per step: the accepted draft tokens, then (if one was refused) the refused draft token, then the
    token the target committed instead (the bonus token: the target's choice after the accepted prefix).
    Slots after the first refusal were never used and are not shown.
    """
    by_step = {step: group.sort_values("offset") for step, group in tokens.groupby("step", sort=True)}
    blocks: list[list[TokenChip]] = []
    for step in steps.sort_values("step").to_dict("records"):
        chips: list[TokenChip] = []
        slots = by_step.get(step["step"])
        num_accepted = int(step["num_accepted"])
        if slots is not None:
            for slot in slots.to_dict("records"):
                if slot["offset"] > num_accepted + 1:
                    break
                evidence = (
                    f"step {step['step']} slot {slot['offset']} | draft {slot['draft_text']!r} target {slot['target_text']!r} | "
                    f"p_target(draft)={slot['target_prob_of_draft']:.3f} KL={slot['kl_target_draft']:.3f} TV={slot['total_variation']:.3f}"
                )
                kind = "accepted" if slot["accepted"] else "rejected"
                chips.append(TokenChip(str(slot["draft_text"]), kind, int(step["step"]), int(slot["offset"]), evidence))
        bonus_text = token_label(step["bonus_token"], vocabulary)
        chips.append(TokenChip(bonus_text, "target", int(step["step"]), 0, f"step {step['step']}: token committed by the target after {num_accepted} accepted"))
        blocks.append(chips)
    return blocks


CHIP_CSS = """
<style>
.dd-tokens{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:0.86rem;line-height:1.9;white-space:pre-wrap;word-break:break-word}
.dd-step{border-left:2px solid #c9ced6;padding-left:1px;margin-left:1px}
.dd-tok{border-radius:3px;padding:1px 1px}
.dd-accepted{background:#d3f0dc;color:#14532d}
.dd-rejected{background:#fcd9d7;color:#991b1b;text-decoration:line-through}
.dd-target{background:#dde7f7;color:#1e3a8a}
.dd-legend span{margin-right:0.8rem}
</style>
"""


def visible_token_text(text: str) -> str:
    """Make whitespace tokens visible (a newline as ↵, a bare space as ·) so no chip is empty."""
    if text == "":
        return "∅"
    shown = text.replace("\n", "↵").replace("\t", "⇥")
    return "·" if shown.strip() == "" and " " in shown and len(shown) == 1 else shown


def chips_html(blocks: Sequence[Sequence[TokenChip]]) -> str:
    """HTML of the coloured request. Every token text and tooltip is escaped: token text is untrusted."""
    parts = [CHIP_CSS, '<div class="dd-legend"><span class="dd-tok dd-accepted">accepted draft</span>'
             '<span class="dd-tok dd-rejected">rejected draft</span><span class="dd-tok dd-target">target token</span>'
             '<span>│ = step boundary</span></div><div class="dd-tokens">']
    for chips in blocks:
        parts.append('<span class="dd-step">')
        for chip in chips:
            parts.append(
                f'<span class="dd-tok dd-{chip.kind}" title="{html.escape(chip.tooltip, quote=True)}">'
                f"{html.escape(visible_token_text(chip.text))}</span>"
            )
        parts.append("</span>")
    parts.append("</div>")
    return "".join(parts)


def page_of_steps(steps: pd.DataFrame, page: int, steps_per_page: int = STEPS_PER_TOKEN_PAGE) -> pd.DataFrame:
    """The 1-based ``page`` of a request's steps, in step order."""
    ordered = steps.sort_values("step")
    start = (page - 1) * steps_per_page
    return ordered.iloc[start : start + steps_per_page]


def num_pages(num_rows: int, rows_per_page: int = STEPS_PER_TOKEN_PAGE) -> int:
    """Pages needed for ``num_rows`` (at least one, so an empty request still has a page)."""
    return max(1, -(-num_rows // rows_per_page))


def slot_status(tokens: pd.DataFrame, steps: pd.DataFrame) -> pd.Series:
    """accepted / rejected / unused per drafted token (unused: after the step's first refusal)."""
    accepted_per_step = steps.set_index("step")["num_accepted"]
    num_accepted = tokens["step"].map(accepted_per_step)
    status = np.where(tokens["accepted"], "accepted", np.where(tokens["offset"] == num_accepted + 1, "rejected", "unused"))
    return pd.Series(status, index=tokens.index, name="status")


def candidates_table(slot: pd.Series, vocabulary: dict[int, str]) -> pd.DataFrame:
    """Draft's top candidates beside the target's for one drafted token, by rank (ids as text)."""
    draft_ids = list(slot["draft_topk_ids"] if slot["draft_topk_ids"] is not None else [])
    target_ids = list(slot["target_topk_ids"] if slot["target_topk_ids"] is not None else [])
    depth = max(len(draft_ids), len(target_ids))
    rows = []
    for rank in range(depth):
        draft_id = int(draft_ids[rank]) if rank < len(draft_ids) else None
        target_id = int(target_ids[rank]) if rank < len(target_ids) else None
        rows.append(
            {
                "rank": rank + 1,
                "draft candidate": token_label(draft_id, vocabulary) if draft_id is not None else "",
                "draft id": draft_id,
                "target candidate": token_label(target_id, vocabulary) if target_id is not None else "",
                "target id": target_id,
                "same": draft_id is not None and draft_id == target_id,
            }
        )
    return pd.DataFrame(rows, columns=["rank", "draft candidate", "draft id", "target candidate", "target id", "same"])


# ---------------------------------------------------------------------------------------------
# Sweep
# ---------------------------------------------------------------------------------------------

SWEEP_COLUMNS = ["class", "k", "mean_acceptance_length", "tau_lo", "tau_hi", "speedup", "estimate"]


def sweep_table(sweep: Sweep) -> pd.DataFrame:
    """The sweep rows as one long frame ("overall" plus each class)."""
    rows = []
    for cls, entries in sweep.scopes().items():
        for entry in entries:
            lo, hi = entry.mean_acceptance_length_ci
            rows.append(
                {
                    "class": cls,
                    "k": entry.k,
                    "mean_acceptance_length": entry.mean_acceptance_length,
                    "tau_lo": lo,
                    "tau_hi": hi,
                    "speedup": entry.speedup,
                    "estimate": entry.estimate,
                }
            )
    return pd.DataFrame(rows, columns=SWEEP_COLUMNS)


def step_cost_table(sweep: Sweep) -> pd.DataFrame:
    """The draft and verify milliseconds per K behind the sweep's speedups."""
    costs = sweep.step_costs()
    return pd.DataFrame({
        "draft ms": {k: 1000 * v for k, v in costs.t_draft_s.items()},
        "verify ms": {k: 1000 * v for k, v in costs.t_verify_s.items()},
    }).rename_axis("K").sort_index()


def recommendation_table(recommendation: dict[str, Recommendation]) -> pd.DataFrame:
    """Recommended K per class ("overall" first); K = 0 means speculation off for that class."""
    rows = [
        {
            "class": cls,
            "k": rec.k,
            "conservative_k": rec.conservative_k,
            "speedup": rec.speedup,
            "reason": rec.reason,
        }
        for cls, rec in recommendation.items()
    ]
    frame = pd.DataFrame(rows, columns=["class", "k", "conservative_k", "speedup", "reason"])
    return frame.assign(_first=frame["class"] != "overall").sort_values(["_first", "class"]).drop(columns="_first").reset_index(drop=True)


def run_verdict(checks: Sequence[CheckResult]) -> tuple[str, str]:
    """(verdict, sentence) for the whole run: :func:`dflash_doctor.rundir.status.overall_status` of its checks
    and how many checks ended in each status."""
    statuses = [check.status for check in checks]
    status = overall_status(statuses)
    if status == VERDICT_NONE:
        return status, "No checks were recorded in this run (replay/sweep runs have none; `dflash-doctor check` adds them)."
    counts = status_counts(statuses)
    words = {"fail": "failed", "error": "errored", "warn": "warned", "pass": "passed", "skip": "skipped"}
    parts = [f"{counts[s]} {words[s]}" for s in STATUS_RANK if counts[s]]
    return status, f"{len(checks)} checks: " + ", ".join(parts) + "."


# ---------------------------------------------------------------------------------------------
# Compare
# ---------------------------------------------------------------------------------------------

COMPARISON_FORMATS: ExtFormatter = {"BASE": "{:.3f}", "NEW": "{:.3f}", "delta": "{:+.3f}"}


def comparison_table(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """``compare_runs`` rows as a table: one line per class and metric, intervals as text."""

    def interval(ci: Sequence[float] | None) -> str:
        return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "—"

    frame = pd.DataFrame(
        [
            {
                "class": row["class"],
                "metric": row["label"],
                "BASE": row["base"],
                "BASE 95% CI": interval(row["base_ci"]),
                "NEW": row["new"],
                "NEW 95% CI": interval(row["new_ci"]),
                "delta": row["delta"],
                "regression": bool(row["regression"]),
                "note": row["note"],
            }
            for row in rows
        ],
        columns=["class", "metric", "BASE", "BASE 95% CI", "NEW", "NEW 95% CI", "delta", "regression", "note"],
    )
    return frame.astype({"BASE": "float64", "NEW": "float64", "delta": "float64"})


def highlight_regressions(row: pd.Series) -> list[str]:
    """Styler rule: a regressed line is red, an improvement beyond noise is left plain."""
    style = "background-color: #fcd9d7; color: #991b1b; font-weight: 600" if row.get("regression") else ""
    return [style] * len(row)


def run_facts(record: RunRecord) -> dict[str, Any]:
    """The facts that say what ran: models (identity and kind facts), environment, config."""
    return {
        "models": {role: info.fields() for role, info in record.models.items()},
        "environment": record.environment,
        "config": record.config,
    }


def changed_facts(base: RunRecord, new: RunRecord) -> pd.DataFrame:
    """Model, environment and config facts that differ between two runs (the usual suspects)."""
    base_facts = facts_table(run_facts(base)).set_index("key")["value"]
    new_facts = facts_table(run_facts(new)).set_index("key")["value"]
    both = pd.concat([base_facts.rename("BASE"), new_facts.rename("NEW")], axis=1).fillna("—")
    return both[both["BASE"] != both["NEW"]].rename_axis("fact").reset_index()
