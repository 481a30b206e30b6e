"""User workload files: JSONL, CSV or Parquet with ``messages`` (OpenAI chat format) or ``prompt``, OpenAI
request bodies captured from a gateway included; each line or row checked (encoding, CSV quoting, chat
roles) with one sentence naming the file, the line and the fix; :func:`save_workload` writes JSONL back.

Its own module because it is the input boundary for files from outside: parsing and validation only.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Iterable

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.workloads.request import Request


FILE_SUFFIXES = (".jsonl", ".csv", ".parquet")


def _text_content(content: Any, source: str) -> str | None:
    """A message's content as text: a string, or OpenAI text parts joined by newlines (as vLLM does)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise UsageError(
                f"{source}: only text content parts are supported (no images or audio); remove the other parts."
            )
        return "\n".join(p["text"] for p in content)
    raise UsageError(f"{source}: a message `content` must be a string or a list of text parts; fix that line.")


# The roles of the OpenAI chat API, which chat templates are written for: another role (ShareGPT's
# human / gpt) would be templated as it is, a prompt the model never saw in training or serving.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _parse_messages(messages: Any, source: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise UsageError(
            f'{source}: `messages` must be a non-empty list of {{"role", "content"}} objects; fix that line.'
        )
    parsed = []
    for message in messages:
        if not isinstance(message.get("role"), str):
            raise UsageError(f"{source}: every message needs a string `role`; fix that line.")
        if message["role"] not in CHAT_ROLES:
            raise UsageError(
                f"{source}: role {message['role']!r} is not a chat role ({', '.join(CHAT_ROLES)}); rename it "
                f"(ShareGPT's human and gpt are user and assistant)."
            )
        content = _text_content(message.get("content"), source)
        if content is None and not (message["role"] == "assistant" and message.get("tool_calls")):
            raise UsageError(f"{source}: a {message['role']} message has no `content`; add the text.")
        parsed.append({**message, "content": content})
    if parsed[-1]["role"] == "assistant":
        raise UsageError(
            f"{source}: the last message is from the assistant, so there is nothing to answer; end with a user message."
        )
    return tuple(parsed)


def _response_text(response: Any, source: str) -> str | None:
    """A recorded answer: a string, or an OpenAI chat completion object (its first choice's text)."""
    if response is None or isinstance(response, str):
        return response
    try:
        text = response["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        text = None
    if not isinstance(text, str):
        raise UsageError(f"{source}: `response` must be a string or an OpenAI chat completion object; fix that line.")
    return text


def _request_from_record(record: Any, source: str, default_id: str) -> Request:
    """Build a Request from one parsed record, or raise UsageError naming ``source`` (file:line).

    Unknown keys are ignored, so OpenAI request bodies (``model``, ``temperature``...) load as they are;
    ``max_tokens`` / ``max_completion_tokens`` stand in for ``max_new_tokens``.
    """
    if not isinstance(record, dict):
        raise UsageError(f"{source}: expected a JSON object with `messages` or `prompt`; fix that line.")
    messages, prompt = record.get("messages"), record.get("prompt")
    if messages is None and prompt is None:
        raise UsageError(f"{source}: the record has neither `messages` nor `prompt`; add one of them.")
    if messages is not None and prompt is not None:
        raise UsageError(f"{source}: the record has both `messages` and `prompt`; keep one of them.")
    if messages is not None:
        messages = _parse_messages(messages, source)
    elif not isinstance(prompt, str):
        raise UsageError(f"{source}: `prompt` must be a string; fix that line.")
    max_new = next(
        (record[k] for k in ("max_new_tokens", "max_tokens", "max_completion_tokens") if record.get(k) is not None),
        None,
    )
    if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1):
        raise UsageError(f"{source}: `max_new_tokens` must be a positive integer; fix that line.")
    kwargs = record.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise UsageError(f"{source}: `chat_template_kwargs` must be an object; fix that line.")
    request_class = record.get("class", "default")
    if not isinstance(request_class, str) or not request_class:
        raise UsageError(f"{source}: `class` must be a non-empty string; fix that line.")
    subclass = record.get("subclass", "")
    if not isinstance(subclass, str):
        raise UsageError(f"{source}: `subclass` must be a string; fix that line.")
    request_id = record.get("id", default_id)
    if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
        raise UsageError(f"{source}: `id` must be a string or an integer; fix that line.")
    return Request(
        id=str(request_id),
        request_class=request_class,
        subclass=subclass,
        messages=messages,
        prompt=prompt,
        max_new_tokens=max_new,
        chat_template_kwargs=dict(kwargs),
        response=_response_text(record.get("response"), source),
    )


def _checked(requests: list[Request], sources: list[str], path: Path) -> list[Request]:
    """Refuse an empty file and duplicate ids (every result table is keyed by request id)."""
    if not requests:
        raise UsageError(f"workload file {path} holds no requests; add one request per line or row.")
    first_seen: dict[str, str] = {}
    for request, source in zip(requests, sources):
        if request.id in first_seen:
            raise UsageError(
                f"{source}: id {request.id!r} is already used at "
                f"{first_seen[request.id]}; give every request its own id."
            )
        first_seen[request.id] = source
    return requests


def read_jsonl(path: Path | str) -> list[Request]:
    """Read a JSONL workload: one request (or OpenAI request body) per line, blank lines ignored."""
    path = _existing(path)
    requests, sources = [], []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            source = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{source}: not valid JSON ({exc.msg}); fix or remove that line.") from None
            requests.append(_request_from_record(record, source, default_id=str(line_number)))
            sources.append(source)
    return _checked(requests, sources, path)


