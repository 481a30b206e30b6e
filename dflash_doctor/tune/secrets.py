"""Secrets kept out of everything tune writes: launch commands in tune.json and the servers' own output.

Real engines print their arguments at start-up, the API key among them, so a launched server's output is
redacted while it is copied into ``server-k<K>.log``: the file never holds a secret, not even for the
seconds before the server stops, and not after a run killed halfway (a rewrite after the fact would leave
the raw text behind on exactly the runs that end badly).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import IO

_SECRET = re.compile(
    r"((?:--api-key|--hf-token|--token)(?:=|\s+))(\S+)|(\b\w*(?:API_KEY|TOKEN|SECRET)\w*=)(\S+)", re.IGNORECASE
)

#: ``scheme://user:password@``: the userinfo of any URL in a text.
_URL_USERINFO = re.compile(r"(\b[A-Za-z][\w+.-]*://)[^/\s@'\"]+@")

#: The longest piece of one output line handled at once: a longer line is redacted piece by piece, so a
#: server printing without newlines cannot make the copier hold its whole output in memory.
LINE_PIECE_BYTES = 1 << 20


def redact(command: str) -> str:
    """The launch command as tune.json records it: values of key/token flags and variables replaced by ***
    (a run directory never holds a secret)."""
    return _URL_USERINFO.sub(r"\1***@", _SECRET.sub(lambda m: (m.group(1) or m.group(3)) + "***", command))


def known_secrets(command: str | None, api_key: str | None) -> list[str]:
    """The secret values the tool knows for one server: its --api-key and every key/token value or URL
    password its launch command holds (the values :func:`redact` hides)."""
    values = [api_key] if api_key else []
    for match in _SECRET.finditer(command or ""):
        values.append((match.group(2) or match.group(4) or "").strip("'\""))
    for match in _URL_USERINFO.finditer(command or ""):
        values.extend(part for part in match.group(0).split("//", 1)[1].rstrip("@").split(":") if part)
    return sorted({v for v in values if len(v) >= 4}, key=len, reverse=True)  # 3-letter "key" values would eat words


def redact_text(text: str, secrets: list[str]) -> str:
    """``text`` with every known secret value, every key/token flag value and every URL's userinfo as ***."""
    for value in secrets:
        text = text.replace(value, "***")
    return redact(text)


def _safe_cut(text: bytes, secrets: list[bytes]) -> int:
    """Where a piece of a long line may be cut so that no secret is split: before the last (longest secret - 1)
    bytes, which could start a secret that the next piece ends, and before any secret the cut would cross."""
    cut = len(text) - max((len(value) - 1 for value in secrets), default=0)
    moved = True
    while moved and cut > 0:
        moved = False
        for value in secrets:
            start = text.find(value, max(cut - len(value) + 1, 0))
            if 0 <= start < cut:
                cut, moved = start, True
    return max(cut, 0)


def copy_redacted(source: IO[bytes], log_path: Path, secrets: list[str]) -> threading.Thread:
    """Copy a server's output, line by line and redacted, into ``log_path`` from a background thread that
    ends when the output does (the server has stopped). The caller joins it after stopping the server."""

    encoded = [value.encode("utf-8") for value in secrets]

    def copy() -> None:
        held = b""  # the end of a line's last piece, not written yet: it may hold the start of a secret
        with source, log_path.open("w", encoding="utf-8") as log:
            while piece := source.readline(LINE_PIECE_BYTES):
                text = held + piece
                cut = len(text) if text.endswith(b"\n") else _safe_cut(text, encoded)
                text, held = text[:cut], text[cut:]
                log.write(redact_text(text.decode("utf-8", errors="replace"), secrets))
                log.flush()  # a failed start quotes the log's tail: it must be on disk already
            log.write(redact_text(held.decode("utf-8", errors="replace"), secrets))

    thread = threading.Thread(target=copy, name=f"copy {log_path.name}", daemon=True)
    thread.start()
    return thread
