"""Where production numbers come from: an engine's ``/metrics``, a Prometheus server, log files, captured responses.

Each source has ``poll()``, returning the :class:`Observation` s that appeared since the last poll, and
``notes`` (what the user should know, e.g. "this endpoint exports no speculative counters"). A source
that cannot be reached right now raises :class:`SourceUnavailable`; the watcher records the gap and keeps
going, and because engine counters are cumulative the next successful scrape still covers the gap, so
nothing is lost. Input that can never work (a file that does not exist, a URL that is not a URL) is a
:class:`UsageError` at construction time: one sentence, exit 2.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import time
import urllib.parse
from pathlib import Path
from typing import Mapping, Protocol

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.validation import finite_number
from dflash_doctor.serving.http import AUTH_STATUSES, HttpClient, Unreachable, bearer
from dflash_doctor.urls import shown
from dflash_doctor.telemetry.counts import SpecCounts
from dflash_doctor.telemetry.server_metrics import READERS, Reading, read_exposition
from dflash_doctor.telemetry.exposition import Exposition, Sample, parse_exposition
from dflash_doctor.telemetry.logs import LogContext, detect_log_server_kind, parse_log_lines
from dflash_doctor.telemetry.observation import AVERAGE_WEIGHT, Observation, ParseProblems
from dflash_doctor.telemetry.captured_responses import parse_response_lines

_log = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 10.0
# The whole of one scrape, body included: a page that never ends is cut here, so a live watch's evaluation
# always finishes (and a SIGTERM is acted on) well inside systemd's and Kubernetes' stop timeouts.
HTTP_DEADLINE_S = 15.0
# A failed scrape costs nothing (the next one's difference covers the gap), so a poll retries briefly
# rather than run into the next interval.
HTTP_RETRIES = 2
HTTP_BACKOFF_S = 0.5


class SourceUnavailable(Exception):
    """The source could not be read this time (connection refused, HTTP error, timeout)."""


class Source(Protocol):
    name: str
    notes: list[str]
    server_kind: str | None  # given, or detected by the first successful poll

    def poll(self) -> list[Observation]: ...


def _scrape_client(headers: Mapping[str, str] | None = None) -> HttpClient:
    return HttpClient(
        headers=headers,
        timeout_s=HTTP_TIMEOUT_S,
        retries=HTTP_RETRIES,
        backoff_s=HTTP_BACKOFF_S,
        deadline_s=HTTP_DEADLINE_S,
    )


def _http_get(client: HttpClient, url: str, auth_flag: str, params: Mapping[str, str] | None = None) -> str:
    """The body of a GET; any failure is :class:`SourceUnavailable` (a refusal of credentials names
    ``auth_flag``, the flag that sends them)."""
    try:
        answer = client.get(url, params=params)
    except Unreachable as exc:
        raise SourceUnavailable(str(exc)) from None
    if answer.status in AUTH_STATUSES:
        raise SourceUnavailable(
            f"{shown(url)} answered HTTP {answer.status}: it wants "
            f"credentials or refused the ones sent; pass them with {auth_flag}"
        )
    if not answer.ok:
        raise SourceUnavailable(f"{shown(url)} answered HTTP {answer.status}")
    return answer.text


def _check_url(url: str, what: str) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise UsageError(f"{what} {shown(url)!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8000/metrics.")
    return url


def _check_server_kind(server_kind: str | None) -> str | None:
    if server_kind is not None and server_kind not in READERS:
        raise UsageError(
            f"--engine {server_kind!r} is not one of {', '.join(READERS)}; pick one or leave it out to detect it."
        )
    return server_kind


def _note_once(notes: list[str], new: list[str]) -> None:
    for note in new:
        if note not in notes:
            notes.append(note)


class MetricsEndpoint:
    """Scrapes an engine's Prometheus text endpoint; every poll is one cumulative snapshot per series.

    ``api_key``: sent as a bearer token (llama-server started with ``--api-key`` guards /metrics too)."""

    def __init__(
        self,
        url: str,
        *,
        server_kind: str | None = None,
        model: str | None = None,
        class_label: str | None = None,
        api_key: str | None = None,
    ):
        self.url = _check_url(url, "source")
        self._client = _scrape_client(bearer(api_key) or None)
        self.server_kind = _check_server_kind(server_kind)
        # self.url keeps user:password@ for the request alone (the client turns it into an Authorization
        # header bound to this host); everything stored or printed uses the URL without it (dflash_doctor.urls.shown)
        self.model = model or urllib.parse.urlparse(shown(url)).netloc
        self.class_label = class_label
        self.name = shown(url)
        self.notes: list[str] = []
        self.last_text: str | None = None

    def poll(self) -> list[Observation]:
        text = _http_get(self._client, self.url, "--engine-api-key")
        self.last_text = text
        now = time.time()
        reading = read_exposition(
            parse_exposition(text), server_kind=self.server_kind, default_model=self.model, class_label=self.class_label
        )
        if reading.server_kind in READERS:
            self.server_kind = reading.server_kind  # detected once, then kept: the advice names this engine's settings
        _note_once(self.notes, reading.notes)
        return _observations(reading, now, self.name, cumulative=True)


def _observations(reading: Reading, now: float, origin: str, *, cumulative: bool) -> list[Observation]:
    keys = set(reading.counts) | set(reading.reported)
    result = []
    for key in sorted(keys):
        reported = dict(reading.reported.get(key, {}))
        if not cumulative:  # a Prometheus window's gauges are already averaged over it; no interval to derive
            reported.pop(AVERAGE_WEIGHT, None)
        if key in reading.configured_k:
            reported["configured_k"] = float(reading.configured_k[key])
        counts = reading.counts.get(key, SpecCounts())
        result.append(
            Observation(
                key,
                counts,
                cumulative=cumulative,
                time_s=now,
                reported=reported,
                origin=origin,
                averages_since_start=reading.averages_since_start if cumulative else (),
            )
        )
    return result


# The series watch reads from a Prometheus server, per engine: counters, and gauges (window averages the
# engine computed itself, averaged again over the window).
PROMETHEUS_COUNTERS = {
    "vllm": [
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "vllm:generation_tokens_total",
    ],
    "sglang": ["sglang:spec_verify_calls_total", "sglang:generation_tokens_total"],
    "llamacpp": [
        "llamacpp:spec_decode_num_drafts_total",
        "llamacpp:spec_decode_num_draft_tokens_total",
        "llamacpp:spec_decode_num_accepted_tokens_total",
        "llamacpp:spec_decode_num_accepted_tokens_per_pos_total",
        "llamacpp:tokens_predicted_total",
    ],
    "trtllm": [
        "trtllm_spec_decode_num_draft_tokens_total",
        "trtllm_spec_decode_num_accepted_tokens_total",
        "trtllm_spec_decode_drafted_tokens_total",
        "trtllm_spec_decode_accepted_tokens_total",
        "trtllm_generation_tokens_total",
    ],
}
PROMETHEUS_GAUGES = {
    "vllm": ["vllm:num_requests_running"],
    "sglang": ["sglang:spec_accept_length", "sglang:spec_accept_rate"],
    "trtllm": ["trtllm_spec_decode_acceptance_length"],
}


#: The longest duration a flag or config value may name (ten years): longer ones overflow timestamps.
MAX_DURATION_S = 10 * 365 * 86400.0


def parse_duration_s(text: str) -> float:
    """A Prometheus duration (``30s``, ``5m``, ``1h``) or plain seconds -> seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    text = str(text).strip()
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix) and text[: -len(suffix)].replace(".", "", 1).isdigit():
            seconds = float(text[: -len(suffix)]) * units[suffix]
            break
    else:
        try:
            seconds = float(text)
        except ValueError:
            raise UsageError(
                f"duration {text!r} is not a number of seconds or a Prometheus duration like 30s, 5m, 1h; fix it."
            ) from None
    # nan or inf seconds (or 1e400s) would pass every "> 0" check and make a window that never closes
    try:
        return finite_number(seconds, "duration", maximum=MAX_DURATION_S)
    except UsageError:
        raise UsageError(
            f"duration {text!r} is not a finite number of seconds "
            "up to ten years; use a duration such as 30s, 5m or 7d."
        ) from None


