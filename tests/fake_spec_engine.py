"""A fake speculative-decoding server for `tune`'s tests: OpenAI streaming on 127.0.0.1 with known costs.

It streams ``max_tokens`` tokens per request: the first after ``prefill_s``, the rest in verify steps of
``decode_s + draft_s + slope_s * K`` seconds (``decode_s`` alone at K = 0). Each step accepts
``min(K, 3)`` drafts when the prompt mentions "math", ``min(K, 1)`` otherwise, so tau, rollback and the
step cost model are known exactly. The final usage chunk carries vLLM's ``metrics.speculative_decoding``
(histogram and per-step arrays). Run as a script for a launched server:

    python tests/fake_spec_engine.py --port 8000 --k 4
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

from local_servers import QuietHandler  # tests/ is on sys.path under pytest and as a script

MODEL = "fake-spec"


@dataclass(frozen=True)
class FakeCosts:
    prefill_s: float = 0.01
    decode_s: float = 0.02
    draft_s: float = 0.02
    slope_s: float = 0.003

    def step_s(self, k: int) -> float:
        return self.decode_s + (self.draft_s + self.slope_s * k if k else 0.0)


def accepted_per_step(prompt: str, k: int) -> int:
    return min(k, 3 if "math" in prompt else 1)


def per_step_accepted(prompt: str, k: int, max_tokens: int) -> list[int]:
    """Accepted drafts of each verify step of one request (the last step is cut at ``max_tokens``)."""
    done, steps, accept = 1, [], accepted_per_step(prompt, k)
    while done < max_tokens:
        produced = min(accept + 1 if k else 1, max_tokens - done)
        steps.append(min(accept, produced) if k else 0)
        done += produced
    return steps


def make_handler(
    k: int,
    costs: FakeCosts,
    per_request: bool = True,
    arrivals: list[tuple[str, float]] | None = None,
    api_key: str | None = None,
):
    """``per_request=False``: a server started without per-request metrics; only ``/metrics`` counts.
    ``arrivals``: each request's (prompt, time.perf_counter() when it arrived) is appended to it.
    ``api_key``: like ``vllm serve --api-key``, every /v1 path and /metrics answers 401 without that bearer token."""
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    per_pos = [0] * k
    lock = threading.Lock()

    def exposition() -> str:
        label = f'model_name="{MODEL}"'
        lines = [
            f"vllm:spec_decode_num_drafts_total{{{label}}} {totals['drafts']}",
            f"vllm:spec_decode_num_draft_tokens_total{{{label}}} {totals['draft_tokens']}",
            f"vllm:spec_decode_num_accepted_tokens_total{{{label}}} {totals['accepted']}",
        ]
        lines += [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{i}"}} {n}'
            for i, n in enumerate(per_pos)
        ]
        return "\n".join(lines) + "\n" if k else ""

    class Handler(QuietHandler):
        def refused(self) -> bool:
            if api_key is None or self.headers.get("Authorization") == f"Bearer {api_key}":
                return False
            self.reply_json({"error": "Unauthorized"}, status=401)
            return True

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            if self.refused():
                return
            if self.path == "/v1/models":
                self.reply_json({"data": [{"id": MODEL}]})
            elif self.path == "/metrics":
                self.reply(200, exposition().encode(), "text/plain")
            else:
                self.send_error(404)

        def do_POST(self) -> None:  # noqa: N802 (http.server API)
            arrived = time.perf_counter()
            body = self.read_json()
            if self.refused():
                return
            prompt = body.get("prompt") or " ".join(m.get("content") or "" for m in body.get("messages") or [])
            if arrivals is not None:
                with lock:
                    arrivals.append((prompt, arrived))
            chat = "messages" in body
            n = int(body["max_tokens"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()

            def send(payload: dict) -> None:
                self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
                self.wfile.flush()

            def text_chunk(count: int) -> dict:
                text = "x " * count
                return {"choices": [{"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}]}

            time.sleep(costs.prefill_s)
            send(text_chunk(1))
            per_step = per_step_accepted(prompt, k, n)
            for accepted in per_step:
                time.sleep(costs.step_s(k))
                send(text_chunk(accepted + 1))
            final = {
                "choices": [],
                "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": n, "total_tokens": n},
            }
            with lock:
                totals["drafts"] += len(per_step)
                totals["draft_tokens"] += k * len(per_step)
                totals["accepted"] += sum(per_step)
                for accepted in per_step:
                    for i in range(accepted):
                        per_pos[i] += 1
            if k and per_request:
                histogram = [0] * (k + 1)
                for a in per_step:
                    histogram[a] += 1
                final["metrics"] = {
                    "speculative_decoding": {
                        "num_spec_tokens": k,
                        "num_spec_steps": len(per_step),
                        "num_draft_tokens": k * len(per_step),
                        "num_accepted_draft_tokens": sum(per_step),
                        "acceptance_histogram": histogram,
                        "per_step_accepted": per_step,
                        "per_step_drafted": [k] * len(per_step),
                    }
                }
            send(final)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler


def start(
    k: int,
    costs: FakeCosts = FakeCosts(),
    port: int = 0,
    per_request: bool = True,
    arrivals: list[tuple[str, float]] | None = None,
    api_key: str | None = None,
) -> ThreadingHTTPServer:
    """Serve in a daemon thread; ``server.server_address[1]`` is the port; ``shutdown()`` stops it."""
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(k, costs, per_request, arrivals, api_key))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--k", type=int, required=True)
    args = parser.parse_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args.k, FakeCosts())).serve_forever()
