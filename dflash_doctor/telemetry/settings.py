"""``watch`` settings: the ``[watch]`` table of doctor.toml, overridden by flags, validated once.

```toml
[watch]
window = "5m"            # length of a window (Prometheus duration or seconds)
interval = "30s"         # time between polls when watching live
baseline = "runs/check-2026-11-30"   # a check/sweep run directory, or one tau for every class
threshold_tau = 0.2      # smallest tau drop that alerts (with separated intervals)
min_drafts = 50          # windows with fewer drafts get no verdict
speedup_floor = 1.0      # net speedup below this says "fall back"
engine = "vllm"          # vllm | sglang | llamacpp | trtllm (default: detected)
model = "my-model"       # series name for sources without a model label (logs, llama.cpp)
class_label = "cls"      # label carrying the request class (SGLang custom labels, relabelled series)
log_timezone = "UTC"     # zone of the log files' time stamps (default: this host's local zone)
retain = "7d"            # drop windows and units older than this from the run directory (default: keep all)
[watch.baseline_tau]     # or fixed tau per class (instead of `baseline`)
code = 2.4
chat = 1.7
```
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dflash_doctor.errors import UsageError
from dflash_doctor.telemetry.server_metrics import READERS
from dflash_doctor.telemetry.logs import log_zone
from dflash_doctor.telemetry.sources import parse_duration_s
from dflash_doctor.telemetry.verdict import DEFAULT_MIN_DRAFTS, DEFAULT_SPEEDUP_FLOOR, Thresholds
from dflash_doctor.stats.gate import DEFAULT_THRESHOLD_TAU

DEFAULT_WINDOW_S = 300.0
DEFAULT_INTERVAL_S = 30.0


@dataclass(frozen=True)
class WatchSettings:
    window_s: float = DEFAULT_WINDOW_S
    interval_s: float = DEFAULT_INTERVAL_S
    window_given: bool = False  # --once on /metrics: with a window, two scrapes; without, counts since start
    baseline: Any = None  # run directory, tau, or {class: tau}
    threshold_tau: float = DEFAULT_THRESHOLD_TAU
    min_drafts: int = DEFAULT_MIN_DRAFTS
    speedup_floor: float = DEFAULT_SPEEDUP_FLOOR
    server_kind: str | None = None
    model: str | None = None
    class_label: str | None = None
    log_timezone: str | None = None  # IANA zone of the logs' stamps; None = this host's local zone
    retain_s: float | None = None  # how far back the run directory's time series reach; None = the whole watch

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(self.threshold_tau, self.min_drafts, self.speedup_floor)


_FILE_KEYS = {
    "window",
    "interval",
    "baseline",
    "baseline_tau",
    "threshold_tau",
    "min_drafts",
    "speedup_floor",
    "engine",
    "model",
    "class_label",
    "log_timezone",
    "retain",
}


def build_watch_settings(table: dict[str, Any], **flags: Any) -> WatchSettings:
    """Merge the ``[watch]`` table with flags (a flag of None = not given) and validate."""
    unknown = sorted(set(table) - _FILE_KEYS)
    if unknown:
        raise UsageError(f"[watch] has unknown key(s) {', '.join(unknown)}; use {', '.join(sorted(_FILE_KEYS))}.")
    merged = {key: value for key, value in table.items() if key != "baseline_tau"}
    if "baseline_tau" in table:
        if "baseline" in table:
            raise UsageError("[watch] has both baseline and baseline_tau; keep one.")
        if not isinstance(table["baseline_tau"], dict):
            raise UsageError(
                "[watch] baseline_tau must be a table of class = tau, e.g. [watch.baseline_tau] code = 2.4."
            )
        merged["baseline"] = dict(table["baseline_tau"])
    merged.update({key: value for key, value in flags.items() if value is not None})
    values: dict[str, Any] = {}
    if "window" in merged:
        values["window_s"] = parse_duration_s(merged["window"])
        values["window_given"] = True
    if "interval" in merged:
        values["interval_s"] = parse_duration_s(merged["interval"])
    if "retain" in merged:
        values["retain_s"] = parse_duration_s(merged["retain"])
    for name in ("baseline", "model", "class_label", "log_timezone"):
        if name in merged:
            values[name] = merged[name]
    if "engine" in merged:  # the flag's and the file key's name: which server wrote the metrics
        values["server_kind"] = merged["engine"]
    for name in ("threshold_tau", "min_drafts", "speedup_floor"):
        if name in merged:
            values[name] = merged[name]
    # Thresholds (telemetry/verdict.py) is the one place these numbers are checked: finite and in range
    values.update(
        dataclasses.asdict(
            Thresholds(
                **{name: values[name] for name in ("threshold_tau", "min_drafts", "speedup_floor") if name in values}
            )
        )
    )
    settings = WatchSettings(**values)
    if settings.window_s <= 0 or settings.interval_s <= 0:
        raise UsageError(
            "watch window and interval must be > 0 seconds; fix --window / --interval or the [watch] table."
        )
    if settings.retain_s is not None and settings.retain_s < settings.window_s:
        raise UsageError(
            f"watch retain ({settings.retain_s:g} s) is shorter than the window "
            f"({settings.window_s:g} s); keep at least one window, e.g. --retain 7d."
        )
    if settings.server_kind is not None and settings.server_kind not in READERS:
        raise UsageError(
            f"engine {settings.server_kind!r} is not one of "
            f"{', '.join(READERS)}; pick one or leave it out to detect it."
        )
    settings.thresholds  # validates
    log_zone(settings.log_timezone)  # validates
    return settings