def counter_increase(values: list[float]) -> float:
    """How much a counter grew over its samples, a drop being a restart from zero (PromQL's reset rule)."""
    grown = 0.0
    for before, after in zip(values, values[1:]):
        grown += after if after < before else after - before
    return grown


class PrometheusServer:
    """Reads one window of every speculative counter from a Prometheus server's HTTP API.

    One range query per poll, ``{__name__=~"COUNTERS"}[W]``, returns every series' samples in the last W
    seconds; each series' increase is taken the way PromQL's ``rate()``/``increase()`` take it (a drop is
    a restart from zero) but without their extrapolation to the window edges: that extrapolation is
    capped at zero per series, so counters that were near zero when the window opened (the higher draft
    positions, a fresh server) get a different factor than the others and the ratios that make tau drift.
    Series are then summed per model (and class label) by the engine readers, like any scrape.

    ``headers`` go with every query: a managed Prometheus (Grafana Cloud, Mimir, Thanos behind a proxy)
    wants ``Authorization`` and often ``X-Scope-OrgID`` (``--prometheus-header``).
    """

    def __init__(
        self,
        url: str,
        *,
        window_s: float,
        server_kind: str | None = None,
        class_label: str | None = None,
        selector: str = "",
        headers: Mapping[str, str] | None = None,
    ):
        self.url = _check_url(url, "--prometheus").rstrip("/")
        self._client = _scrape_client(headers)
        self.server_kind = _check_server_kind(server_kind)
        self.window_s = window_s
        self.class_label = class_label
        self.selector = selector  # extra label matchers, e.g. job="vllm"
        self.name = f"prometheus {shown(self.url)}"
        self.notes: list[str] = []

    def _query(self, promql: str) -> list[dict]:
        try:
            payload = json.loads(
                _http_get(self._client, f"{self.url}/api/v1/query", "--prometheus-header", params={"query": promql})
            )
        except json.JSONDecodeError:
            raise SourceUnavailable(f"{shown(self.url)} did not answer with Prometheus API JSON") from None
        if payload.get("status") != "success":
            raise SourceUnavailable(f"Prometheus refused {promql!r}: {payload.get('error', 'no reason given')}")
        return payload["data"]["result"]

    def _selector(self, names: list[str]) -> str:
        pattern = "|".join(names)  # metric names hold no regex metacharacters
        extra = f",{self.selector}" if self.selector else ""
        return f'{{__name__=~"{pattern}"{extra}}}'

    def _detect_server_kind(self) -> str | None:
        for server_kind, counters in PROMETHEUS_COUNTERS.items():
            if self._query(f"count({self._selector(counters[:1])})"):
                return server_kind
        return None

    def poll(self) -> list[Observation]:
        server_kind = self.server_kind or self._detect_server_kind()
        if server_kind is None:
            _note_once(
                self.notes,
                [
                    f"{shown(self.url)} has no vllm:, sglang:, llamacpp: "
                    "or trtllm_ speculative counters in its TSDB (yet)."
                ],
            )
            return []
        self.server_kind = server_kind
        window = f"{int(round(self.window_s))}s"
        counters, gauges = PROMETHEUS_COUNTERS[server_kind], PROMETHEUS_GAUGES.get(server_kind, [])
        samples: list[Sample] = []
        last_time = 0.0
        for series in self._query(f"{self._selector(counters + gauges)}[{window}]"):
            labels = dict(series["metric"])
            name = labels.pop("__name__", "")
            values = [float(value) for _, value in series.get("values", [])]
            if not values:
                continue
            last_time = max(last_time, float(series["values"][-1][0]))
            value = counter_increase(values) if name in counters else sum(values) / len(values)
            samples.append(Sample(name, labels, value))
        reading = read_exposition(
            Exposition(samples), server_kind=server_kind, default_model=shown(self.url), class_label=self.class_label
        )
        _note_once(self.notes, reading.notes)
        return _observations(reading, last_time or time.time(), self.name, cumulative=False)


