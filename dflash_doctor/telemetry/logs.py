"""Parsers for the speculative-decoding lines engines write to their logs, one per engine.

Every parser reads fields by their key (``Accepted: N tokens``), never by position: vLLM reordered the
fields of its line between versions (docs/engines.md). A line without the engine's marker is
ignored (logs are mostly other things); a line WITH the marker that does not parse is counted in
:class:`ParseProblems` and reported, never fatal. The format strings each parser follows, with the
source files they come from, are cited in tests/test_telemetry_logs.py.

* vLLM ``SpecDecoding metrics:`` - window sums (reset after each print, every ``VLLM_LOG_STATS_INTERVAL``
  = 10 s), logged at DEBUG while the engine is idle: so a quiet log is not a stopped draft.
  ``num_drafts`` = drafted / K with K the length of the per-position list (vLLM drafts K per step).
* SGLang ``Decode batch ... accept len: X, accept rate: Y`` - averages over the last
  ``--decode-log-interval`` forwards; no counts, so they are ``reported`` values only.
* llama.cpp ``draft acceptance = R (A accepted / G generated), mean len = X`` - one per finished
  request (slot); drafts = A / (X - 1), since X = 1 + A / drafts (rounded to 2 decimals in the log).
* TensorRT-LLM iteration stats (JSON objects from ``GET /metrics`` of trtllm-serve, saved one per line):
  ``specDecodingStats.numRequestsWithDraftTokens`` drafts, ``numDraftTokens``, ``numAcceptedTokens``.

Time stamps: vLLM, SGLang and TensorRT-LLM stamp their lines with the server's *local* wall-clock time and
no zone (Python logging's ``asctime``), so a line is read in the log's zone: the host's local zone unless
``--log-timezone`` names the server's (a log copied from a server elsewhere). Read as UTC, every line of a
live log on a host east or west of Greenwich would fall hours outside the current window. llama.cpp stamps
time since the server started, which needs no zone.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from dflash_doctor.errors import UsageError
from dflash_doctor.telemetry.counts import SeriesKey, SpecCounts
from dflash_doctor.telemetry.observation import Observation, ParseProblems

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def log_zone(name: str | None) -> _dt.tzinfo | None:
    """``--log-timezone``: an IANA zone name (``Europe/Berlin``, ``UTC``); None = the host's local zone."""
    if name is None:
        return None
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise UsageError(
            f"--log-timezone {name!r} is not a time zone name; pass an IANA name such as UTC or Europe/Berlin."
        ) from None


def wall_clock_s(stamp: _dt.datetime, zone: _dt.tzinfo | None) -> float:
    """Unix time of a log's zone-less wall-clock stamp read in ``zone`` (None: the host's local zone,
    daylight saving included, as the engine's logging wrote it)."""
    return stamp.timestamp() if zone is None else stamp.replace(tzinfo=zone).timestamp()


@dataclass
class LogContext:
    """What a line parser needs besides the line: the series key, the year (vLLM's date has none) and
    the zone the log's stamps are in (None: the host's local zone)."""

    model: str
    origin: str
    year: int
    problems: ParseProblems
    zone: _dt.tzinfo | None = None


def _number(pattern: str, text: str, cast: Callable[[str], float] = float) -> float | None:
    match = re.search(pattern, text)
    return None if match is None else cast(match.group(1))


# ---- vLLM -------------------------------------------------------------------------------------------

VLLM_MARKER = "SpecDecoding metrics:"
_VLLM_PREFIX = re.compile(
    r"\((?P<proc>[^()\s]+) pid=(?P<pid>\d+)\)\s+(?P<level>[A-Z]+)\s+(?P<ts>\d\d-\d\d \d\d:\d\d:\d\d)"
)


def _vllm_time(line: str, ctx: LogContext) -> float | None:
    match = _VLLM_PREFIX.search(line)
    if match is None:
        return None
    return wall_clock_s(_dt.datetime.strptime(f"{ctx.year}-{match.group('ts')}", "%Y-%m-%d %H:%M:%S"), ctx.zone)


