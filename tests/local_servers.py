"""Test helpers for the servers the tests start: the real ones (Streamlit dashboard, Prometheus, vLLM,
llama.cpp) get a free local port, the wait until a server answers, and an engine server run in its own
process group. One wait loop, so every server test fails the same way: with the reason (the process
exited, or it never answered) instead of hanging or a bare connection error. The small fakes written in
the tests (an exporter, an engine, a webhook) get one quiet request handler with one way to answer, and
one server in a thread for the length of a with-block.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self

import pytest


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class QuietHandler(BaseHTTPRequestHandler):
    """A fake server's request handler: no access log on the test's stderr, and one way to answer."""

    def log_message(self, *args) -> None:
        pass

    def reply(
        self, status: int, body: bytes = b"", content_type: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        """Answer ``status`` with ``body`` (its length always sent, so a client never waits for more)."""
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def reply_json(self, value: object, status: int = 200) -> None:
        self.reply(status, json.dumps(value).encode(), "application/json")

    def read_json(self):
        """The request's JSON body."""
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))


class ThreadedServer:
    """An HTTP server on 127.0.0.1 (``port``, or one the OS picks) answering with ``handler`` in a daemon
    thread while a with-block runs; ``base_url`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def wait_until_answering(url: str, process: subprocess.Popen, timeout_s: float, poll_s: float = 0.3) -> str | None:
    """Poll ``url`` until it answers HTTP 200; None then, else why not (``process`` exited, or the time ran out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return None
        except OSError:
            pass
        if process.poll() is not None:
            return f"the server exited with {process.returncode} before {url} answered"
        if time.monotonic() > deadline:
            return f"{url} did not answer within {timeout_s:.0f} s"
        time.sleep(poll_s)


@dataclass
class LocalServer:
    """A serving engine the tests started: its URL, the process (its own group's leader) and the log file."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def stop(self) -> None:
        """SIGTERM the server's own process group, then SIGKILL whatever is left after 30 s."""
        if self.process.poll() is not None:
            return
        group = os.getpgid(self.process.pid)
        os.killpg(group, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(group, signal.SIGKILL)  # children that outlived the server (vLLM's engine core)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)


def start_local_server(
    name: str,
    command: list[str],
    url: str,
    ready_path: str,
    log_path: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> LocalServer:
    """Launch ``command`` in a new session (so it can be stopped by its group alone), logging to ``log_path``,
    and wait until ``url + ready_path`` answers; a server that exits or never answers is stopped and its log
    tail raised."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = LocalServer(url, process, log_path)
    try:
        not_ready = wait_until_answering(url + ready_path, process, timeout_s, poll_s=1)
        if not_ready is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} did not start: {not_ready}; {log_path}:\n{tail}")
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session", autouse=True)
def stop_servers_on_sigterm():
    """A CI timeout sends SIGTERM: turn it into SystemExit so the server fixtures stop their servers.
    Autouse in a test module that imports it."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    yield
    signal.signal(signal.SIGTERM, previous)