#: The longest line a followed log file is read with (the newline included). An engine's metrics line is far
#: shorter; a longer line (a dumped prompt, a binary blob, a log never ended by a newline) is skipped while it
#: is read, in small pieces, so it is never held whole in memory.
MAX_LINE_BYTES = 2**20
#: The same cap for captured responses: one line is a whole response body (its text, logprobs where asked).
MAX_RESPONSE_LINE_BYTES = 16 * 2**20
_SKIP_PIECE_BYTES = 2**16  # the rest of a line over the cap is read (and dropped) in pieces of this size


class _TailedFile:
    """Reads the lines appended to a file since the last call; starts over when the file shrank (rotation).

    Lines are read one at a time with a cap of ``max_line_bytes``: a longer line is passed over in
    small pieces (even while it is still being written, across calls), counted in
    ``skipped_long_lines`` and given to the caller as an empty line, so the line numbers of the lines after
    it stay right. An unterminated line shorter than the cap waits for its newline (it is read again).
    """

    def __init__(self, path: Path, max_line_bytes: int = MAX_LINE_BYTES):
        self.path = path
        self.max_line_bytes = max_line_bytes
        self.offset = 0
        self.line_number = 0
        self.skipped_long_lines = 0
        self._inside_long_line = False  # the offset is inside a line already counted as too long

    def new_lines(self) -> tuple[list[str], int]:
        try:
            size = self.path.stat().st_size
        except OSError as exc:
            raise SourceUnavailable(f"{self.path} could not be read ({exc.strerror})") from None
        if size < self.offset:  # truncated or rotated
            self.offset, self.line_number, self._inside_long_line = 0, 0, False
        first = self.line_number + 1
        lines: list[str] = []
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            while True:
                if self._inside_long_line:
                    piece = handle.readline(_SKIP_PIECE_BYTES)
                    if not piece:
                        break  # still being written: go on skipping it next time
                    self.offset += len(piece)
                    if piece.endswith(b"\n"):
                        self._inside_long_line = False
                        self.line_number += 1
                        lines.append("")  # its place, so the next lines keep their numbers
                    continue
                line = handle.readline(self.max_line_bytes + 1)
                if line.endswith(b"\n") and len(line) <= self.max_line_bytes:
                    self.offset += len(line)
                    pieces = line.decode(
                        "utf-8", errors="replace"
                    ).splitlines()  # a lone \r (a progress bar) parts lines too
                    self.line_number += len(pieces)
                    lines.extend(pieces)
                elif (
                    len(line) > self.max_line_bytes
                ):  # over the cap, terminated or not: counted once, skipped to its end
                    self.offset += len(line)
                    self.skipped_long_lines += 1
                    self._inside_long_line = True
                else:
                    break  # the end of the file, or a short line not ended yet: read again next time
        return lines, first