_JSON_COLUMNS = ("messages", "chat_template_kwargs")  # nested values stored as JSON text in CSV/Parquet
_INTEGER_COLUMNS = ("max_new_tokens", "max_tokens", "max_completion_tokens")


def _decode_flat_record(record: dict[str, Any], source: str) -> dict[str, Any]:
    """Turn a CSV/Parquet row into a JSON-like record: empty cells are absent, JSON text is parsed,
    integer columns become ints (an id stays text)."""
    decoded = {}
    for key, value in record.items():
        if value is None or value == "" or key is None:
            continue
        if key in _JSON_COLUMNS and isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{source}: column `{key}` is not valid JSON ({exc.msg}); fix that row.") from None
        elif key in _INTEGER_COLUMNS and isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                raise UsageError(f"{source}: column `{key}` must be an integer, not {value!r}; fix that row.") from None
        decoded[key] = value
    return decoded


def read_csv(path: Path | str) -> list[Request]:
    """Read a CSV workload: a header row, then one request per row; ``messages`` and
    ``chat_template_kwargs`` cells hold JSON text. Errors name the line where the row starts."""
    path = _existing(path)
    requests, sources = [], []
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle, strict=True)  # strict: a stray quote is an error, not a cell swallowing rows
        quoting = 'quote cells that hold commas, quotes or line breaks ("a, b" with "" for a quote inside)'
        try:
            if reader.fieldnames is None or not {"messages", "prompt"} & set(reader.fieldnames):
                raise UsageError(f"{path}:1: the CSV header has no `messages` or `prompt` column; add one of them.")
            next_row_line = reader.line_num + 1
            for row in reader:
                row_line, next_row_line = next_row_line, reader.line_num + 1  # a quoted cell may span lines
                source = f"{path}:{row_line}"
                if None in row:  # DictReader files cells beyond the header under None
                    raise UsageError(f"{source}: the row has more cells than the header has columns; {quoting}.")
                requests.append(
                    _request_from_record(_decode_flat_record(row, source), source, default_id=str(row_line))
                )
                sources.append(source)
        except csv.Error as exc:
            raise UsageError(f"{path}:{reader.line_num}: the CSV is malformed ({exc}); {quoting}.") from None
    return _checked(requests, sources, path)


def _drop_nulls(value: Any) -> Any:
    """Parquet gives every struct all the keys seen in its column, with None where a row lacked one."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None or k == "content"}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def read_parquet(path: Path | str) -> list[Request]:
    """Read a Parquet workload: one request per row; ``messages`` as a list of structs or JSON text."""
    import pyarrow.parquet as pq  # pandas' engine; imported here so the JSONL path does not pay for it

    path = _existing(path)
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a corrupt or non-Parquet file
        raise UsageError(
            f"workload file {path} is not a readable Parquet file ({exc}); rewrite it or use JSONL."
        ) from None
    requests, sources = [], []
    for row_number, row in enumerate(rows, start=1):
        source = f"{path} row {row_number}"
        requests.append(
            _request_from_record(_decode_flat_record(_drop_nulls(row), source), source, default_id=str(row_number))
        )
        sources.append(source)
    return _checked(requests, sources, path)


def _existing(path: Path | str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise UsageError(
            f"workload file {path} does not exist; pass an existing "
            f"{'/'.join(FILE_SUFFIXES)} file or a built-in workload name."
        )
    return path


def read_workload_file(path: Path | str) -> list[Request]:
    """Read a user workload by its suffix: .jsonl, .csv or .parquet."""
    path = Path(path)
    readers = {".jsonl": read_jsonl, ".csv": read_csv, ".parquet": read_parquet}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise UsageError(
            f"workload file {path} has suffix {path.suffix or '(none)'}; use a {'/'.join(FILE_SUFFIXES)} file."
        )
    try:
        return reader(path)
    except UnicodeDecodeError:
        raise UsageError(
            f"workload file {_first_undecodable(path)} is not UTF-8 text; re-save the file as UTF-8."
        ) from None


def _first_undecodable(path: Path) -> str:
    """``path:line (byte 0x..)`` of the first byte that is not UTF-8 (the text reader only says which chunk)."""
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        return f"{path}:{line} (byte {raw[exc.start]:#04x})"
    return str(path)


def _record_of(request: Request) -> dict[str, Any]:
    record: dict[str, Any] = {"id": request.id, "class": request.request_class}
    if request.subclass:
        record["subclass"] = request.subclass
    if request.messages is not None:
        record["messages"] = [dict(m) for m in request.messages]
    else:
        record["prompt"] = request.prompt
    if request.max_new_tokens is not None:
        record["max_new_tokens"] = request.max_new_tokens
    if request.chat_template_kwargs:
        record["chat_template_kwargs"] = request.chat_template_kwargs
    if request.response is not None:
        record["response"] = request.response
    return record


def save_workload(requests: Iterable[Request], path: Path | str) -> Path:
    """Write requests as a .jsonl, .csv or .parquet workload that :func:`load_workload` reads back
    unchanged (e.g. to edit a built-in set). CSV and Parquet hold nested values as JSON text."""
    path = Path(path)
    records = [_record_of(r) for r in requests]
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise UsageError(f"cannot write workload {path}: use a {'/'.join(FILE_SUFFIXES)} file name.")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        return path
    flat = [{k: json.dumps(v, ensure_ascii=False) if k in _JSON_COLUMNS else v for k, v in r.items()} for r in records]
    columns = list(dict.fromkeys(k for r in flat for k in r))
    if suffix == ".csv":
        with path.open("w", encoding="utf-8", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(flat)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in flat]), path)
    return path