def parse_vllm_line(line: str, ctx: LogContext) -> Observation | None:
    """A vLLM ``SpecDecoding metrics:`` line (plain or inside a JSON log record) -> one window's counts."""
    if VLLM_MARKER not in line:
        return None
    text, time_s = line, None
    if line.lstrip().startswith("{"):
        try:
            record = json.loads(line)
            text = str(record.get("message", ""))
            time_s = _asctime(record.get("asctime"), ctx)
        except (json.JSONDecodeError, AttributeError):
            pass
    body = text.split(VLLM_MARKER, 1)[1]
    accepted = _number(r"\bAccepted: (\d+) tokens", body, int)
    drafted = _number(r"\bDrafted: (\d+) tokens", body, int)
    per_pos_match = re.search(r"Per-position acceptance rate: ((?:\d+(?:\.\d+)?)(?:, \d+(?:\.\d+)?)*)", body)
    tau = _number(r"Mean acceptance length: (\d+(?:\.\d+)?)", body)
    rate = _number(r"Draft acceptance rate: (\d+(?:\.\d+)?)%", body)
    if accepted is None or drafted is None or per_pos_match is None:
        ctx.problems.add(ctx.origin, line)
        return None
    rates = [float(x) for x in per_pos_match.group(1).split(", ")]
    num_drafts = _vllm_num_drafts(drafted, accepted, rates, tau)
    reported = {
        name: value
        for name, value in (
            ("mean_acceptance_length", tau),
            ("draft_acceptance_rate", None if rate is None else rate / 100.0),
        )
        if value is not None
    }
    counts = SpecCounts(
        num_drafts=float(num_drafts),
        num_draft_tokens=float(drafted),
        num_accepted_tokens=float(accepted),
        num_accepted_tokens_per_pos=tuple(float(round(r * num_drafts)) for r in rates),
    )
    return Observation(
        SeriesKey(ctx.model),
        counts,
        cumulative=False,
        time_s=time_s or _vllm_time(text, ctx),
        reported=reported,
        origin=ctx.origin,
    )


def _vllm_num_drafts(drafted: float, accepted: float, rates: list[float], tau: float | None) -> float:
    """The line has no draft count: drafted / K is exact when every draft was full length (the usual
    case), which the printed tau confirms to its 2 decimals; otherwise (drafts cut short near
    max_tokens) accepted / sum(rates), since the rates are per-position counts over the same drafts."""
    full = drafted / len(rates)
    if tau is None or accepted == 0 or abs(1.0 + accepted / full - tau) <= 0.005 + 1e-9 or sum(rates) <= 0:
        return float(full)
    return float(round(accepted / sum(rates)))


def _asctime(value: object, ctx: LogContext) -> float | None:
    """A JSON log record's ``asctime`` (Python logging's local time, with or without vLLM's year-less date)."""
    if not isinstance(value, str):
        return None
    for fmt in ("%Y-%m-%d %H:%M:%S,%f", "%Y-%m-%d %H:%M:%S"):
        try:
            return wall_clock_s(_dt.datetime.strptime(value, fmt), ctx.zone)
        except ValueError:
            continue
    try:
        return wall_clock_s(_dt.datetime.strptime(f"{ctx.year}-{value}", "%Y-%m-%d %H:%M:%S"), ctx.zone)
    except ValueError:
        return None


# ---- SGLang -----------------------------------------------------------------------------------------

SGLANG_MARKER = "accept len:"
_SGLANG_TIME = re.compile(r"^\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)?")


def parse_sglang_line(line: str, ctx: LogContext) -> Observation | None:
    """An SGLang ``Decode batch ... accept len: X, accept rate: Y`` line -> reported averages (no counts)."""
    if "Decode batch" not in line or SGLANG_MARKER not in line:
        return None
    tau = _number(r"accept len: (\d+(?:\.\d+)?)", line)
    rate = _number(r"accept rate: (\d+(?:\.\d+)?)", line)
    running = _number(r"#running-req: (\d+)", line, int)
    if tau is None:
        ctx.problems.add(ctx.origin, line)
        return None
    time_match = _SGLANG_TIME.search(line.strip())
    time_s = None
    if time_match:
        time_s = wall_clock_s(_dt.datetime.strptime(time_match.group("ts"), "%Y-%m-%d %H:%M:%S"), ctx.zone)
    reported = {"mean_acceptance_length": tau}
    if rate is not None:
        reported["draft_acceptance_rate"] = rate
    if running is not None:
        reported["running_requests"] = float(running)
    return Observation(
        SeriesKey(ctx.model), SpecCounts(), cumulative=False, time_s=time_s, reported=reported, origin=ctx.origin
    )


# ---- llama.cpp --------------------------------------------------------------------------------------

LLAMACPP_MARKER = "draft acceptance"
_LLAMACPP_TIME = re.compile(r"^(?P<min>\d+)\.(?P<sec>\d\d)\.(?P<ms>\d{3})\.(?P<us>\d{3}) ")