#: ``scheme://user:password@`` in any text that looks like a URL (a Path folds ``//`` to ``/``): the credentials go.
_USERINFO = re.compile(r"(^[A-Za-z][\w+.-]*:/+)[^/\s@]*@")
_KEEP_SCHEME = r"\1"


def _existing_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise UsageError(
            f"source {_USERINFO.sub(_KEEP_SCHEME, str(path))} is neither an http(s) URL "
            "nor an existing file; pass a /metrics URL, a log file or a responses .jsonl."
        )
    return path


class _FollowedFile:
    """A file read as it grows, whose unreadable lines are counted into one note."""

    what = "metrics"  # named in the note about unreadable lines
    max_line_bytes = MAX_LINE_BYTES  # a longer line is skipped unread (see _TailedFile)

    def __init__(self, path: str | Path, *, model: str | None = None):
        self.path = _existing_file(path)
        self.model = model or self.path.stem
        self.name = str(self.path)
        self.notes: list[str] = []
        self.problems = ParseProblems()
        self._tail = _TailedFile(self.path, self.max_line_bytes)
        self._warned_long_lines = False

    def _note_problems(self) -> None:
        message = self.problems.message(self.what)
        if message:
            self.notes = [n for n in self.notes if "could not be read" not in n] + [message]
        skipped = self._tail.skipped_long_lines
        if skipped:
            cap = f"{self.max_line_bytes / 2**20:g} MiB"
            if not self._warned_long_lines:
                _log.warning("%s has a line longer than %s; lines that long are skipped, not read", self.name, cap)
                self._warned_long_lines = True
            self.notes = [n for n in self.notes if "longer than" not in n] + [
                f"{skipped} line(s) of {self.name} longer than {cap} were skipped unread"
            ]


