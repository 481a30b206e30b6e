"""The one HTTP client's limits, against fake servers on 127.0.0.1: credentials stay on their origin across
redirects (Authorization, the user's own headers, a URL's user:password), for plain requests and for
tune's streamed ones; every answer has a total deadline and a size cap, each cut in one sentence; a
`watch --once` on a /metrics page that never ends returns, and a live one still stops on SIGTERM.
"""

from __future__ import annotations

import gzip
import signal
import subprocess
import threading
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.inputs.workloads import Request
from dflash_doctor.serving.client import ServerEndpoint
from dflash_doctor.serving.http import AnswerCut, HttpClient, Unreachable
from dflash_doctor.telemetry import sources
from dflash_doctor.tune.measure import stream_request
from local_servers import QuietHandler, ThreadedServer

REPO = Path(__file__).resolve().parents[1]
SECRET_HEADERS = ("Authorization", "X-Api-Key")


class Recorder(ThreadedServer):
    """Records each request's path and headers; ``/go`` redirects (``status``) to ``target``, anything else
    answers 200 (a POST to the completions path: one streamed chunk with usage)."""

    def __init__(self, status: int = 302, target: str = ""):
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        owner = self

        class Handler(QuietHandler):
            def _answer(self, method: str) -> None:
                if method == "POST" and self.headers.get("Content-Length"):
                    self.rfile.read(int(self.headers["Content-Length"]))
                owner.seen.append((method, self.path, dict(self.headers)))
                if self.path.startswith("/go"):
                    self.reply(owner.status, b"", headers={"Location": owner.target})
                elif method == "POST" or self.path.startswith("/v1/"):  # a 302/303 turns the POST into a GET
                    chunk = (
                        b'data: {"choices": [{"text": "x"}], "usage": {"prompt_tokens": '
                        b'3, "completion_tokens": 1}}\n\ndata: [DONE]\n\n'
                    )
                    self.reply(200, chunk, "text/event-stream")
                else:
                    self.reply(200, b"ok", "text/plain")

            def do_GET(self):  # noqa: N802 (http.server API)
                self._answer("GET")

            def do_POST(self):  # noqa: N802
                self._answer("POST")

        super().__init__(Handler)
        self.status, self.target = status, target


def _credentials(seen: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in seen.items() if name.title() in ("Authorization", "X-Api-Key", "Cookie")}


# redirect status x how the other origin differs (host name, port) x the request's method
REDIRECT_CASES = [
    (status, differs, method)
    for status in (301, 302, 303, 307, 308)
    for differs in ("host", "port")
    for method in ("GET", "POST")
]


@pytest.mark.parametrize("status, differs, method", REDIRECT_CASES)
def test_credentials_do_not_follow_a_redirect_to_another_origin(status, differs, method):
    with Recorder() as other, Recorder(status) as origin:
        other_base = other.base_url.replace("127.0.0.1", "localhost") if differs == "host" else other.base_url
        origin.target = f"{other_base}/landed" if differs == "port" else f"http://localhost:{origin.port}/landed"
        url = origin.base_url.replace("http://", "http://user:pw@") + "/go"
        client = HttpClient(headers={"Authorization": "Bearer sk-secret", "X-Api-Key": "k-secret"}, retries=0)
        answer = client.request(method, url, payload={"a": 1} if method == "POST" else None)
    landed = other.seen if differs == "port" else [s for s in origin.seen if s[1] == "/landed"]
    assert answer.ok and len(landed) == 1
    assert _credentials(origin.seen[0][2]).keys() == {"Authorization", "X-Api-Key"}  # the origin got them
    assert _credentials(landed[0][2]) == {}, landed[0][2]
    assert landed[0][0] == ("POST" if method == "POST" and status in (307, 308) else "GET")


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_credentials_stay_with_a_redirect_on_the_same_origin(status):
    with Recorder(status) as origin:
        origin.target = "/landed"
        client = HttpClient(headers={"Authorization": "Bearer sk-secret", "X-Api-Key": "k-secret"}, retries=0)
        assert client.get(origin.base_url + "/go").ok
    assert [s[1] for s in origin.seen] == ["/go", "/landed"]
    assert _credentials(origin.seen[1][2]) == {"Authorization": "Bearer sk-secret", "X-Api-Key": "k-secret"}


def test_a_url_s_user_and_password_are_sent_to_its_host_only():
    with Recorder() as other, Recorder(302) as origin:
        origin.target = other.base_url.replace("127.0.0.1", "localhost") + "/landed"
        HttpClient(retries=0).get(origin.base_url.replace("http://", "http://alice:s3cret@") + "/go")
    assert origin.seen[0][2]["Authorization"].startswith("Basic ")
    assert "Authorization" not in other.seen[0][2]


