"""The doctor's one HTTP client: every request to a serving engine, a ``/metrics`` page, a Prometheus
server or an alert webhook goes through :class:`HttpClient`.

It is ``requests`` with urllib3's :class:`~urllib3.util.retry.Retry` mounted: connection failures, read
timeouts and HTTP 429/5xx answers are retried with exponential backoff plus random jitter (so the many
clients a restart disconnected do not come back in step), and a ``Retry-After`` the server sends is
waited instead of the backoff (capped at :data:`RETRY_AFTER_MAX_S`: a server asking for an hour must not
freeze a watch). Every request has a timeout. When the retries are spent the last answer is returned;
no answer at all is :class:`Unreachable`, one short sentence naming the URL and the reason.

Every request has a total deadline (``deadline_s``: redirects and the whole body included, not only the
wait for each read) and a size cap on its body (``max_bytes``); an answer that runs past either is
:class:`AnswerCut`, one sentence naming the URL and the limit, so a server that streams forever cannot
hold a ``watch --once`` or a ``tune`` request without end. :meth:`HttpClient.stream` reads a streamed
answer (server-sent events) line by line under the same limits.

Redirects are followed by this client, not by ``requests``: a hop to another origin (scheme, host or
port) goes without the credentials, so ``Authorization``, every header the user gave (``--prometheus-header``
values such as ``X-Api-Key``), cookies and a URL's ``user:password@`` stay on the host they were meant for.

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
import time
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from dflash_doctor.errors import UsageError
from dflash_doctor.urls import shown, without_userinfo

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
AUTH_STATUSES = frozenset({401, 403})  # the server wants credentials, or refuses the ones sent
RETRY_AFTER_MAX_S = 60.0
POOL_SIZE = 32  # connections kept per host: above check --engine's usual concurrency
DEADLINE_S = 600.0  # the whole of one request, redirects and body included (a client may set its own)
MAX_BYTES = 64 * 1024 * 1024  # the largest body read: a /metrics page or a completion is far smaller
MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
CREDENTIAL_HEADERS = ("Authorization", "Proxy-Authorization", "Cookie")
_READ_SIZE = 64 * 1024
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


class AnswerCut(Unreachable):
    """An answer cut off by the client: it ran past the total deadline or the size cap."""


def _origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL, the default port filled in: what credentials are bound to."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


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
        if isinstance(current, TimeoutError) or type(current).__name__ in ("ReadTimeoutError", "ConnectTimeoutError"):
            return f"no data within {timeout_s:g} s"
        if isinstance(current, OSError) and current.strerror:
            return current.strerror
        pending += [
            e
            for e in (current.__cause__, current.__context__, getattr(current, "reason", None), *current.args)
            if isinstance(e, BaseException)
        ]
    return type(exc).__name__


class HttpClient:
    """A ``requests`` session with retries, backoff with jitter, ``Retry-After``, a timeout per read, a total
    deadline and a size cap per request, and redirects that keep credentials on their origin.

    ``headers`` go with every request to the origin it was made for (``Authorization``, ``X-Scope-OrgID``
    ...), and so does ``auth`` (a URL's ``user:password`` kept out of the URLs the caller shows); ``retries`` counts the
    attempts after the first; ``backoff_s`` is the first wait (doubling, plus up to ``backoff_s`` of jitter). POSTs are
    retried too: the doctor's POSTs (a completion request, an alert) are safe to repeat.
    """

    def __init__(
        self,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        deadline_s: float | None = None,
        max_bytes: int = MAX_BYTES,
        auth: tuple[str, str] | None = None,
    ):
        self.timeout_s = timeout_s
        self.auth = auth  # basic-auth (user, password) for URLs without their own, on their origin only
        self.deadline_s = deadline_s if deadline_s is not None else max(DEADLINE_S, timeout_s)
        self.max_bytes = max_bytes
        self.session = requests.Session()
        self.session.headers.update(headers or {})
        # what never crosses to another origin: the credentials, and every header the caller chose
        self._private = {name: None for name in (*CREDENTIAL_HEADERS, *(headers or {}))}
        retry = _Retry(
            total=retries,
            connect=retries,
            read=retries,
            status=retries,
            other=0,
            redirect=0,
            backoff_factor=backoff_s,
            backoff_jitter=backoff_s,
            status_forcelist=RETRY_STATUSES,
            allowed_methods=None,
            raise_on_status=False,
            raise_on_redirect=False,
            respect_retry_after_header=True,
        )
        adapter = HTTPAdapter(max_retries=retry, pool_maxsize=POOL_SIZE)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def _open(
        self,
        method: str,
        url: str,
        payload: Mapping[str, Any] | None,
        params: Mapping[str, str] | None,
        timeout: float,
        ends_at: float,
        headers: Mapping[str, str] | None = None,
    ) -> requests.Response:
        """The final response of a request (its body not read yet), redirects followed here: a hop to
        another origin goes without the credentials and the caller's headers."""
        start, auth = without_userinfo(url)
        auth = auth or self.auth
        origin = _origin(start)
        current: str = start
        for _ in range(MAX_REDIRECTS + 1):
            same = _origin(current) == origin
            extra = dict(headers or {}) if same else {**self._private, **{name: None for name in headers or {}}}
            if time.monotonic() > ends_at:
                raise AnswerCut(f"no complete answer from {shown(url)} within the {self.deadline_s:g} s deadline")
            try:
                response = self.session.request(
                    method,
                    current,
                    json=payload,
                    params=params,
                    timeout=timeout,
                    allow_redirects=False,
                    stream=True,
                    auth=auth if same else None,
                    # a None value removes that session header (requests' documented merge rule)
                    headers=extra,  # pyright: ignore[reportArgumentType]
                )
            except requests.RequestException as exc:
                raise Unreachable(f"no answer from {shown(url)} ({_reason(exc, timeout)})") from None
            location = response.headers.get("Location")
            if response.status_code not in REDIRECT_STATUSES or not location:
                return response
            response.close()
            current = without_userinfo(urllib.parse.urljoin(current, location))[
                0
            ]  # a Location's own user:password is not used
            params = None  # the Location carries its own query
            if response.status_code == 303 or (response.status_code in (301, 302) and method == "POST"):
                method, payload = ("HEAD" if method == "HEAD" else "GET"), None
        raise Unreachable(f"no answer from {shown(url)} (more than {MAX_REDIRECTS} redirects)")

    def _chunks(self, response: requests.Response, url: str, ends_at: float) -> Iterator[bytes]:
        """The body as it arrives, cut (:class:`AnswerCut`) past the deadline or the size cap."""
        size = 0
        try:
            while True:
                if time.monotonic() > ends_at:
                    raise AnswerCut(
                        f"{shown(url)} was still sending after the {self.deadline_s:g} s deadline; "
                        f"an answer that never ends is cut off"
                    )
                chunk = response.raw.read1(_READ_SIZE, decode_content=True)
                if not chunk:
                    return
                size += len(chunk)
                if size > self.max_bytes:
                    raise AnswerCut(
                        f"{shown(url)} sent more than {self.max_bytes / 2**20:g} MiB; an answer that large is cut off"
                    )
                yield chunk
        except AnswerCut:
            raise
        except (
            requests.RequestException,
            OSError,
            ValueError,
        ) as exc:  # urllib3's read errors are OSError / ValueError kin
            raise Unreachable(f"no complete answer from {shown(url)} ({_reason(exc, self.timeout_s)})") from None
        except Exception as exc:  # urllib3.exceptions.HTTPError (ProtocolError, ReadTimeoutError ...)
            if type(exc).__module__.startswith("urllib3"):
                raise Unreachable(f"no complete answer from {shown(url)} ({_reason(exc, self.timeout_s)})") from None
            raise
        finally:
            response.close()

    def request(
        self,
        method: str,
        url: str,
        *,
        payload: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Answer:
        """One request (a JSON body when ``payload`` is given); :class:`Unreachable` when nothing answered,
        :class:`AnswerCut` when the answer ran past the deadline or the size cap."""
        timeout = timeout_s or self.timeout_s
        ends_at = time.monotonic() + self.deadline_s
        response = self._open(method, url, payload, params, timeout, ends_at)
        body = b"".join(self._chunks(response, url, ends_at))
        return Answer(response.status_code, body.decode(response.encoding or "utf-8", errors="replace"))

    def get(self, url: str, *, params: Mapping[str, str] | None = None, timeout_s: float | None = None) -> Answer:
        return self.request("GET", url, params=params, timeout_s=timeout_s)

    @contextmanager
    def stream(
        self,
        method: str,
        url: str,
        *,
        payload: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Iterator[tuple[int, Iterator[bytes]]]:
        """A streamed request: (status, its body's lines as they arrive), under the deadline and the size
        cap; ``headers`` are added to this request only (and, as the client's own, kept on its origin)."""
        ends_at = time.monotonic() + self.deadline_s
        response = self._open(method, url, payload, None, self.timeout_s, ends_at, headers)
        try:
            yield response.status_code, _lines(self._chunks(response, url, ends_at))
        finally:
            response.close()


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Lines (with their ends) of a body read in chunks; the last one may have no end."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line + b"\n"
    if pending:
        yield pending


def secret(value: str, flag: str) -> str:
    """A secret given on the command line: literal, ``env:VAR`` (the whole value from the environment) or
    text with ``$VAR`` / ``${VAR}`` in it (``Bearer $TOKEN``; ``$$`` is a literal ``$``). A variable that
    is not set is a UsageError naming the flag."""
    if value.startswith("env:"):
        name = value[len("env:") :]
        if name not in os.environ:
            raise UsageError(
                f"{flag} names the environment variable {name}, which is not set; export it or pass the value."
            )
        return os.environ[name]
    try:
        return string.Template(value).substitute(os.environ)
    except KeyError as exc:
        raise UsageError(
            f"{flag} names the environment variable {exc.args[0]}, which is not set; export it or pass the value."
        ) from None
    except ValueError:
        raise UsageError(f"{flag} has a lone '$' that names no variable; write $$ for a literal dollar sign.") from None


def header_flags(values: list[str], flag: str) -> dict[str, str]:
    """``NAME=VALUE`` flags (repeatable) as headers, each value read by :func:`secret`."""
    headers: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not _HEADER_NAME.match(name):
            raise UsageError(
                f"{flag} {name or item!r} is not NAME=VALUE with an HTTP "
                f"header name; pass e.g. {flag} 'X-Scope-OrgID=tenant-1'."
            )
        resolved = secret(value.strip(), f"{flag} {name}")
        if "\n" in resolved or "\r" in resolved:
            raise UsageError(f"{flag} {name}: the value holds a line break, which no header can carry; fix the value.")
        headers[name] = resolved
    return headers
