"""``watch --on-alert CMD`` / ``--on-alert-webhook URL``: let an alert act, once per alert episode.

The doctor never changes a server itself; the operator's command may. It runs (or the webhook receives a
JSON POST) when an alert *starts*: an episode of one alert kind on one series begins with the first window
that raises it and ends with the first window judged without it (``ok``, or an alert of another kind).
Windows that carry no verdict (idle, no data, too few drafts, the source unreadable) neither end an
episode nor start one, so a quiet minute inside a long drop does not fire the hook again.

What the command gets, in its environment (the webhook gets the same fields as JSON):

* ``DFLASH_DOCTOR_ALERT``: the kind (``acceptance-drop``, ``drafting-stopped``, ``k-changed``, ``fallback``, ...)
* ``DFLASH_DOCTOR_MODEL``, ``DFLASH_DOCTOR_CLASS``: the series
* ``DFLASH_DOCTOR_MESSAGE``: the alert with its numbers
* ``DFLASH_DOCTOR_ADVICE``: the exact engine change, one line per engine setting (empty when none applies)
* ``DFLASH_DOCTOR_ENGINE``, ``DFLASH_DOCTOR_K``, ``DFLASH_DOCTOR_TAU``, ``DFLASH_DOCTOR_BASELINE_TAU``,
  ``DFLASH_DOCTOR_BEST_K`` (the priced K that pays, with step costs), ``DFLASH_DOCTOR_RUN_DIR``
* ``DFLASH_DOCTOR_ALERT_JSON``: all of the above as one JSON object

The command is split like a shell would (``shlex``) but not run through one (pass ``sh -c '...'`` for
pipes); it runs in the background so a slow restart does not stall the watch, and its exit status is
reported as an event. ``--on-alert-dry-run`` prints what would run or be posted, and does neither.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_doctor.errors import UsageError
from dflash_doctor.serving.http import HttpClient, Unreachable
from dflash_doctor.telemetry.verdict import WindowVerdict
from dflash_doctor.telemetry.watcher import Event

HOOK_EVENT = "alert-hook"
WEBHOOK_TIMEOUT_S = 10.0
WEBHOOK_RETRIES = 1  # one more try on a refused connection or a 5xx: a lost alert is worse than a repeated one
JUDGED = ("ok", "alert")  # statuses that carry a verdict: only they end an episode


def alert_fields(verdict: WindowVerdict, kind: str, server_kind: str | None, run_dir: Path) -> dict[str, str]:
    """The environment of the hook for one alert of ``verdict`` (strings; empty when unknown)."""
    alert = next(a for a in verdict.alerts if a.kind == kind)

    def text(value: object) -> str:
        return "" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)

    return {
        "DFLASH_DOCTOR_ALERT": kind,
        "DFLASH_DOCTOR_MODEL": verdict.window.key.model,
        "DFLASH_DOCTOR_CLASS": verdict.window.key.cls,
        "DFLASH_DOCTOR_MESSAGE": alert.message,
        "DFLASH_DOCTOR_ADVICE": "\n".join(alert.advice),
        "DFLASH_DOCTOR_ENGINE": server_kind or "",
        "DFLASH_DOCTOR_K": text(verdict.k),
        "DFLASH_DOCTOR_TAU": text(verdict.mean_acceptance_length),
        "DFLASH_DOCTOR_BASELINE_TAU": text(verdict.baseline_tau),
        "DFLASH_DOCTOR_BEST_K": text(verdict.best_k),
        "DFLASH_DOCTOR_RUN_DIR": str(run_dir),
    }


@dataclass
class AlertHooks:
    """Fires the operator's command and/or webhook at the start of each alert episode."""

    command: str | None = None
    webhook: str | None = None
    dry_run: bool = False
    run_dir: Path = Path(".")
    _argv: list[str] = field(init=False, default_factory=list)
    _open: set[tuple[str, str, str]] = field(init=False, default_factory=set)  # (model, class, kind) in an episode
    _running: list[tuple[subprocess.Popen, str]] = field(init=False, default_factory=list)
    _client: HttpClient = field(
        init=False, default_factory=lambda: HttpClient(timeout_s=WEBHOOK_TIMEOUT_S, retries=WEBHOOK_RETRIES)
    )

    def __post_init__(self) -> None:
        if self.command is not None:
            try:
                self._argv = shlex.split(self.command)
            except ValueError as exc:
                raise UsageError(
                    f"--on-alert {self.command!r} cannot be split into a command ({exc}); fix its quoting."
                ) from None
            if not self._argv:
                raise UsageError(
                    "--on-alert is empty; pass the command to run, e.g. --on-alert /etc/dflash-doctor/on-alert.sh."
                )
        if self.webhook is not None and not self.webhook.startswith(("http://", "https://")):
            raise UsageError(
                f"--on-alert-webhook {self.webhook!r} is not an http(s) URL; pass the URL that receives the alert JSON."
            )

    @property
    def enabled(self) -> bool:
        return bool(self._argv) or self.webhook is not None

    def handle(self, verdicts: list[WindowVerdict], server_kind: str | None, now_s: float | None = None) -> list[Event]:
        """Start the hooks for alerts that begin an episode in this round; events say what was done."""
        now_s = time.time() if now_s is None else now_s
        events = self._reap(now_s)
        for verdict in verdicts:
            key = verdict.window.key
            kinds = {alert.kind for alert in verdict.alerts}
            if verdict.status in JUDGED:
                self._open -= {
                    episode for episode in self._open if episode[:2] == (key.model, key.cls) and episode[2] not in kinds
                }
            for kind in sorted(kinds):
                episode = (key.model, key.cls, kind)
                if episode in self._open:
                    continue
                self._open.add(episode)
                events.extend(self._fire(alert_fields(verdict, kind, server_kind, self.run_dir), now_s))
        return events

    def _fire(self, fields: dict[str, str], now_s: float) -> list[Event]:
        series = f"{fields['DFLASH_DOCTOR_MODEL']} [{fields['DFLASH_DOCTOR_CLASS']}]"
        what = f"{fields['DFLASH_DOCTOR_ALERT']} on {series}"
        payload = json.dumps(fields)
        events = []
        if self._argv:
            if self.dry_run:
                env_text = " ".join(f"{k}={shlex.quote(v)}" for k, v in fields.items())
                events.append(
                    Event(
                        now_s,
                        HOOK_EVENT,
                        self.command or "",
                        f"dry run, would run for {what}: {env_text} {shlex.join(self._argv)}",
                    )
                )
            else:
                try:
                    process = subprocess.Popen(
                        self._argv,
                        env={**os.environ, **fields, "DFLASH_DOCTOR_ALERT_JSON": payload},
                        stdin=subprocess.DEVNULL,
                    )
                except OSError as exc:
                    events.append(
                        Event(
                            now_s, HOOK_EVENT, self.command or "", f"could not start for {what}: {exc.strerror or exc}"
                        )
                    )
                else:
                    self._running.append((process, what))
                    events.append(
                        Event(now_s, HOOK_EVENT, self.command or "", f"started for {what} (pid {process.pid})")
                    )
        if self.webhook is not None:
            events.append(Event(now_s, HOOK_EVENT, self.webhook, self._post(fields, payload, what)))
        return events

    def _post(self, fields: dict[str, str], payload: str, what: str) -> str:
        if self.dry_run:
            return f"dry run, would POST for {what}: {payload}"
        try:
            answer = self._client.request("POST", self.webhook or "", payload=fields)
        except Unreachable as exc:
            return f"could not post {what}: {exc}"
        return f"posted {what} (HTTP {answer.status})"

    def _reap(self, now_s: float) -> list[Event]:
        """Events for commands that finished since the last round."""
        events, running = [], []
        for process, what in self._running:
            status = process.poll()
            if status is None:
                running.append((process, what))
            else:
                events.append(Event(now_s, HOOK_EVENT, self.command or "", f"for {what} exited with status {status}"))
        self._running = running
        return events

    def close(self, timeout_s: float = 30.0) -> list[Event]:
        """At the end of a watch: wait (up to ``timeout_s``) for commands still running, report them."""
        deadline = time.monotonic() + timeout_s
        for process, _ in self._running:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                pass
        return self._reap(time.time())
