"""`dflash-doctor watch SOURCE...`: production acceptance per model/class, alerts vs a baseline, fallback advice."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from dflash_doctor.cli.root import app
from dflash_doctor.cli import options as opt
from dflash_doctor.errors import UsageError
from dflash_doctor.processes import Stopped
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.cli.output import print_json
from dflash_doctor.report.sanitize import for_terminal
from dflash_doctor.rundir.writer import utc_now
from dflash_doctor.serving.http import header_flags, secret
from dflash_doctor.stats.speedup import load_cost_profile
from dflash_doctor.telemetry.hooks import AlertHooks
from dflash_doctor.telemetry.settings import build_watch_settings
from dflash_doctor.telemetry.sources import parse_duration_s
from dflash_doctor.telemetry.session import WatchSession, open_sources
from dflash_doctor.telemetry.verdict import WindowVerdict
from dflash_doctor.telemetry.watcher import Watcher

EXIT_ALERT = 1


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def verdict_table(verdicts: list[WindowVerdict], title: str) -> Table:
    """One row per series; columns with nothing to show (no baseline, no costs, ...) are left out."""
    columns: dict[str, list[str]] = {
        name: []
        for name in (
            "series",
            "K",
            "drafts",
            "tau",
            "95% CI",
            "baseline",
            "r_1..r_3",
            "engine tau",
            "speedup",
            "status",
        )
    }
    for v in verdicts:
        ci = v.mean_acceptance_length_ci
        drafts = v.window.counts.num_drafts
        columns["series"].append(for_terminal(v.window.key))
        columns["K"].append(str(v.k or "-"))
        columns["drafts"].append("-" if drafts is None else f"{drafts:.0f}")
        columns["tau"].append(_fmt(v.mean_acceptance_length))
        columns["95% CI"].append(f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "-")
        columns["baseline"].append(_fmt(v.baseline_tau))
        columns["r_1..r_3"].append(", ".join(f"{r:.2f}" for r in (v.acceptance_rate_per_pos or [])[:3]) or "-")
        columns["engine tau"].append(_fmt(v.window.reported.get("mean_acceptance_length")))
        columns["speedup"].append("-" if v.speedup is None else f"{v.speedup:.2f}x")
        columns["status"].append(
            "[bold red]ALERT: " + ", ".join(a.kind for a in v.alerts) + "[/]" if v.alerts else v.status
        )
    shown = [
        name for name, values in columns.items() if name in ("series", "tau", "status") or any(x != "-" for x in values)
    ]
    table = Table(title=title)
    for name in shown:
        table.add_column(name, justify="right" if name in ("K", "drafts", "tau", "speedup") else "left")
    for row in range(len(verdicts)):
        table.add_row(*(columns[name][row] for name in shown))
    return table


def verdict_line(v: WindowVerdict) -> str:
    """One line per series that survives any terminal width (and reads well in a cron mail)."""
    ci = v.mean_acceptance_length_ci
    parts = [f"{for_terminal(v.window.key)}: {v.status}"]
    if v.mean_acceptance_length is not None:
        parts.append(f"tau {v.mean_acceptance_length:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""))
        parts.append(f"{v.window.counts.num_drafts:.0f} drafts at K={v.k}")
    if v.baseline_tau is not None:
        parts.append(f"baseline {v.baseline_tau:.2f}")
    if v.speedup is not None:
        parts.append(f"net speedup {v.speedup:.2f}x")
    return ", ".join(parts)


def print_verdicts(console: Console, verdicts: list[WindowVerdict], *, lines: bool = True) -> None:
    """One line per series (unless ``lines`` is off: printed already),
    then every alert with its advice and the notes on each window."""
    for v in verdicts:
        if lines:
            console.print(verdict_line(v), soft_wrap=True)
        for alert in v.alerts:
            console.print(f"[bold red]ALERT[/] {alert.kind}: {for_terminal(alert.message)}", soft_wrap=True)
            for line in alert.advice:
                console.print(f"    {for_terminal(line)}", soft_wrap=True)
        for note in v.notes:
            console.print(f"note: {for_terminal(v.window.key)}: {for_terminal(note)}", soft_wrap=True)


def print_source_news(console: Console, watcher: Watcher, events_shown: int, notes_shown: set[str]) -> int:
    """Source events and notes not printed yet (each once); returns the number of events shown."""
    for event in watcher.events[events_shown:]:
        console.print(f"{event.kind}: {for_terminal(event.source)}: {for_terminal(event.message)}", soft_wrap=True)
    for note in watcher.source_notes():
        if note not in notes_shown:
            notes_shown.add(note)
            console.print(f"note: {for_terminal(note)}", soft_wrap=True)
    return len(watcher.events)


WATCH_JSON_VERSION = 1

EPILOG = """\b
Examples:
  dflash-doctor watch http://localhost:8000/metrics --once --window 60s --baseline runs/check-demo --json
  dflash-doctor watch /var/log/vllm.log --baseline 3.1 --exporter-port 9464"""


def watch_json(verdicts: list[WindowVerdict], window: str, session: WatchSession, code: int) -> dict[str, Any]:
    """`watch --once --json` (docs/user-guide.md "Machine-readable output"): one ``series`` entry per model/class, each
    the row ``windows.parquet`` stores; keys are only ever added, ``watch_json_version`` changes if one is
    renamed or removed."""
    return {
        "watch_json_version": WATCH_JSON_VERSION,
        "verdict": "alert" if any(v.alerts for v in verdicts) else "ok",
        "window": window,
        "series": [v.as_row() for v in verdicts],
        "events": [{"kind": e.kind, "source": e.source, "message": e.message} for e in session.watcher.events],
        "notes": session.watcher.source_notes(),
        "run_dir": str(session.run_dir),
        "exit_code": code,
    }


@app.command(epilog=EPILOG)
@opt.config_command("cost_profile", "out")
def watch(
    config: DoctorConfig,
    sources: Annotated[
        Optional[list[str]],
        typer.Argument(help="Engine /metrics URLs, log files, or captured responses (.jsonl).", show_default=False),
    ] = None,
    prometheus: Annotated[
        Optional[str],
        typer.Option(
            "--prometheus",
            help="A Prometheus server URL: each counter's increase over the window is read through its HTTP API.",
        ),
    ] = None,
    prometheus_header: Annotated[
        Optional[list[str]],
        typer.Option(
            "--prometheus-header",
            help=(
                "NAME=VALUE header sent to --prometheus (repeatable), e.g. "
                "'Authorization=Bearer $TOKEN' or X-Scope-OrgID=tenant; env:VAR or $VAR "
                "read the value from the environment. Never written to the run directory."
            ),
        ),
    ] = None,
    engine_api_key: Annotated[
        Optional[str],
        typer.Option(
            "--engine-api-key",
            envvar="OPENAI_API_KEY",
            show_envvar=True,
            help=(
                "Bearer token for the /metrics URLs (llama-server --api-key "
                "guards /metrics); env:VAR reads it from the environment."
            ),
        ),
    ] = None,
    engine: Annotated[
        Optional[str],
        typer.Option(
            "--engine", help="vllm | sglang | llamacpp | trtllm (default: detected from the metric names / log lines)."
        ),
    ] = None,
    model: Annotated[
        Optional[str], typer.Option("--model", help="Series name for sources without a model label (logs, llama.cpp).")
    ] = None,
    class_label: Annotated[
        Optional[str],
        typer.Option("--class-label", help="Label holding the request class (e.g. an SGLang custom label)."),
    ] = None,
    log_timezone: Annotated[
        Optional[str],
        typer.Option(
            "--log-timezone",
            help=(
                "Time zone of the log files' stamps, e.g. UTC or Europe/Berlin "
                "(default: this host's local zone, as vLLM/SGLang write them)."
            ),
        ),
    ] = None,
    window: Annotated[
        Optional[str],
        typer.Option(
            "--window",
            help=(
                "Window length: 30s, 5m, 1h (default 5m). With --once on a /metrics URL: scrape twice, this far apart."
            ),
        ),
    ] = None,
    interval: Annotated[
        Optional[str], typer.Option("--interval", help="Time between polls when watching live (default 30s).")
    ] = None,
    once: Annotated[
        bool,
        typer.Option(
            "--once",
            help=(
                "One verdict and exit: 0 ok, 1 alert, 2 bad input or no "
                "engine series in the sources, 70 a crash (for cron/CI)."
            ),
        ),
    ] = False,
    retain: Annotated[
        Optional[str],
        typer.Option(
            "--retain",
            help=(
                "Keep this much of the time series in the run directory, "
                "e.g. 7d (default: all); memory and disk stay flat."
            ),
        ),
    ] = None,
    duration: Annotated[
        Optional[str], typer.Option("--duration", help="Stop watching after this long (default: until Ctrl-C).")
    ] = None,
    baseline: Annotated[
        Optional[str], typer.Option("--baseline", help="A check/sweep run directory, or the expected tau (one number).")
    ] = None,
    threshold_tau: Annotated[
        Optional[float],
        typer.Option("--threshold-tau", help="Smallest tau drop below the baseline that alerts (default 0.2)."),
    ] = None,
    min_drafts: Annotated[
        Optional[int], typer.Option("--min-drafts", help="Windows with fewer drafts get no verdict (default 50).")
    ] = None,
    speedup_floor: Annotated[
        Optional[float], typer.Option("--speedup-floor", help="Net speedup below which to fall back (default 1.0).")
    ] = None,
    exporter_port: Annotated[
        Optional[int],
        typer.Option("--exporter-port", help="Serve watch's own verdict gauges for Prometheus/Alertmanager on PORT."),
    ] = None,
    exporter_address: Annotated[
        str,
        typer.Option(
            "--exporter-address", help="Address the exporter binds (0.0.0.0: scrapable from other hosts/pods)."
        ),
    ] = "127.0.0.1",
    on_alert: Annotated[
        Optional[str],
        typer.Option(
            "--on-alert",
            help=(
                "Command run when an alert starts (once per episode), with the "
                "alert, model and engine change in DFLASH_DOCTOR_* variables."
            ),
        ),
    ] = None,
    on_alert_webhook: Annotated[
        Optional[str],
        typer.Option("--on-alert-webhook", help="URL that receives the same alert as a JSON POST, once per episode."),
    ] = None,
    on_alert_dry_run: Annotated[
        bool,
        typer.Option(
            "--on-alert-dry-run", help="Print what --on-alert / --on-alert-webhook would run or post, and do neither."
        ),
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help=(
                "Start a new watch in --out, replacing the watch there (without it an earlier "
                "watch in --out is continued, and a folder holding anything else is refused)."
            ),
        ),
    ] = False,
    json_output: opt.Json = False,
) -> None:
    """Watch production acceptance: windowed tau per model/class, alerts vs a baseline, fallback advice.

    Exit codes: 0 ok; 1 an alert fired (--once: in the verdict; live: at any time before SIGTERM/SIGINT or
    --duration ended the watch); 2 bad input, or --out being written by another live process; 70 the watch
    crashed (a bug: restart it; the traceback is on stderr); 128 + N a second signal N cut it short. Off a
    terminal it prints one plain line per series per evaluation.

    --out is this process's for as long as it runs. An earlier watch there is continued (a restarted
    service, a cron --once on one folder): its windows, units and alerts are kept and the new ones
    appended; --overwrite starts a new watch in the folder instead.
    """
    if json_output and not once:
        raise UsageError("--json prints one verdict, so it needs --once; add --once or drop --json.")
    settings = build_watch_settings(
        config.watch,
        window=window,
        interval=interval,
        baseline=baseline,
        threshold_tau=threshold_tau,
        min_drafts=min_drafts,
        speedup_floor=speedup_floor,
        engine=engine,
        model=model,
        class_label=class_label,
        log_timezone=log_timezone,
        retain=retain,
    )
    hooks = AlertHooks(on_alert, on_alert_webhook, on_alert_dry_run)
    session = WatchSession(
        open_sources(
            list(sources or []),
            prometheus,
            settings,
            api_key=secret(engine_api_key, "--engine-api-key") if engine_api_key else None,
            prometheus_headers=header_flags(list(prometheus_header or []), "--prometheus-header"),
        ),
        settings,
        run_dir=Path(config.out) if config.out else None,
        config=config.as_dict(),
        costs=load_cost_profile(config.cost_profile) if config.cost_profile else None,
        once=once,
        exporter_port=exporter_port,
        exporter_address=exporter_address,
        hooks=hooks if hooks.enabled else None,
        overwrite=overwrite,
    )
    console = Console(stderr=json_output)
    if once:
        rounds = session.once()
        latest = rounds[-1] if rounds else []
        window = "latest window" if settings.window_given or len(rounds) > 1 else "since the server started"
        console.print(verdict_table(latest, window))
        print_verdicts(console, latest)
        session.close()
        print_source_news(console, session.watcher, 0, set())
        console.print(f"wrote {session.run_dir}", soft_wrap=True)
        if not latest:  # a monitor pointed at the wrong thing must not stay green: exit 2 as for a source that is down
            named = ", ".join([*(sources or []), *([prometheus] if prometheus else [])])
            raise UsageError(
                f"no speculative-decoding series in {named} (empty or unknown /metrics text, or a log without "
                f"spec-decode lines); point watch at the serving engine's /metrics URL or log file."
            )
        code = EXIT_ALERT if any(v.alerts for v in latest) else 0
        if json_output:
            print_json(watch_json(latest, window, session, code))
        if code:
            raise typer.Exit(code)
        return
    _watch_live(console, session, None if duration is None else parse_duration_s(duration))


class _StopRequests:
    """SIGTERM / SIGINT / SIGHUP end a live watch between evaluations: the one running finishes and is
    recorded, so the run directory a service manager leaves behind is complete (no half-written window).
    An evaluation always finishes soon (every scrape has a total deadline, serving/http.py); a second
    signal ends the watch at once, as an interrupt (exit 128 + the signal)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}

    def _stop(self, signum: int, frame: object) -> None:
        if self.event.is_set():
            raise Stopped(signum)
        self.event.set()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _watch_live(console: Console, session: WatchSession, stop_after_s: float | None) -> None:
    """Poll every interval until SIGTERM/SIGINT (or ``stop_after_s``), keeping the run directory current.

    On a terminal: a live table, alerts as they fire. Otherwise (a pipe, systemd's journal, docker or
    Kubernetes logs, where Rich's Live would print nothing until exit): one plain, time-stamped line per
    series per evaluation, alerts and notes below it, flushed at once. Exit 0, or 1 when an alert fired.
    """
    started = time.monotonic()
    alerted = False
    stop = _StopRequests()
    session.start()
    events_shown = 0
    notes_shown: set[str] = set()
    live = Live(console=console, auto_refresh=False) if console.is_terminal else None
    try:
        if live:
            live.start()
        while not stop.event.wait(session.settings.interval_s):
            verdicts = session.step()
            alerted = alerted or any(v.alerts for v in verdicts)
            if live:
                live.update(
                    verdict_table(verdicts, f"last {session.settings.window_s:g} s, at {time.strftime('%H:%M:%S')}"),
                    refresh=True,
                )
                print_verdicts(live.console, [v for v in verdicts if v.alerts])
            else:
                stamp = utc_now()
                for verdict in verdicts:
                    console.print(f"{stamp} {verdict_line(verdict)}", soft_wrap=True, highlight=False)
                print_verdicts(console, [v for v in verdicts if v.alerts], lines=False)
            events_shown = print_source_news(console, session.watcher, events_shown, notes_shown)
            console.file.flush()
            if stop_after_s is not None and time.monotonic() - started >= stop_after_s:
                break
    finally:
        if live:
            live.stop()
        stop.restore()
    session.close()
    print_source_news(console, session.watcher, events_shown, notes_shown)
    # soft_wrap: off a terminal Rich wraps at 80 columns, which split a long path off its "wrote" onto a line of
    # its own (a log reader, or a script taking the last line, then saw a bare path)
    console.print(f"wrote {session.run_dir}", soft_wrap=True)
    if alerted:
        raise typer.Exit(EXIT_ALERT)
