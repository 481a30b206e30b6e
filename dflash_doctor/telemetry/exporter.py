"""Optional Prometheus exporter of watch's own verdicts, for Alertmanager (``pip install dflash-doctor[exporter]``).

Gauges per series (labels ``model``, ``class``): the window's tau and its interval, the baseline, the
net speedup, and ``dflash_doctor_alert{kind=...}`` = 1 while an alert of that kind holds (0 otherwise,
so an alert that clears resolves in Alertmanager). Served on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

from dflash_doctor.errors import UsageError
from dflash_doctor.telemetry.verdict import WindowVerdict

ALERT_KINDS = ("acceptance-drop", "drafting-stopped", "k-changed", "fallback")


class VerdictExporter:
    def __init__(self, port: int, address: str = "127.0.0.1"):
        try:
            import prometheus_client
        except ImportError:
            raise UsageError("--exporter-port needs prometheus-client; install it with `pip install 'dflash-doctor[exporter]'`.") from None
        self._registry = prometheus_client.CollectorRegistry()
        labels = ["model", "class"]

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> "prometheus_client.Gauge":
            return prometheus_client.Gauge(name, doc, labels + list(extra), registry=self._registry)

        self.tau = gauge("dflash_doctor_mean_acceptance_length", "Window tau (1 + accepted/drafts, bonus included).")
        self.tau_lo = gauge("dflash_doctor_mean_acceptance_length_lo", "Lower bound of the window tau's 95% interval.")
        self.tau_hi = gauge("dflash_doctor_mean_acceptance_length_hi", "Upper bound of the window tau's 95% interval.")
        self.baseline = gauge("dflash_doctor_baseline_mean_acceptance_length", "Baseline tau at the served K.")
        self.speedup = gauge("dflash_doctor_net_speedup", "Net speedup of the window over plain decoding (needs step costs).")
        self.alert = gauge("dflash_doctor_alert", "1 while an alert of this kind holds for the series.", ("kind",))
        try:
            prometheus_client.start_http_server(port, addr=address, registry=self._registry)
        except OSError as exc:
            raise UsageError(f"--exporter-port {port} cannot be bound on {address} ({exc.strerror}); pick a free port.") from None

    def publish(self, verdicts: list[WindowVerdict]) -> None:
        for verdict in verdicts:
            labels = {"model": verdict.window.key.model, "class": verdict.window.key.cls}
            for gauge, value in (
                (self.tau, verdict.mean_acceptance_length),
                (self.tau_lo, verdict.mean_acceptance_length_ci[0] if verdict.mean_acceptance_length_ci else None),
                (self.tau_hi, verdict.mean_acceptance_length_ci[1] if verdict.mean_acceptance_length_ci else None),
                (self.baseline, verdict.baseline_tau),
                (self.speedup, verdict.speedup),
            ):
                if value is not None:
                    gauge.labels(**labels).set(value)
            kinds = {alert.kind for alert in verdict.alerts}
            for kind in ALERT_KINDS:
                self.alert.labels(**labels, kind=kind).set(1.0 if kind in kinds else 0.0)
