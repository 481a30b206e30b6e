"""Tokens: one request as it was decoded, with accepted and rejected draft tokens coloured, the
divergence of every drafted token, and the draft's top candidates beside the target's for one slot.

Token text comes from the run and is untrusted: it is escaped before it reaches HTML. A request is
shown a page of steps at a time, so a long output never turns into thousands of DOM nodes at once.
"""

import streamlit as st

from dflash_doctor.app import charts, data, ui

run = ui.current_run(("requests",))
ui.run_header(run, "Tokens")
if not ui.has_requests(run):
    st.stop()
path, mtime_ns = str(run.path), data.run_mtime_ns(run.path)

requests = run.requests.sort_values(["tau", "request_id"])
pick = st.columns([1, 3])
class_options = ["all classes", *sorted(requests["class"].unique())]
if st.session_state.get("token_class") not in class_options:
    st.session_state["token_class"] = "all classes"
cls = pick[0].selectbox("Class", class_options, key="token_class")
candidates = requests if cls == "all classes" else requests[requests["class"] == cls]
labels = {
    rid: f"{rid} · {rclass} · tau {tau:.2f} · {length} tokens"
    for rid, rclass, tau, length in zip(
        candidates["request_id"], candidates["class"], candidates["tau"], candidates["num_output_tokens"]
    )
}
if st.session_state.get("token_request") not in labels:
    st.session_state["token_request"] = next(iter(labels))
request_id = pick[1].selectbox(
    "Request (lowest tau first)", list(labels), key="token_request", format_func=labels.__getitem__
)
assert request_id is not None, "labels is never empty here: a request was preselected above"

request = candidates[candidates["request_id"] == request_id].iloc[0]
steps, tokens = ui.request_slice(path, mtime_ns, request_id)
facts = st.columns(5)
facts[0].metric("tau", f"{request['tau']:.2f}")
facts[1].metric("Steps", f"{len(steps):,}")
facts[2].metric("Output tokens", f"{int(request['num_output_tokens']):,}")
facts[3].metric(
    "Drafted tokens accepted", f"{request['num_accepted_tokens'] / max(1, request['num_draft_tokens']):.0%}"
)
facts[4].metric("Prompt tokens", f"{int(request['prompt_num_tokens']):,}")

if tokens.empty:
    st.info(
        "This run stored no per-token records for this request (replays "
        "written without token detail); the output text follows."
    )
    st.text(str(request["output_text"]))
    st.stop()

vocabulary = ui.vocabulary(path, mtime_ns)
pages = data.num_pages(len(steps))
page = st.pagination(pages, key=f"token_page_{request_id}") if pages > 1 else 1
shown_steps = data.page_of_steps(steps, page)
shown_tokens = tokens[tokens["step"].isin(shown_steps["step"])]
st.caption(
    f"Steps {int(shown_steps['step'].min())}–{int(shown_steps['step'].max())} of {len(steps):,} "
    f"(page {page} of {pages}). Hover a token for its slot, probabilities and divergence."
)
st.html(data.chips_html(data.request_chips(shown_steps, shown_tokens, vocabulary)))

status = data.slot_status(tokens, steps)
st.plotly_chart(charts.token_divergence_figure(tokens, status), key="token_divergence")

st.subheader("Draft candidates vs target candidates")
page_status = status.loc[shown_tokens.index]
decided = shown_tokens[page_status != "unused"]
slot_labels = {
    index: (
        f"step {row.step} slot {row.offset}: draft {row.draft_text!r} "
        f"vs target {row.target_text!r} ({page_status[index]})"
    )
    for index, row in zip(decided.index, decided.itertuples(index=False))
}
rejected = [index for index in slot_labels if page_status[index] == "rejected"]
slot_index = st.selectbox(
    "Drafted token on this page (first rejection preselected)",
    list(slot_labels),
    index=list(slot_labels).index(rejected[0]) if rejected else 0,
    format_func=slot_labels.__getitem__,
    key=f"token_slot_{request_id}_{page}",
)
slot = tokens.loc[slot_index]
numbers = st.columns(5)
numbers[0].metric("p_target(draft token)", f"{slot['target_prob_of_draft']:.3f}")
numbers[1].metric("p_draft(target token)", f"{slot['draft_prob_of_target']:.3f}")
numbers[2].metric(
    "Target token's rank in draft", f"{int(slot['target_rank_in_draft']) + 1}", help="1 = the draft's top choice"
)
numbers[3].metric("KL(target || draft)", f"{slot['kl_target_draft']:.3f}")
numbers[4].metric(
    "Target entropy",
    f"{slot['target_entropy']:.2f}",
    help="High entropy: the target itself was unsure; a miss there is cheap to forgive.",
)
st.dataframe(data.candidates_table(slot, vocabulary), hide_index=True)
