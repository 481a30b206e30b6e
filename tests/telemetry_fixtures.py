"""Test helpers for watch: a small exporter serving captured real metric text, the real Prometheus binary,
watch run directories written through the real WatchRecord (:func:`write_watch`), and a synthetic counter
source for watches on a simulated clock (:class:`SyntheticCounters`, shared with benchmarks/watch_soak.py).

The exporter is an HTTP server in a thread whose ``/metrics`` text the test swaps (scrape N returns
capture N), or makes fail (HTTP 500) to simulate a scrape failing mid-watch. Prometheus (Debian's
``prometheus`` package) is started on 127.0.0.1 with a scrape config pointing at that exporter and
stopped by its own process id.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from dflash_doctor.telemetry.counts import SeriesKey, SpecCounts
from dflash_doctor.telemetry.observation import Observation
from dflash_doctor.telemetry.watch_record import WatchRecord
from dflash_doctor.telemetry.verdict import Baseline, Judge, Thresholds
from dflash_doctor.telemetry.watcher import Unit, Window
from local_servers import LocalServer, QuietHandler, ThreadedServer, free_port, start_local_server

DATA = Path(__file__).parent / "data" / "telemetry"


class MetricsExporter(ThreadedServer):
    """Serves ``self.text`` on /metrics (or HTTP 500 while ``self.failing``); ``scrapes`` counts requests."""

    def __init__(self, text: str = ""):
        self.text = text
        self.failing = False
        self.scrapes = 0
        exporter = self

        class Handler(QuietHandler):
            def do_GET(self):  # noqa: N802 (http.server API)
                exporter.scrapes += 1
                if exporter.failing or not self.path.startswith("/metrics"):
                    self.reply(500 if exporter.failing else 404)
                    return
                self.reply(200, exporter.text.encode(), "text/plain; version=0.0.4")

        super().__init__(Handler)
        self.url = f"{self.base_url}/metrics"


class PrometheusServer:
    """The real Prometheus binary scraping ``targets`` every second, started and stopped as the engine servers are."""

    def __init__(self, targets: list[str], workdir: Path, *, scrape_interval: str = "1s"):
        self.binary = shutil.which("prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {scrape_interval}\n"
            "scrape_configs:\n"
            "  - job_name: engine\n"
            "    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n",
            encoding="utf-8",
        )
        self.command = [
            self.binary or "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.log = workdir / "prometheus.log"
        self.server: LocalServer | None = None

    def __enter__(self) -> "PrometheusServer":
        if self.binary is None:
            raise RuntimeError(
                "the prometheus binary is not on PATH; install Debian's "
                "package: apt-get install prometheus (.ci/run does)"
            )
        self.server = start_local_server("prometheus", self.command, self.url, "/-/ready", self.log, timeout_s=60)
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()

    def query(self, promql: str) -> list[dict]:
        from urllib.parse import urlencode

        with urllib.request.urlopen(f"{self.url}/api/v1/query?" + urlencode({"query": promql}), timeout=10) as response:
            return json.loads(response.read())["data"]["result"]

    def wait_for_samples(self, promql: str, count: int, timeout_s: float = 60.0) -> None:
        """Wait until ``count_over_time``-style queries see enough samples (Prometheus needs >= 2 for rate())."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            result = self.query(promql)
            if result and float(result[0]["value"][1]) >= count:
                return
            time.sleep(0.5)
        raise RuntimeError(f"prometheus never had {count} samples for {promql}")


class AuthGateway(ThreadedServer):
    """A managed Prometheus's front door (Grafana Cloud, Mimir): the API under a path prefix, answering
    HTTP 401 unless every header of ``required`` came with the request, else forwarding to ``upstream``."""

    def __init__(self, upstream: str, required: dict[str, str], prefix: str = "/api/prom"):
        self.refused = 0
        gateway = self

        class Handler(QuietHandler):
            def do_GET(self):  # noqa: N802 (http.server API)
                if not self.path.startswith(prefix) or any(self.headers.get(k) != v for k, v in required.items()):
                    gateway.refused += 1
                    self.reply(401)
                    return
                with urllib.request.urlopen(upstream + self.path[len(prefix) :], timeout=10) as response:
                    self.reply(200, response.read(), "application/json")

        super().__init__(Handler)
        self.url = f"{self.base_url}{prefix}"


WATCH_K = 4  # draft tokens per step of the watches write_watch writes


def unit_counts(drafts: float, rates: Sequence[float], generated: float | None = None) -> SpecCounts:
    """Counts of ``drafts`` drafts of ``len(rates)`` tokens, slot i accepted at ``rates[i]`` (whole tokens, as
    an engine counts them)."""
    per_pos = tuple(float(round(r * drafts)) for r in rates)
    return SpecCounts(
        num_drafts=float(drafts),
        num_draft_tokens=float(drafts * len(rates)),
        num_accepted_tokens=float(sum(per_pos)),
        num_accepted_tokens_per_pos=per_pos,
        num_generated_tokens=generated if generated is not None else drafts + sum(per_pos),
    )


class SyntheticCounters:
    """A vLLM-shaped source of cumulative counters for a watch on a simulated clock: every poll, each of
    ``models`` has drafted ``drafts_per_poll`` more drafts, slot i accepted at ``rates[i]``, so each window's
    tau is ``1 + sum(rates)`` however many polls it spans. No HTTP: the watch polls it directly."""

    name = "synthetic /metrics"
    server_kind = "vllm"

    def __init__(self, rates: Sequence[float], models: Sequence[str] = ("qwen3-8b",), drafts_per_poll: int = 100):
        self.rates = tuple(rates)
        self.models = tuple(models)
        self.drafts_per_poll = drafts_per_poll
        self.notes: list[str] = []
        self.polls = 0

    def poll(self) -> list[Observation]:
        self.polls += 1
        counts = unit_counts(self.drafts_per_poll * self.polls, self.rates)
        return [Observation(SeriesKey(model), counts, cumulative=True) for model in self.models]


def directory_bytes(path: Path) -> int:
    """Bytes of every file below ``path``: a run directory's size on disk."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_watch(
    run_dir: Path,
    rates: list[float],
    *,
    baseline_tau: float | None = None,
    classes=("code", "chat"),
    num_units: int = 8,
    model: str = "m",
    notes: tuple[str, ...] = (),
) -> Path:
    """A finished watch of ``num_units`` scrape intervals per class, one window per interval (live-watch shape),
    replacing a watch already in ``run_dir`` (``--overwrite``)."""
    thresholds = Thresholds(min_drafts=10)
    judge = Judge(Baseline.fixed({"overall": baseline_tau}) if baseline_tau else None, thresholds, server_kind="vllm")
    record = WatchRecord(
        run_dir,
        {"config": "test"},
        {
            "sources": ["http://x/metrics"],
            "window_s": 60.0,
            "interval_s": 60.0,
            "baseline": "fixed",
            "thresholds": dataclasses.asdict(thresholds),
        },
        overwrite=True,
    )
    for i in range(num_units):
        verdicts, units = [], []
        for cls in classes:
            counts = unit_counts(200 + 10 * i, rates)
            key = SeriesKey(model, cls)
            units.append(Unit(key, 1_700_000_000.0 + 60 * i, counts, {}, "http://x/metrics"))
            verdicts.append(
                judge.judge(Window(key, 1_700_000_000.0 + 60 * (i - 1), 1_700_000_000.0 + 60 * i, counts, [counts]))
            )
        record.update(verdicts, units, [], list(notes) if i == 0 else [])
    record.close()  # a finished watch: its journal consolidated into the Parquet files
    return run_dir
