"""Test helpers for the real servers the tests start (Streamlit dashboard, Prometheus, vLLM): a free local
port, and the wait until a server answers. One wait loop, so every server test fails the same way: with
the reason (the process exited, or it never answered) instead of hanging or a bare connection error.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
