"""A small OpenAI-compatible HTTP client for measuring a running serving engine.

Standard library only (urllib): the doctor must not pin an HTTP stack next to the user's. One request
is one ``POST`` with a per-request timeout; connection failures and 5xx/429 answers are retried with
exponential backoff; every other failure becomes a :class:`UsageError` with one sentence naming the
server, what it said and the fix. The body asks every engine for its per-request speculative figures
at once (vLLM ``return_token_ids``, SGLang ``return_spec_tokens_details``); an engine ignores the
fields it does not know.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Mapping

from dflash_doctor.errors import UsageError

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class EngineEndpoint:
    """Where the server is and how to ask it: base URL (``http://host:port``), model name, timeouts."""

    base_url: str
    model: str | None = None  # None: the server's only model (asked from /v1/models)
    timeout_s: float = 300.0
    retries: int = 3
    backoff_s: float = 1.0

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> "EngineEndpoint":
        """Accept ``host:port``, ``http://host:port`` or ``.../v1``; keep the scheme and host only."""
        text = url.strip().rstrip("/")
        if "://" not in text:
            text = "http://" + text
        if text.endswith("/v1"):
            text = text[: -len("/v1")]
        scheme, _, rest = text.partition("://")
        if scheme not in ("http", "https") or not rest:
            raise UsageError(f"--engine {url!r} is not an http(s) URL; pass the server's address, e.g. http://127.0.0.1:8000.")
        return cls(base_url=text, **kwargs)


class EngineError(Exception):
    """A request failed after its retries; ``status`` is the HTTP status (None: no answer at all)."""

    def __init__(self, message: str, status: int | None = None, body: str = ""):
        super().__init__(message)
        self.status = status
        self.body = body


def _request(endpoint: EngineEndpoint, method: str, path: str, payload: Mapping[str, Any] | None = None) -> tuple[int, str]:
    data = json.dumps(payload).encode("utf-8") if payload is not None else None
    req = urllib.request.Request(endpoint.base_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=endpoint.timeout_s) as response:
            return response.status, response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", errors="replace")


def call(endpoint: EngineEndpoint, method: str, path: str, payload: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One JSON call with retries and backoff; raises :class:`EngineError` when it cannot succeed."""
    delay = endpoint.backoff_s
    last: EngineError | None = None
    for attempt in range(endpoint.retries + 1):
        try:
            status, text = _request(endpoint, method, path, payload)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            last = EngineError(f"no answer from {endpoint.base_url} ({reason})")
        else:
            if status == 200:
                try:
                    return json.loads(text)
                except json.JSONDecodeError:
                    raise EngineError(f"{endpoint.base_url}{path} answered with something that is not JSON", status, text[:300]) from None
            last = EngineError(f"{endpoint.base_url}{path} answered HTTP {status}: {_error_text(text)}", status, text)
            if status not in RETRY_STATUSES:
                raise last
        if attempt < endpoint.retries:
            time.sleep(delay)
            delay *= 2
    assert last is not None
    raise last


def _error_text(text: str) -> str:
    """The server's own error message (OpenAI error shape), shortened for one sentence."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:200]
    error = body.get("error", body) if isinstance(body, dict) else body
    message = error.get("message", error) if isinstance(error, dict) else error
    return str(message).strip()[:200]


def served_models(endpoint: EngineEndpoint) -> list[str]:
    """The model names the server serves (``GET /v1/models``); unreachable is a UsageError."""
    try:
        body = call(endpoint, "GET", "/v1/models")
    except EngineError as exc:
        if exc.status is None:
            raise UsageError(f"--engine {endpoint.base_url}: {exc}; start the server or fix the URL.") from None
        raise UsageError(f"--engine {endpoint.base_url} is not an OpenAI-compatible server ({exc}); pass the URL of the server's OpenAI API.") from None
    if not isinstance(body, dict) or not isinstance(body.get("data") or [], list):
        raise UsageError(f"--engine {endpoint.base_url}: GET /v1/models answered {str(body)[:60]!r}, not an OpenAI model list "
                         f"({{\"data\": [...]}}); pass the URL of the server's OpenAI API.")
    return [str(m["id"]) for m in body.get("data") or [] if isinstance(m, dict) and m.get("id")]


def resolve_model(endpoint: EngineEndpoint) -> EngineEndpoint:
    """Check the model name against the server (or take its only model); a wrong name lists the real ones."""
    import dataclasses

    models = served_models(endpoint)
    if endpoint.model is None:
        if len(models) != 1:
            raise UsageError(f"--engine {endpoint.base_url} serves {len(models)} models ({', '.join(models) or 'none'}); pick one with --engine-model.")
        return dataclasses.replace(endpoint, model=models[0])
    if endpoint.model not in models:
        raise UsageError(f"--engine-model {endpoint.model!r} is not served by {endpoint.base_url}; it serves {', '.join(models) or 'nothing'}.")
    return endpoint


def scrape_metrics(endpoint: EngineEndpoint) -> str | None:
    """The Prometheus text of ``GET /metrics`` (None when the server has none): the fallback source."""
    req = urllib.request.Request(endpoint.base_url + "/metrics", method="GET")
    try:
        with urllib.request.urlopen(req, timeout=min(endpoint.timeout_s, 30.0)) as response:
            return response.read().decode("utf-8", errors="replace") if response.status == 200 else None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None