class LogFile(_FollowedFile):
    """An engine's log file (followed as it grows); the engine is detected from the first metrics line."""

    def __init__(
        self,
        path: str | Path,
        *,
        server_kind: str | None = None,
        model: str | None = None,
        year: int | None = None,
        zone: datetime.tzinfo | None = None,
    ):
        """``zone``: the zone the log's stamps are written in (None: this host's local zone, see logs.py)."""
        super().__init__(path, model=model)
        self.server_kind = _check_server_kind(server_kind)
        self.zone = zone
        self._year = year or datetime.datetime.fromtimestamp(self.path.stat().st_mtime, zone).year

    def poll(self) -> list[Observation]:
        lines, first = self._tail.new_lines()
        if self.server_kind is None:
            self.server_kind = detect_log_server_kind(lines)
            if self.server_kind is None:
                return []
        self.what = f"{self.server_kind} metrics"
        ctx = LogContext(model=self.model, origin=self.name, year=self._year, problems=self.problems, zone=self.zone)
        observations = list(parse_log_lines(lines, server_kind=self.server_kind, ctx=ctx, first_line_number=first))
        self._note_problems()
        return observations


class ResponsesFile(_FollowedFile):
    """Captured responses, one JSON object per line (see :mod:`.responses`); followed as it grows."""

    what = "response"
    max_line_bytes = MAX_RESPONSE_LINE_BYTES
    server_kind: str | None = None  # each line names its own engine by its fields

    def poll(self) -> list[Observation]:
        lines, first = self._tail.new_lines()
        observations = list(
            parse_response_lines(
                lines, default_model=self.model, origin=self.name, problems=self.problems, first_line_number=first
            )
        )
        self._note_problems()
        return observations


def _looks_like_responses(path: Path) -> bool:
    """A JSONL file of response bodies (not TensorRT-LLM iteration stats, which the log parser reads)."""
    with path.open("rb") as handle:  # lines read with a cap: the first one may be a huge unterminated one
        while line := handle.readline(MAX_LINE_BYTES):
            stripped = line.strip()
            if stripped:
                return stripped.startswith(b"{") and b"specDecodingStats" not in stripped
    return False


def open_source(
    spec: str,
    *,
    server_kind: str | None = None,
    model: str | None = None,
    class_label: str | None = None,
    log_zone: datetime.tzinfo | None = None,
    api_key: str | None = None,
) -> Source:
    """A SOURCE argument: an http(s) URL is scraped (with ``api_key`` as its bearer token); a file is a log,
    or captured responses if it holds JSON objects."""
    if spec.startswith(("http://", "https://")):
        return MetricsEndpoint(spec, server_kind=server_kind, model=model, class_label=class_label, api_key=api_key)
    path = _existing_file(spec)
    if _looks_like_responses(path):
        return ResponsesFile(path, model=model)
    return LogFile(path, server_kind=server_kind, model=model, zone=log_zone)
