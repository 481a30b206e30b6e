"""A hostile OpenAI-style server: every answer is a vLLM answer with one field made wrong, one mode per way.

It answers ``GET /v1/models``, ``GET /metrics`` (no speculative counters) and ``POST /v1/(chat/)completions``,
non-streamed (``check --engine``) and streamed with the usage chunk last (``tune``). A good answer carries
vLLM's ``metrics.speculative_decoding`` at K = 4: one accepted draft per step, ``(max_tokens - 1) // 2``
steps, the histogram and the per-step arrays. :data:`MODES` says what each mode changes in it; ``slow`` and
``drip`` change the timing instead. Every answered request is appended to ``log`` (a file: its path, whether it
was streamed, its Authorization header) after its last byte is sent, so a test can count what the server sent.

In a test: ``with hostile_server("negative") as url: ...``. As a script (a subprocess a test kills):
``python tests/hostile_server.py --port P --mode slow --log FILE``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_servers import QuietHandler  # noqa: E402  (tests/ on the path when run as a script)

MODEL = "hostile-model"
K = 4
SLOW_S = 1.0  # how long a ``slow`` answer takes
DRIP_S = 0.5  # the pause between two bytes of a ``drip`` answer


def _set(**fields: Any) -> Callable[[dict, dict], None]:
    def change(spec: dict, usage: dict) -> None:
        spec.update(fields)

    return change


def _steps(
    accepted: int | None = None, drafted: int | None = None, extra_drafted: int = 0
) -> Callable[[dict, dict], None]:
    def change(spec: dict, usage: dict) -> None:
        n = len(spec["per_step_accepted"])
        if accepted is not None:
            spec["per_step_accepted"] = [accepted] * n
        spec["per_step_drafted"] = [K if drafted is None else drafted] * (n + extra_drafted)

    return change


def _usage(value: Any) -> Callable[[dict, dict], None]:
    def change(spec: dict, usage: dict) -> None:
        usage["__replace__"] = value

    return change


#: mode -> what it does to the spec metrics and the usage of a good answer (None: nothing; a timing mode)
MODES: dict[str, Callable[[dict, dict], None] | None] = {
    "good": None,
    "slow": None,
    "drip": None,
    "unequal": _steps(extra_drafted=3),
    "negative": _set(
        num_accepted_draft_tokens=-5, acceptance_histogram=None, per_step_accepted=None, per_step_drafted=None
    ),
    "negative_step": _steps(accepted=-1),
    "negsteps": _set(num_spec_steps=-3, acceptance_histogram=None),
    "acc_gt_drafted": _set(num_accepted_draft_tokens=10**3),
    "acc_gt_zero_drafted": _set(num_draft_tokens=0, num_accepted_draft_tokens=50),
    "acc_without_steps": _set(num_spec_steps=0, num_accepted_draft_tokens=5, acceptance_histogram=None),
    "bigint": _set(num_accepted_draft_tokens=10**30, num_draft_tokens=10**31, num_spec_steps=10**25),
    "perstep_gt_k": _steps(accepted=K + 50),
    "drafted_gt_k": _steps(drafted=K + 50),
    "nan": _set(num_draft_tokens=float("nan")),
    "inf": _set(num_spec_steps=float("inf")),
    "float_count": _set(num_accepted_draft_tokens=2.5),
    "bool_count": _set(num_spec_steps=True),
    "string_steps": _set(per_step_accepted=["1"] * 3),
    "usage_list": _usage([1, 2]),
    "usage_str": _usage("x"),
    "usage_inf": _usage({"prompt_tokens": 3, "completion_tokens": float("inf")}),
    "usage_negative": _usage({"prompt_tokens": 3, "completion_tokens": -7}),
}
HOSTILE = [mode for mode in MODES if mode not in ("good", "slow", "drip")]


def answer(mode: str, max_tokens: int) -> tuple[dict, dict]:
    """(``metrics.speculative_decoding``, ``usage``) of one answer in ``mode``."""
    steps = [1] * max(1, (max_tokens - 1) // 2)
    spec: dict[str, Any] = {
        "num_spec_tokens": K,
        "num_spec_steps": len(steps),
        "num_draft_tokens": K * len(steps),
        "num_accepted_draft_tokens": sum(steps),
        "acceptance_histogram": [len(steps) if j == 1 else 0 for j in range(K + 1)],
        "per_step_accepted": steps,
        "per_step_drafted": [K] * len(steps),
    }
    usage: dict[str, Any] = {"prompt_tokens": 3, "completion_tokens": max_tokens, "total_tokens": max_tokens + 3}
    change = MODES[mode]
    if change is not None:
        change(spec, usage)
    return spec, usage.get("__replace__", usage)


def make_handler(mode: str, log: Path | None):
    lock = threading.Lock()

    class Handler(QuietHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            if self.path == "/v1/models":
                self.reply_json({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            elif self.path == "/metrics":
                self.reply(200, b"# no speculative counters\n", "text/plain")
            else:
                self.reply(404, b"{}", "application/json")

        def do_POST(self) -> None:  # noqa: N802 (http.server API)
            body = self.read_json()
            max_tokens = int(body.get("max_tokens") or 16)
            spec, usage = answer(mode, max_tokens)
            if mode == "slow":
                time.sleep(SLOW_S)
            if body.get("stream"):
                self.stream(body, max_tokens, spec, usage)
            else:
                choice: dict[str, Any] = {
                    "index": 0,
                    "finish_reason": "length",
                    "token_ids": list(range(100, 100 + max_tokens)),
                }
                text = "x " * max_tokens
                choice.update(
                    {"message": {"role": "assistant", "content": text}} if "messages" in body else {"text": text}
                )
                self.send_body(
                    json.dumps(
                        {
                            "id": "x",
                            "choices": [choice],
                            "prompt_token_ids": [1, 2, 3],
                            "usage": usage,
                            "metrics": {"speculative_decoding": spec},
                        }
                    ).encode()
                )
            if log is not None:
                with lock, log.open("a") as handle:
                    handle.write(
                        json.dumps(
                            {
                                "path": self.path,
                                "stream": bool(body.get("stream")),
                                "authorization": self.headers.get("Authorization"),
                            }
                        )
                        + "\n"
                    )

        def send_body(self, data: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if mode != "drip":
                self.wfile.write(data)
                return
            for byte in data:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(DRIP_S)

        def stream(self, body: dict, max_tokens: int, spec: dict, usage: Any) -> None:
            chat = "messages" in body
            chunks = [
                {"choices": [{"index": 0, "delta": {"content": "x "}} if chat else {"index": 0, "text": "x "}]}
            ] * max_tokens
            chunks.append({"choices": [], "usage": usage, "metrics": {"speculative_decoding": spec}})
            data = b"".join(f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks) + b"data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


@contextmanager
def hostile_server(mode: str, log: Path | None = None) -> Iterator[str]:
    """The server in a thread for the block; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(mode, log))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=sorted(MODES), required=True)
    parser.add_argument("--log", type=Path)
    args = parser.parse_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args.mode, args.log)).serve_forever()
