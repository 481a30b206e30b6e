"""Requests and workloads.

A :class:`Request` is one conversation to replay: OpenAI-style ``messages`` (or a raw ``prompt`` that
is tokenised without a chat template), a request class (``math``, ``code``, ``chat``...) by which every
result is split, and per-request generation settings. Multi-turn conversations are replayed turn by
turn: every later user turn is asked after the target's OWN answer to the previous one (MT-Bench style),
so ``messages`` holds only the user/system turns plus any fixed assistant history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_doctor.errors import UsageError


@dataclass(frozen=True)
class Request:
    """One request to replay.

    ``messages``: OpenAI chat messages ``[{"role", "content"}]``; replay asks one assistant answer per
    trailing user turn (see module doc). ``prompt``: raw text used instead of a chat template.
    ``response``: a recorded answer, kept for teacher-forced replay when the user asks for it.
    """

    id: str
    request_class: str = "default"
    subclass: str = ""
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    max_new_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("a Request has exactly one of messages or prompt")


def _request_from_record(record: Any, source: str) -> Request:
    """Build a Request from one parsed record, or raise UsageError naming ``source`` (file:line)."""
    if not isinstance(record, dict):
        raise UsageError(f"{source}: expected a JSON object with `messages` or `prompt`; fix that line.")
    messages = record.get("messages")
    prompt = record.get("prompt")
    if messages is None and prompt is None:
        raise UsageError(f"{source}: the record has neither `messages` nor `prompt`; add one of them.")
    if messages is not None:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
        ):
            raise UsageError(f"{source}: `messages` must be a list of {{\"role\": str, \"content\": str}} objects; fix that line.")
        messages = tuple(dict(m) for m in messages)
        prompt = None
    elif not isinstance(prompt, str):
        raise UsageError(f"{source}: `prompt` must be a string; fix that line.")
    max_new = record.get("max_new_tokens", record.get("max_tokens"))
    if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1):
        raise UsageError(f"{source}: `max_new_tokens` must be a positive integer; fix that line.")
    kwargs = record.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise UsageError(f"{source}: `chat_template_kwargs` must be an object; fix that line.")
    request_class = record.get("class", "default")
    if not isinstance(request_class, str) or not request_class:
        raise UsageError(f"{source}: `class` must be a non-empty string; fix that line.")
    return Request(
        id=str(record.get("id", source.rsplit(":", 1)[-1])),
        request_class=request_class,
        subclass=str(record.get("subclass", "")),
        messages=messages,
        prompt=prompt,
        max_new_tokens=max_new,
        chat_template_kwargs=kwargs,
        response=record.get("response"),
    )


def read_jsonl(path: Path | str) -> list[Request]:
    """Read a JSONL workload: one request per line, blank lines ignored."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"workload file {path} does not exist; pass an existing .jsonl file or a built-in workload name.")
    requests = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            source = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{source}: not valid JSON ({exc.msg}); fix or remove that line.") from None
            requests.append(_request_from_record(record, source))
    if not requests:
        raise UsageError(f"workload file {path} holds no requests; add one JSON object per line.")
    return requests
