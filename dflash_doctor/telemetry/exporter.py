"""Optional Prometheus exporter of watch's own verdicts, for Alertmanager (``pip install dflash-doctor[exporter]``).

Gauges per series (labels ``model``, ``class``): the window's tau and its 95% interval's bounds
(``_lower`` / ``_upper``), the baseline, the net speedup, the drafts the window judged, and
``dflash_doctor_alert{kind=...}`` = 1 while an alert of that kind holds (0 otherwise, so an alert that
clears resolves in Alertmanager). Per watch: ``dflash_doctor_source_up{source}``, the time of the last
evaluation and ``dflash_doctor_build_info{version}``.

A value that becomes unknown (a window without drafts has no tau) and a series that is no longer
judged are removed, not left at their last value: a stale tau must not keep an alert rule quiet.
Served on 127.0.0.1 unless ``--exporter-address`` says otherwise (0.0.0.0 for a scrape from another pod).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from dflash_doctor.errors import UsageError
from dflash_doctor.telemetry.verdict import WindowVerdict

if TYPE_CHECKING:
    import prometheus_client

ALERT_KINDS = (
    "acceptance-drop",
    "drafting-stopped",
    "k-changed",
    "fallback",
    "collapse",
    "position-decay",
)  # verdict.py, alarms.py


def _prometheus_client():
    try:
        import prometheus_client
    except ImportError:
        raise UsageError(
            "--exporter-port needs prometheus-client; install it with `pip install 'dflash-doctor[exporter]'`."
        ) from None
    return prometheus_client


def _doctor_version() -> str:
    try:
        return version("dflash-doctor")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


class VerdictGauges:
    """The exporter's registry and gauges, and how a round of verdicts updates them (no server)."""

    def __init__(self) -> None:
        client = _prometheus_client()
        self.registry = client.CollectorRegistry()
        series = ("model", "class")

        def gauge(name: str, doc: str, labels: tuple[str, ...] = series) -> "prometheus_client.Gauge":
            return client.Gauge(name, doc, list(labels), registry=self.registry)

        # per series, value from the verdict (None -> the series is removed from that gauge)
        self.series_gauges = {
            "mean_acceptance_length": gauge(
                "dflash_doctor_mean_acceptance_length", "Window tau (1 + accepted/drafts, bonus included)."
            ),
            "lower": gauge(
                "dflash_doctor_mean_acceptance_length_lower", "Lower bound of the window tau's 95% interval."
            ),
            "upper": gauge(
                "dflash_doctor_mean_acceptance_length_upper", "Upper bound of the window tau's 95% interval."
            ),
            "baseline": gauge("dflash_doctor_baseline_mean_acceptance_length", "Baseline tau at the served K."),
            "speedup": gauge(
                "dflash_doctor_net_speedup", "Net speedup of the window over plain decoding (needs step costs)."
            ),
            "drafts": gauge("dflash_doctor_window_drafts", "Drafts (verify steps with a draft) counted in the window."),
        }
        self.alert = gauge(
            "dflash_doctor_alert", "1 while an alert of this kind holds for the series.", series + ("kind",)
        )
        self.source_up = gauge(
            "dflash_doctor_source_up", "1 when the source answered watch's last poll, 0 when it failed.", ("source",)
        )
        self.last_evaluation = gauge(
            "dflash_doctor_last_evaluation_timestamp_seconds", "Unix time of watch's last evaluation.", ()
        )
        client.Info(
            "dflash_doctor_build", "The dflash-doctor version serving these gauges.", registry=self.registry
        ).info({"version": _doctor_version()})
        self._series: set[tuple[str, str]] = set()
        self._shown: set[tuple[int, tuple[str, ...]]] = set()  # (gauge, labels) pairs holding a value

    @property
    def metric_names(self) -> set[str]:
        """The sample names a scrape can show (for dashboards and rules to be checked against)."""
        return {family.name + ("_info" if family.type == "info" else "") for family in self.registry.collect()}

    def publish(self, verdicts: list[WindowVerdict], source_up: dict[str, bool], evaluated_at_s: float) -> None:
        """One evaluation: set what is known, remove what is not, and drop series no longer judged."""
        current: set[tuple[str, str]] = set()
        for verdict in verdicts:
            labels = (verdict.window.key.model, verdict.window.key.cls)
            current.add(labels)
            ci = verdict.mean_acceptance_length_ci
            values = {
                "mean_acceptance_length": verdict.mean_acceptance_length,
                "lower": ci[0] if ci else None,
                "upper": ci[1] if ci else None,
                "baseline": verdict.baseline_tau,
                "speedup": verdict.speedup,
                "drafts": verdict.window.counts.num_drafts,
            }
            for name, value in values.items():
                self._set_or_remove(self.series_gauges[name], labels, value)
            kinds = {alert.kind for alert in verdict.alerts}
            for kind in ALERT_KINDS:
                self._set_or_remove(self.alert, (*labels, kind), 1.0 if kind in kinds else 0.0)
        for labels in self._series - current:
            for gauge in self.series_gauges.values():
                self._set_or_remove(gauge, labels, None)
            for kind in ALERT_KINDS:
                self._set_or_remove(self.alert, (*labels, kind), None)
        self._series = current
        for source, up in source_up.items():
            self.source_up.labels(source).set(1.0 if up else 0.0)
        self.last_evaluation.set(evaluated_at_s)

    def _set_or_remove(self, gauge: "prometheus_client.Gauge", labels: tuple[str, ...], value: float | None) -> None:
        shown = (id(gauge), labels)
        if value is not None:
            gauge.labels(*labels).set(value)
            self._shown.add(shown)
        elif shown in self._shown:
            gauge.remove(*labels)
            self._shown.discard(shown)


class VerdictExporter(VerdictGauges):
    """The gauges served over HTTP on ``address:port``."""

    def __init__(self, port: int, address: str = "127.0.0.1"):
        super().__init__()
        try:
            _prometheus_client().start_http_server(port, addr=address, registry=self.registry)
        except OSError as exc:
            raise UsageError(
                f"--exporter-port {port} cannot be bound on {address} "
                f"({exc.strerror}); pick a free port or another --exporter-address."
            ) from None
