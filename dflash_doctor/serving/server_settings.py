"""The engine settings ``--engine-config`` names: a file of launch flags or JSON (parsed by
:mod:`dflash_doctor.inputs.server_config`), or a running llama-server's URL, read from what it serves.
Resolved once per command, before any model loads, so a file and a server give the same dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.server_config import is_server_url, llamacpp_settings, parse_server_config
from dflash_doctor.serving.client import ServerEndpoint, ServerError, call, scrape_metrics
from dflash_doctor.telemetry.exposition import parse_exposition


def server_settings(spec: str | Path) -> dict[str, Any]:
    """The normalised engine dict of ``--engine-config`` (a file, or a running llama-server's URL)."""
    return read_llamacpp_server(str(spec)) if is_server_url(spec) else parse_server_config(spec)


def read_llamacpp_server(url: str) -> dict[str, Any]:
    """A running llama-server's speculative settings, from what it serves (tools/server): ``/slots`` (the
    speculative types a request gets, e.g. ``none,draft-dflash``) and the draft size it really uses, read from
    ``/metrics``: ``llamacpp:spec_decode_num_accepted_tokens_per_pos_total`` has one series per drafted
    position (llama.cpp sizes it by the clamped n-max), present once a request has been drafted for. No
    endpoint reports n-max itself, and ``/props`` shows a fresh request's defaults (``speculative.types`` =
    none) rather than the server's. No endpoint names the draft's file either (``/props``' ``model_path`` is
    the target's), so the draft model is left unknown."""
    endpoint = ServerEndpoint.from_url(url)
    try:
        slots: Any = call(endpoint, "GET", "/slots")  # a JSON list, one object per slot
    except ServerError as exc:
        raise UsageError(
            f"--engine-config {url}: {exc}; pass the URL of a running llama-server (its /slots answers)."
        ) from None
    slot = slots[0] if isinstance(slots, list) and slots else {}
    types = [t for t in str((slot.get("params") or {}).get("speculative.types") or "").split(",") if t and t != "none"]
    metrics = scrape_metrics(endpoint)
    if metrics is None:
        raise UsageError(
            f"--engine-config {url}: the server has no /metrics; restart "
            "llama-server with --metrics so its draft size can be read."
        )
    positions = {
        s.labels.get("position")
        for s in parse_exposition(metrics).named("llamacpp:spec_decode_num_accepted_tokens_per_pos_total")
    }
    if not positions:
        raise UsageError(
            f"--engine-config {url}: the server has drafted nothing yet, so its draft size is not on /metrics; "
            "send it one request (or pass its launch flags in a file) and retry."
        )
    return llamacpp_settings(types[0] if types else None, None, len(positions), url)
