"""Production page: a `watch` run's time series - tau per window with its interval, the baseline, alert
markers, net speedup against the fallback floor - and every alert with the exact engine change.

A watch rewrites its run directory after every evaluation, so everything below the title is a fragment
that reruns every :data:`REFRESH_EVERY_S` seconds and reads the run again (a stat of its files when
nothing changed: :func:`dflash_doctor.app.ui.load` is keyed on their mtime).
"""

import pandas as pd
import streamlit as st

from dflash_doctor.app import ui
from dflash_doctor.report import watch_figures
from dflash_doctor.report.sanitize import for_markdown_text
from dflash_doctor.telemetry.watch_record import is_watch_run, read_windows, telemetry_details

REFRESH_EVERY_S = 10

run = ui.current_run()
ui.run_header(run, "Production")
if not is_watch_run(run.record):
    st.info(
        "This page shows runs written by `dflash-doctor watch` (production telemetry). Open a watch run in the sidebar."
    )
    st.stop()


@st.fragment(run_every=REFRESH_EVERY_S)
def watch_view(path: str) -> None:
    """The watch as its run directory holds it now (see the module docstring)."""
    record = ui.load(path).record
    telemetry = telemetry_details(record)
    windows = read_windows(path)
    st.caption(
        f"Sources: {for_markdown_text(', '.join(telemetry['sources']) or '?')} "
        f"· window {for_markdown_text(telemetry['window_s'])} s · "
        f"baseline: {for_markdown_text(telemetry['baseline'] or 'none')} · refreshes every {REFRESH_EVERY_S} s"
    )

    alerts = telemetry["alerts"]
    if alerts:
        st.error(
            f"**{len(alerts)} alert(s)** in this watch; the latest: {for_markdown_text(alerts[-1]['message'])}",
            icon=":material/notifications_active:",
        )
    elif not windows.empty:
        st.success("No alert in this watch.", icon=":material/check_circle:")

    if windows.empty:
        st.info(
            "No window yet: the watch has not finished its first "
            f"window (this page looks again every {REFRESH_EVERY_S} s)."
        )
        return

    latest = windows.sort_values("end_s").groupby(["model", "class"], sort=True).tail(1)
    st.header("Latest window")
    st.dataframe(
        latest[
            [
                "model",
                "class",
                "status",
                "k",
                "num_drafts",
                "mean_acceptance_length",
                "mean_acceptance_length_lo",
                "mean_acceptance_length_hi",
                "baseline_tau",
                "engine_mean_acceptance_length",
                "draft_acceptance_rate",
                "speedup",
                "best_k",
            ]
        ],
        hide_index=True,
        column_config={
            "mean_acceptance_length": st.column_config.NumberColumn(
                "tau", format="%.2f", help="1 + accepted / drafts, bonus included (vLLM's definition)."
            ),
            "mean_acceptance_length_lo": st.column_config.NumberColumn("95% lo", format="%.2f"),
            "mean_acceptance_length_hi": st.column_config.NumberColumn("95% hi", format="%.2f"),
            "baseline_tau": st.column_config.NumberColumn("baseline", format="%.2f"),
            "engine_mean_acceptance_length": st.column_config.NumberColumn(
                "engine's tau", format="%.2f", help="What the engine itself printed or exported, where it does."
            ),
            "draft_acceptance_rate": st.column_config.NumberColumn("accepted/drafted", format="%.3f"),
            "speedup": st.column_config.NumberColumn("net speedup", format="%.2fx"),
        },
    )

    st.plotly_chart(watch_figures.tau_timeline_figure(windows), key="production_tau")
    floor = telemetry["thresholds"]["speedup_floor"]
    st.plotly_chart(watch_figures.speedup_timeline_figure(windows, floor), key="production_speedup")

    if alerts:
        st.header("Alerts and fallback advice")
        for alert in reversed(alerts):
            when = pd.Timestamp(alert["time_s"], unit="s", tz="UTC").strftime("%Y-%m-%d %H:%M:%S UTC")
            # kind, series and message carry a server's labels (model names from /metrics): escaped, never Markdown
            with st.expander(
                f"{when} · **{for_markdown_text(alert['kind'])}** · {for_markdown_text(alert['series'])}",
                expanded=alert is alerts[-1],
            ):
                st.markdown(for_markdown_text(alert["message"]))
                if alert["advice"]:
                    st.code("\n".join(alert["advice"]), language=None)

    events = telemetry["events"]
    notes = telemetry["notes"]
    if events or notes:
        st.header("Source events")
        if events:
            st.dataframe(pd.DataFrame(events), hide_index=True)
        for note in notes:
            st.caption(for_markdown_text(note))


watch_view(str(run.path))