@pytest.mark.parametrize("status", [302, 307])
def test_tune_s_streamed_request_keeps_the_api_key_on_its_host(status):
    """tune's streamed completion request (tune/measure.stream_request) goes through the one client."""
    with Recorder() as other, Recorder(status) as origin:
        origin.target = other.base_url.replace("127.0.0.1", "localhost") + "/v1/completions"
        endpoint = ServerEndpoint(base_url=origin.base_url + "/go", model="m", api_key="sk-secret", retries=0)
        timed = stream_request(
            endpoint, Request(id="r1", request_class="chat", prompt="hello"), DoctorConfig(max_new_tokens=4)
        )
    assert timed.num_output_tokens == 1
    assert origin.seen[0][2]["Authorization"] == "Bearer sk-secret"
    assert len(other.seen) == 1 and "Authorization" not in other.seen[0][2]


class Endless(ThreadedServer):
    """Answers every GET with a body that never ends (``chunk`` every ``gap_s``), or ``body`` at once."""

    def __init__(
        self,
        chunk: bytes = b"x" * 1024,
        gap_s: float = 0.01,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ):
        owner = self
        self.stop = False
        self.asked = threading.Event()  # set when the first GET arrives: a client is past its start-up

        class Handler(QuietHandler):
            def do_GET(self):  # noqa: N802
                owner.asked.set()
                if body is not None:
                    self.reply(200, body, "text/plain", headers)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                try:
                    while not owner.stop:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                        time.sleep(gap_s)
                except OSError:
                    pass

        super().__init__(Handler)

    def __exit__(self, *exc) -> None:
        self.stop = True
        super().__exit__(*exc)


# (server, client limits, what the one sentence says)
LIMIT_CASES = [
    (
        "endless-trickle",
        lambda: Endless(b"# x\n", 0.05),
        {"deadline_s": 1.0},
        "was still sending after the 1 s deadline",
    ),
    (
        "endless-fast",
        lambda: Endless(b"y" * 65536, 0.0),
        {"deadline_s": 60.0, "max_bytes": 2**20},
        "sent more than 1 MiB",
    ),
    ("large-body", lambda: Endless(body=b"z" * (2 * 2**20)), {"max_bytes": 2**20}, "sent more than 1 MiB"),
    (
        "gzip-bomb",
        lambda: Endless(body=gzip.compress(b"0" * (8 * 2**20)), headers={"Content-Encoding": "gzip"}),
        {"max_bytes": 2**20},
        "sent more than 1 MiB",
    ),
]


@pytest.mark.parametrize("name, server, limits, says", LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
def test_an_answer_past_the_deadline_or_the_size_cap_is_cut_in_one_sentence(name, server, limits, says):
    started = time.monotonic()
    with server() as endless:
        with pytest.raises(AnswerCut) as cut:
            HttpClient(retries=0, timeout_s=5, **limits).get(
                endless.base_url.replace("http://", "http://u:pw@") + "/metrics"
            )
    assert says in str(cut.value) and "pw" not in str(cut.value)
    assert time.monotonic() - started < 20


def test_a_streamed_answer_is_cut_at_the_deadline_too():
    with Endless(b"data: {}\n\n", 0.05) as endless:
        client = HttpClient(retries=0, deadline_s=1.0)
        started = time.monotonic()
        with pytest.raises(AnswerCut, match="deadline"):
            with client.stream("GET", endless.base_url) as (_, lines):
                for _ in lines:
                    pass
    assert time.monotonic() - started < 5


def test_watch_once_on_a_metrics_page_that_never_ends_returns(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "HTTP_DEADLINE_S", 1.0)
    with Endless(b"# HELP x y\n", 0.02) as endless:
        started = time.monotonic()
        result = CliRunner().invoke(
            app, ["watch", endless.base_url + "/metrics", "--once", "--out", str(tmp_path / "w")]
        )
    assert time.monotonic() - started < 30
    assert result.exit_code == 2, result.output
    assert "deadline" in result.output and "Traceback" not in result.output


def test_a_live_watch_stuck_on_a_page_that_never_ends_stops_on_sigterm(tmp_path):
    with Endless(b"# HELP x y\n", 0.02) as endless:
        watch = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dflash_doctor",
                "watch",
                endless.base_url + "/metrics",
                "--interval",
                "1s",
                "--out",
                str(tmp_path / "w"),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            # into the first scrape, past start-up (where the handlers are installed); a loaded machine takes seconds
            assert endless.asked.wait(timeout=120), watch.poll()
            assert watch.poll() is None, watch.communicate()[0]
            signalled = time.monotonic()
            watch.send_signal(signal.SIGTERM)
            output, _ = watch.communicate(timeout=60)
        finally:
            if watch.poll() is None:
                watch.kill()
    assert time.monotonic() - signalled < sources.HTTP_DEADLINE_S + 10, output
    assert watch.returncode == 0, output
    assert "Traceback" not in output


def test_a_server_that_stops_sending_mid_answer_is_one_sentence_with_the_wait():
    class Stalls(QuietHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b"half")
            self.wfile.flush()
            time.sleep(5)

    with ThreadedServer(Stalls) as server:
        with pytest.raises(Unreachable) as failed:
            HttpClient(retries=0, timeout_s=0.5).get(server.base_url + "/metrics")
    assert str(failed.value) == f"no complete answer from {server.base_url}/metrics (no data within 0.5 s)"
