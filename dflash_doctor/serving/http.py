"""The doctor's one HTTP client: every request to a serving engine, a ``/metrics`` page, a Prometheus
server or an alert webhook goes through :class:`HttpClient`.

It is ``requests`` with urllib3's :class:`~urllib3.util.retry.Retry` mounted: connection failures, read
timeouts and HTTP 429/5xx answers are retried with exponential backoff plus random jitter (so the many
clients a restart disconnected do not come back in step), and a ``Retry-After`` the server sends is
waited instead of the backoff (capped at :data:`RETRY_AFTER_MAX_S`: a server asking for an hour must not
freeze a watch). Every request has a timeout. When the retries are spent the last answer is returned;
no answer at all is :class:`Unreachable`, one short sentence naming the URL and the reason.

Secrets (an API key, a Prometheus bearer token) travel only in the client's headers: they are never
part of a message, an event or anything the doctor writes. :func:`secret` and :func:`header_flags` read
them from flags whose values may name environment variables (``env:VAR``, ``$VAR``), so they stay out
of shell history and process listings.
"""

from __future__ import annotations

import json
import os
import re
import string
from dataclasses import dataclass
from typing import Any, Mapping

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from dflash_doctor.errors import UsageError

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
AUTH_STATUSES = frozenset({401, 403})  # the server wants credentials, or refuses the ones sent
RETRY_AFTER_MAX_S = 60.0
POOL_SIZE = 32  # connections kept per host: above check --engine's usual concurrency
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token (RFC 9110 section 5.6.2)


def bearer(api_key: str | None) -> dict[str, str]:
    """The ``Authorization`` header of an OpenAI-style ``--api-key`` server (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class _Retry(Retry):
    """urllib3's Retry with ``Retry-After`` honoured up to :data:`RETRY_AFTER_MAX_S` (urllib3's own cap is
    six hours, and only recent releases let it be set)."""

    def parse_retry_after(self, retry_after: str) -> float:
        return min(super().parse_retry_after(retry_after), RETRY_AFTER_MAX_S)


class Unreachable(Exception):
    """No HTTP answer at all after the retries (refused, timed out, name not resolved)."""


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: its status and its body as text (after the retries, when they were spent)."""

    status: int
    text: str

    @property
    def ok(self) -> bool:
        return self.status == 200

    def json(self) -> Any:
        """The body parsed as JSON; :class:`json.JSONDecodeError` when it is not."""
        return json.loads(self.text)


def _reason(exc: BaseException, timeout_s: float) -> str:
    """The short cause of a request that got no answer: the socket's own words (``Connection refused``)
    rather than requests' nested pool messages."""
    if isinstance(exc, requests.Timeout):
        return f"no answer within {timeout_s:g} s"
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.strerror:
            return current.strerror
        pending += [e for e in (current.__cause__, current.__context__, getattr(current, "reason", None), *current.args) if isinstance(e, BaseException)]
    return type(exc).__name__


class HttpClient:
    """A ``requests`` session with retries, backoff with jitter, ``Retry-After`` and a timeout per request.

    ``headers`` go with every request (``Authorization``, ``X-Scope-OrgID`` ...); ``retries`` counts the
    attempts after the first; ``backoff_s`` is the first wait (doubling, plus up to ``backoff_s`` of jitter).
    POSTs are retried too: the doctor's POSTs (a completion request, an alert) are safe to repeat.
    """

    def __init__(self, *, headers: Mapping[str, str] | None = None, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 1.0):
        self.timeout_s = timeout_s
        self.session = requests.Session()
        self.session.headers.update(headers or {})
        retry = _Retry(total=retries, connect=retries, read=retries, status=retries, other=0, redirect=3,
                       backoff_factor=backoff_s, backoff_jitter=backoff_s, status_forcelist=RETRY_STATUSES,
                       allowed_methods=None, raise_on_status=False, respect_retry_after_header=True)
        adapter = HTTPAdapter(max_retries=retry, pool_maxsize=POOL_SIZE)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def request(self, method: str, url: str, *, payload: Mapping[str, Any] | None = None, params: Mapping[str, str] | None = None,
                timeout_s: float | None = None) -> Answer:
        """One request (a JSON body when ``payload`` is given); :class:`Unreachable` when nothing answered."""
        timeout = timeout_s or self.timeout_s
        try:
            response = self.session.request(method, url, json=payload, params=params, timeout=timeout)
        except requests.RequestException as exc:
            raise Unreachable(f"no answer from {url.split('?')[0]} ({_reason(exc, timeout)})") from None
        return Answer(response.status_code, response.text)

    def get(self, url: str, *, params: Mapping[str, str] | None = None, timeout_s: float | None = None) -> Answer:
        return self.request("GET", url, params=params, timeout_s=timeout_s)


def secret(value: str, flag: str) -> str:
    """A secret given on the command line: literal, ``env:VAR`` (the whole value from the environment) or
    text with ``$VAR`` / ``${VAR}`` in it (``Bearer $TOKEN``; ``$$`` is a literal ``$``). A variable that
    is not set is a UsageError naming the flag."""
    if value.startswith("env:"):
        name = value[len("env:"):]
        if name not in os.environ:
            raise UsageError(f"{flag} names the environment variable {name}, which is not set; export it or pass the value.")
        return os.environ[name]
    try:
        return string.Template(value).substitute(os.environ)
    except KeyError as exc:
        raise UsageError(f"{flag} names the environment variable {exc.args[0]}, which is not set; export it or pass the value.") from None
    except ValueError:
        raise UsageError(f"{flag} has a lone '$' that names no variable; write $$ for a literal dollar sign.") from None


def header_flags(values: list[str], flag: str) -> dict[str, str]:
    """``NAME=VALUE`` flags (repeatable) as headers, each value read by :func:`secret`."""
    headers: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not _HEADER_NAME.match(name):
            raise UsageError(f"{flag} {name or item!r} is not NAME=VALUE with an HTTP header name; pass e.g. {flag} 'X-Scope-OrgID=tenant-1'.")
        resolved = secret(value.strip(), f"{flag} {name}")
        if "\n" in resolved or "\r" in resolved:
            raise UsageError(f"{flag} {name}: the value holds a line break, which no header can carry; fix the value.")
        headers[name] = resolved
    return headers
