"""The one HTTP client (dflash_doctor/serving/http.py) against a local HTTP server that answers as scripted.

A real engine or gateway cannot be made to answer 429 with ``Retry-After`` on demand, so a server in a
thread does; it records when each request arrived, which is what the waits are read from.
"""

from __future__ import annotations

import random
import time

import pytest
from urllib3.response import HTTPResponse

from dflash_doctor.errors import UsageError
from dflash_doctor.serving import http
from dflash_doctor.serving.http import HttpClient, Unreachable, header_flags, secret
from local_servers import QuietHandler, ThreadedServer, free_port


class ScriptedServer(ThreadedServer):
    """Answers each request with the next ``(status, headers)`` of ``plan`` (then 200 "done")."""

    def __init__(self, plan: list[tuple[int, dict[str, str]]]):
        self.plan = list(plan)
        self.arrivals: list[float] = []
        self.headers: list[dict[str, str]] = []
        owner = self

        class Handler(QuietHandler):
            def do_GET(self):  # noqa: N802 (http.server API)
                owner.arrivals.append(time.monotonic())
                owner.headers.append(dict(self.headers))
                status, headers = owner.plan.pop(0) if owner.plan else (200, {})
                self.reply(status, b"done" if status == 200 else b"busy", headers=headers)

        super().__init__(Handler)
        self.url = f"{self.base_url}/x"

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


def test_retry_after_is_waited_instead_of_the_backoff():
    with ScriptedServer([(429, {"Retry-After": "1"}), (503, {"Retry-After": "1"})]) as server:
        answer = HttpClient(retries=3, backoff_s=0.01).get(server.url)
    assert (answer.status, answer.text) == (200, "done")
    assert len(server.arrivals) == 3
    assert all(gap >= 0.95 for gap in server.gaps()), server.gaps()  # the backoff alone would be 0.01-0.04 s


def test_a_retry_after_past_the_cap_waits_the_cap_and_the_last_answer_comes_back(monkeypatch):
    monkeypatch.setattr(http, "RETRY_AFTER_MAX_S", 0.3)
    started = time.monotonic()
    with ScriptedServer([(429, {"Retry-After": "5"})] * 3) as server:
        answer = HttpClient(retries=2, backoff_s=0.01).get(server.url)
    assert answer.status == 429 and len(server.arrivals) == 3  # spent the retries, then the server's own answer
    assert all(gap >= 0.25 for gap in server.gaps()) and time.monotonic() - started < 5  # uncapped: 10 s


def test_the_backoff_doubles_and_carries_random_jitter():
    with ScriptedServer([(503, {})] * 3) as server:
        answer = HttpClient(retries=3, backoff_s=0.2).get(server.url)
    assert answer.status == 200 and len(server.arrivals) == 4
    first, second, third = server.gaps()
    assert (
        first < 0.5 and second >= 0.4 and third >= 0.8
    )  # urllib3: no wait before the first retry, then 2x, 4x backoff
    # the jitter, read off the client's own Retry: after two failures the wait is 0.4 s plus up to 0.2 s, random
    retry = HttpClient(retries=3, backoff_s=0.2).session.get_adapter("http://x").max_retries
    for _ in range(2):
        retry = retry.increment("GET", "/x", response=HTTPResponse(status=503))
    random.seed(0)
    waits = [retry.get_backoff_time() for _ in range(50)]
    assert all(0.4 <= w <= 0.6 for w in waits) and len({round(w, 6) for w in waits}) > 40


def test_no_answer_is_one_sentence_with_the_reason():
    url = f"http://127.0.0.1:{free_port()}/metrics"
    with pytest.raises(Unreachable, match=r"^no answer from http://127\.0\.0\.1:\d+/metrics \(Connection refused\)$"):
        HttpClient(retries=1, backoff_s=0.01).get(url, params={"query": "up"})


def test_headers_go_with_every_request():
    with ScriptedServer([(503, {})]) as server:
        HttpClient(headers={"X-Scope-OrgID": "tenant-1"}, retries=1, backoff_s=0.01).get(server.url)
    assert [h.get("X-Scope-OrgID") for h in server.headers] == ["tenant-1", "tenant-1"]  # the retry too


def test_secrets_and_header_flags_read_the_environment(monkeypatch):
    monkeypatch.setenv("PROM_TOKEN", "tok-123")
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    assert secret("env:PROM_TOKEN", "--engine-api-key") == "tok-123"
    assert secret("plain", "--engine-api-key") == "plain"
    assert header_flags(
        ["Authorization=Bearer $PROM_TOKEN", "X-Scope-OrgID=${PROM_TOKEN}-org", "X-Cost=$$5"], "--prometheus-header"
    ) == {"Authorization": "Bearer tok-123", "X-Scope-OrgID": "tok-123-org", "X-Cost": "$5"}
    with pytest.raises(
        UsageError,
        match="--prometheus-header Authorization names the environment variable NOT_SET_ANYWHERE, which is not set",
    ):
        header_flags(["Authorization=env:NOT_SET_ANYWHERE"], "--prometheus-header")
    with pytest.raises(UsageError, match="is not NAME=VALUE"):
        header_flags(["Bearer tok"], "--prometheus-header")
    with pytest.raises(UsageError, match="lone"):
        secret("a $ b", "--engine-api-key")