def parse_llamacpp_line(line: str, ctx: LogContext) -> Observation | None:
    """A llama.cpp slot ``draft acceptance = ... (A accepted / G generated), mean len = X`` line -> one request.

    Both spellings are read: ``mean len`` (current) and ``mean acceptance length`` with an optional
    ``acceptance rate per position = (...)`` (the PR #24536 form); ``draft acceptance rate =`` (older).
    """
    if LLAMACPP_MARKER not in line or "generated" not in line:
        return None
    match = re.search(
        r"draft acceptance(?: rate)? = (?P<ratio>[\d.]+) \(\s*(?P<acc>\d+) accepted /\s*(?P<gen>\d+) generated\)", line
    )
    if match is None:
        ctx.problems.add(ctx.origin, line)
        return None
    accepted, generated = int(match.group("acc")), int(match.group("gen"))
    tau = _number(r"mean (?:acceptance length|len) =\s*(\d+(?:\.\d+)?)", line)
    per_pos_text = re.search(r"acceptance rate per position = \(([^)]*)\)", line)
    num_drafts = None
    if tau is not None and tau > 1.0:
        num_drafts = float(round(accepted / (tau - 1.0)))
    per_pos = None
    if per_pos_text and num_drafts:
        per_pos = tuple(float(round(float(x) * num_drafts)) for x in per_pos_text.group(1).split(","))
    time_match = _LLAMACPP_TIME.match(line.strip())
    time_s = None
    if time_match:  # llama.cpp stamps time since the server started (minutes.seconds.ms.us)
        time_s = int(time_match.group("min")) * 60 + int(time_match.group("sec")) + int(time_match.group("ms")) / 1e3
    counts = SpecCounts(
        num_drafts=num_drafts,
        num_draft_tokens=float(generated),
        num_accepted_tokens=float(accepted),
        num_accepted_tokens_per_pos=per_pos,
    )
    reported = {"draft_acceptance_rate": float(match.group("ratio"))}
    if tau is not None:
        reported["mean_acceptance_length"] = tau
    return Observation(
        SeriesKey(ctx.model), counts, cumulative=False, time_s=time_s, reported=reported, origin=ctx.origin
    )


# ---- TensorRT-LLM -----------------------------------------------------------------------------------


def parse_trtllm_line(line: str, ctx: LogContext) -> Observation | None:
    """One TensorRT-LLM iteration-stats JSON object (a line of a saved ``GET /metrics`` list)."""
    if "specDecodingStats" not in line:
        return None
    try:
        record = json.loads(line.strip().rstrip(","))
        stats = record["specDecodingStats"]
        drafts = float(stats["numRequestsWithDraftTokens"])
        draft_tokens = float(stats["numDraftTokens"])
        accepted = float(stats["numAcceptedTokens"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        ctx.problems.add(ctx.origin, line)
        return None
    time_s = None
    timestamp = record.get("timestamp")
    if isinstance(timestamp, str):
        try:
            time_s = wall_clock_s(_dt.datetime.strptime(timestamp[:19], "%m-%d-%Y %H:%M:%S"), ctx.zone)
        except ValueError:
            time_s = None
    reported = {}
    if isinstance(stats.get("acceptanceLength"), (int, float)):
        reported["mean_acceptance_length"] = float(stats["acceptanceLength"])
    counts = SpecCounts(num_drafts=drafts, num_draft_tokens=draft_tokens, num_accepted_tokens=accepted)
    return Observation(
        SeriesKey(ctx.model), counts, cumulative=False, time_s=time_s, reported=reported, origin=ctx.origin
    )


LOG_PARSERS: dict[str, Callable[[str, LogContext], Observation | None]] = {
    "vllm": parse_vllm_line,
    "sglang": parse_sglang_line,
    "llamacpp": parse_llamacpp_line,
    "trtllm": parse_trtllm_line,
}


def detect_log_server_kind(lines: Iterable[str]) -> str | None:
    """The engine whose marker appears first in ``lines`` (None if no line has one)."""
    for line in lines:
        if VLLM_MARKER in line:
            return "vllm"
        if "Decode batch" in line and SGLANG_MARKER in line:
            return "sglang"
        if LLAMACPP_MARKER in line and "generated" in line:
            return "llamacpp"
        if "specDecodingStats" in line:
            return "trtllm"
    return None


def parse_log_lines(
    lines: Iterable[str], *, server_kind: str, ctx: LogContext, first_line_number: int = 1
) -> Iterator[Observation]:
    """Observations from log lines; ``ctx.origin`` is updated to ``file:line`` for every line."""
    parser = LOG_PARSERS[server_kind]
    base = ctx.origin.rsplit(":", 1)[0] if ctx.origin.rsplit(":", 1)[-1].isdigit() else ctx.origin
    for number, raw in enumerate(lines, start=first_line_number):
        ctx.origin = f"{base}:{number}"
        observation = parser(_ANSI.sub("", raw.rstrip("\n")), ctx)
        if observation is not None and observation.counts.impossible() is not None:
            ctx.problems.add(ctx.origin, raw)  # refused as data: counts no engine can report
            continue
        if observation is not None:
            yield observation
