"""A server on 127.0.0.1 that records every request it gets and answers 404: the witness that a refused
command sent nothing (no API key, no prompt) anywhere (tests/test_hostile_config.py, test_exit_contract.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from local_servers import QuietHandler, ThreadedServer


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    authorization: str | None


@contextmanager
def recording_server() -> Iterator[tuple[str, list[Received]]]:
    """``(base_url, received)`` while the with-block runs: the list fills with one :class:`Received` per
    request, whatever its method."""
    received: list[Received] = []

    class Recorder(QuietHandler):
        def _record(self) -> None:
            received.append(Received(self.command, self.path, self.headers.get("Authorization")))
            self.reply(404, b"{}", "application/json")

        do_GET = do_POST = do_PUT = do_HEAD = _record

    with ThreadedServer(Recorder) as server:
        yield server.base_url, received
