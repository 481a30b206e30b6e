"""Overview page: the verdict, the headline numbers, every check with its findings and fixes, and
the model and environment facts needed to reproduce the run."""

import streamlit as st

from dflash_doctor.report import figures
from dflash_doctor.app import data, ui
from dflash_doctor.report.sanitize import for_markdown_text

run = ui.current_run()
ui.run_header(run, "Overview")
record = run.record
overall = record.summary.overall

status, sentence = data.run_verdict(record.checks)
banner = {"fail": st.error, "error": st.error, "warn": st.warning, "pass": st.success}.get(status, st.info)
banner(
    f"**Verdict: {for_markdown_text(status.upper())}** — {for_markdown_text(sentence)}"
    if status != "none"
    else for_markdown_text(sentence),
    icon=ui.STATUS_ICONS.get(status, ":material/info:"),
)

if overall is not None and overall.num_drafts:
    tau_lo, tau_hi = overall.mean_acceptance_length_ci or [float("nan")] * 2
    best = record.recommendation.get("overall")
    cols = st.columns(5)
    cols[0].metric(
        "tau",
        f"{overall.mean_acceptance_length:.2f}",
        help="Mean acceptance length: 1 + accepted / drafts, bonus token included (vLLM's definition).",
    )
    cols[0].caption(f"95% CI [{tau_lo:.2f}, {tau_hi:.2f}]")
    acceptance = overall.draft_acceptance_rate if overall.draft_acceptance_rate is not None else float("nan")
    cols[1].metric(
        "Drafted tokens accepted",
        f"{acceptance:.1%}",
        help="accepted / drafted; it falls as K grows, so compare tau instead.",
    )
    cols[2].metric("Requests", f"{overall.num_requests:,}")
    cols[3].metric("Output tokens", f"{overall.num_output_tokens:,}")
    cols[4].metric(
        "Recommended K (overall)",
        str(best.k) if best else "—",
        # a tooltip is Markdown and the reason comes from run.json (an upload, a folder dropped in): escaped
        help=for_markdown_text(best.reason)
        if best and best.reason
        else "Run `dflash-doctor sweep` for a recommendation.",
    )
    left, right = st.columns(2)
    left.plotly_chart(figures.tau_by_class_figure(record.summary), key="overview_tau")
    right.plotly_chart(figures.acceptance_histogram_figure(record.summary), key="overview_histogram")
else:
    st.info(
        "This run has no drafted steps, so there are no acceptance numbers; the checks and facts below still apply."
    )

st.header("Checks")
if not record.checks:
    st.caption("No checks in this run.")
else:
    table = data.checks_table(record.checks)
    st.dataframe(
        table.style.map(lambda status: f"background-color: {ui.STATUS_COLORS.get(str(status), '')}", subset=["status"]),
        hide_index=True,
    )
    by_id = {check.id: check for check in record.checks}
    for row in table.to_dict("records"):
        check = by_id[row["check"]]
        with st.expander(
            f"**{for_markdown_text(check.id)}** ({check.status}) — {for_markdown_text(check.summary)}",
            expanded=check.status in ("fail", "error"),
            icon=ui.STATUS_ICONS.get(check.status),
        ):
            if not check.findings:
                st.caption("No findings.")
            for finding in check.findings:
                box = {"fail": st.error, "warn": st.warning}.get(finding.severity, st.info)
                box(f"**{finding.severity}**: {for_markdown_text(finding.message)}")
                if finding.evidence:
                    st.code(finding.evidence, language=None)
                if finding.fix:
                    st.markdown(f"**Fix:** {for_markdown_text(finding.fix)}")
            if check.metrics:
                st.json(check.metrics, expanded=False)

if record.recommendation:
    st.header("Recommended K")
    st.dataframe(
        data.recommendation_table(record.recommendation),
        hide_index=True,
        column_config={
            "speedup": st.column_config.NumberColumn(format="%.2fx"),
            "reason": st.column_config.TextColumn(width="large"),
        },
    )

st.header("Models and environment")
left, right = st.columns(2)
with left:
    st.subheader("Models")
    st.dataframe(data.facts_table(data.run_facts(record)["models"]), hide_index=True)
with right:
    st.subheader("Environment")
    st.dataframe(data.facts_table(record.environment), hide_index=True)
with st.expander("Configuration (everything that was asked for)"):
    st.json(record.config)
