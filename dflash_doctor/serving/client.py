"""A small OpenAI-compatible client for measuring a running serving engine.

Requests go through the doctor's one HTTP client (:mod:`dflash_doctor.serving.http`: retries with
backoff, jitter and ``Retry-After``, a timeout per request). The API key (``--engine-api-key`` or
``OPENAI_API_KEY``) is sent as a bearer token, as OpenAI's clients send it. A failed request becomes an
:class:`ServerError`; the callers turn it into one sentence naming the server, what it said and the fix.
The body asks every engine for its per-request speculative figures at once (vLLM ``return_token_ids``,
SGLang ``return_spec_tokens_details``); an engine ignores the fields it does not know.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

from dflash_doctor.errors import UsageError
from dflash_doctor.serving.http import AUTH_STATUSES, HttpClient, Unreachable, bearer
from dflash_doctor.urls import shown, without_userinfo

API_KEY_FLAGS = "--engine-api-key (or the OPENAI_API_KEY environment variable)"
METRICS_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServerEndpoint:
    """Where the server is and how to ask it: base URL (``http://host:port``), model name, API key, timeouts."""

    base_url: str
    model: str | None = None  # None: the server's only model (asked from /v1/models)
    timeout_s: float = 300.0  # the most one request may take, its whole answer included (--engine-timeout)
    retries: int = 3
    backoff_s: float = 1.0
    api_key: str | None = field(default=None, repr=False)  # a secret: never printed, never written
    # a URL's ``user:password@``: sent as basic auth by the client, never part of base_url (which is written and shown)
    credentials: tuple[str, str] | None = field(default=None, repr=False)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> "ServerEndpoint":
        """Accept ``host:port``, ``http://host:port`` or ``.../v1``; keep the scheme and host only. Credentials in
        the URL are taken out of it (:func:`~dflash_doctor.urls.without_userinfo`) into ``credentials``."""
        text = url.strip().rstrip("/")
        if "://" not in text:
            text = "http://" + text
        if text.endswith("/v1"):
            text = text[: -len("/v1")]
        scheme, _, rest = text.partition("://")
        if scheme not in ("http", "https") or not rest:
            raise UsageError(
                f"--engine {shown(url)!r} is not an http(s) URL; pass the server's address, e.g. http://127.0.0.1:8000."
            )
        base_url, credentials = without_userinfo(text)
        return cls(base_url=base_url, credentials=credentials, **kwargs)

    @cached_property
    def client(self) -> HttpClient:
        """One connection pool per endpoint, shared by the requests in flight."""
        headers = {"Accept": "application/json", **bearer(self.api_key)}
        return HttpClient(
            headers=headers,
            timeout_s=self.timeout_s,
            retries=self.retries,
            backoff_s=self.backoff_s,
            deadline_s=self.timeout_s,
            auth=self.credentials,
        )


class ServerError(Exception):
    """A request failed after its retries; ``status`` is the HTTP status (None: no answer at all)."""

    def __init__(self, message: str, status: int | None = None, body: str = ""):
        super().__init__(message)
        self.status = status
        self.body = body

    @property
    def auth_refused(self) -> bool:
        """The server wants an API key, or refused the one sent (HTTP 401/403)."""
        return self.status in AUTH_STATUSES


def auth_fix(endpoint: ServerEndpoint) -> str:
    """The fix for an :attr:`ServerError.auth_refused` answer, for the end of a sentence."""
    if endpoint.api_key:
        return f"the server refused the API key given by {API_KEY_FLAGS}; pass the key the server was started with"
    return f"the server wants an API key (it was started with --api-key); pass it with {API_KEY_FLAGS}"


def call(endpoint: ServerEndpoint, method: str, path: str, payload: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One JSON call (retried by the client); raises :class:`ServerError` when it cannot succeed."""
    try:
        answer = endpoint.client.request(method, endpoint.base_url + path, payload=payload)
    except Unreachable as exc:
        raise ServerError(str(exc)) from None
    if not answer.ok:
        raise ServerError(
            f"{endpoint.base_url}{path} answered HTTP {answer.status}: {_error_text(answer.text)}",
            answer.status,
            answer.text,
        )
    try:
        return answer.json()
    except json.JSONDecodeError:
        raise ServerError(
            f"{endpoint.base_url}{path} answered with something that is not JSON", answer.status, answer.text[:300]
        ) from None


def _error_text(text: str) -> str:
    """The server's own error message (OpenAI error shape), shortened for one sentence."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:200]
    error = body.get("error", body) if isinstance(body, dict) else body
    message = error.get("message", error) if isinstance(error, dict) else error
    return str(message).strip()[:200]


def served_models(endpoint: ServerEndpoint) -> list[str]:
    """The model names the server serves (``GET /v1/models``); unreachable or refused is a UsageError."""
    try:
        body = call(endpoint, "GET", "/v1/models")
    except ServerError as exc:
        if exc.status is None:
            raise UsageError(f"--engine {endpoint.base_url}: {exc}; start the server or fix the URL.") from None
        if exc.auth_refused:
            raise UsageError(f"--engine {endpoint.base_url}: {exc}; {auth_fix(endpoint)}.") from None
        raise UsageError(
            f"--engine {endpoint.base_url} is not an OpenAI-compatible "
            f"server ({exc}); pass the URL of the server's OpenAI API."
        ) from None
    if not isinstance(body, dict) or not isinstance(body.get("data") or [], list):
        raise UsageError(
            f"--engine {endpoint.base_url}: GET /v1/models answered {str(body)[:60]!r}, not an OpenAI model list "
            f'({{"data": [...]}}); pass the URL of the server\'s OpenAI API.'
        )
    return [str(m["id"]) for m in body.get("data") or [] if isinstance(m, dict) and m.get("id")]


def served_model_file(endpoint: ServerEndpoint) -> str | None:
    """The model file a llama-server serves (``GET /props``: ``model_path``, the GGUF given to ``-m``),
    which its /v1/models names only by ``--alias`` or that path; None from a server without /props (vLLM,
    SGLang) or one that does not say."""
    try:
        props = call(endpoint, "GET", "/props")
    except ServerError:
        return None
    path = props.get("model_path") if isinstance(props, dict) else None
    return path if isinstance(path, str) and path else None


def resolve_model(endpoint: ServerEndpoint) -> ServerEndpoint:
    """Check the model name against the server (or take its only model); a wrong name lists the real ones."""
    models = served_models(endpoint)
    if endpoint.model is None:
        if len(models) != 1:
            raise UsageError(
                f"--engine {endpoint.base_url} serves {len(models)} models "
                f"({', '.join(models) or 'none'}); pick one with --engine-model."
            )
        return dataclasses.replace(endpoint, model=models[0])
    if endpoint.model not in models:
        raise UsageError(
            f"--engine-model {endpoint.model!r} is not served by "
            f"{endpoint.base_url}; it serves {', '.join(models) or 'nothing'}."
        )
    return endpoint


def scrape_metrics(endpoint: ServerEndpoint) -> str | None:
    """The Prometheus text of ``GET /metrics`` (None when the
    server has none or cannot be read): the fallback source."""
    try:
        answer = endpoint.client.get(
            endpoint.base_url + "/metrics", timeout_s=min(endpoint.timeout_s, METRICS_TIMEOUT_S)
        )
    except Unreachable:
        return None
    return answer.text if answer.ok else None
