"""Per-request metrics in captured responses: vLLM captured
from the real server, SGLang and llama.cpp from their fields.

* vLLM: tests/data/telemetry/vllm_responses_good.jsonl, chat completions from the real vLLM 0.32.0 CPU
  server started with ``--per-request-spec-decode-metrics detailed``, each wrapped as
  ``{"class", "time", "response"}`` by the capturing client.
* SGLang: srt/entrypoints/openai/protocol.py ``SpecTokensDetails`` (``sglext.spec_tokens_details``) and
  srt/managers/tokenizer_manager.py ``_calculate_spec_decoding_metrics`` (``meta_info`` of /generate):
  ``spec_verify_ct``, ``spec_num_proposed_drafts``, ``spec_num_correct_drafts``,
  ``spec_correct_drafts_histogram``.
* llama.cpp: tools/server/server-task.cpp ``result_timings::to_json``: ``draft_n``, ``draft_n_accepted``
  only when drafting ran (a real chunk's fields).
"""

from __future__ import annotations

import json

import pytest

from dflash_doctor.telemetry.observation import ParseProblems
from dflash_doctor.telemetry.captured_responses import parse_response_lines
from telemetry_fixtures import DATA


def parse(lines):
    problems = ParseProblems()
    return list(parse_response_lines(lines, default_model="m", origin="r.jsonl", problems=problems)), problems


def test_vllm_real_responses_per_class():
    lines = (DATA / "vllm_responses_good.jsonl").read_text().splitlines()
    observations, problems = parse(lines)
    assert problems.count == 0 and len(observations) == len(lines)
    for obs, line in zip(observations, lines):
        spec = json.loads(line)["response"]["metrics"]["speculative_decoding"]
        assert obs.key.cls == json.loads(line)["class"]
        # vLLM's own per-request mean acceptance length equals ours from its counts
        assert obs.counts.mean_acceptance_length == pytest.approx(spec["mean_acceptance_length"])
        assert obs.counts.k == spec["num_spec_tokens"]
        assert sum(obs.counts.num_accepted_tokens_per_pos) == spec["num_accepted_draft_tokens"]


def test_sglang_and_llamacpp_payloads():
    sglang = {
        "id": "x",
        "model": "qwen",
        "choices": [{"index": 0, "message": {"content": "hi"}}],
        "sglext": {
            "spec_tokens_details": {
                "spec_verify_ct": 20,
                "spec_num_proposed_drafts": 60,
                "spec_num_correct_drafts": 25,
                "spec_accept_length": 2.3,
                "spec_accept_rate": 0.42,
                "spec_correct_drafts_histogram": [5, 7, 6, 2],
            }
        },
        "usage": {"completion_tokens": 46},
    }
    llamacpp = {
        "content": "hi",
        "timings": {"prompt_n": 4, "predicted_n": 665, "draft_n": 604, "draft_n_accepted": 515},
    }
    plain = {"content": "no speculation", "timings": {"prompt_n": 4, "predicted_n": 10}}
    observations, problems = parse(
        [json.dumps({"class": "code", "response": sglang}), json.dumps(llamacpp), json.dumps(plain), "not json"]
    )
    assert problems.count == 1
    sg, lc = observations
    assert sg.key.model == "qwen" and sg.key.cls == "code"
    assert sg.counts.mean_acceptance_length == pytest.approx(1 + 25 / 20)  # vLLM's definition, not SGLang's 2.3
    assert sg.counts.num_accepted_tokens_per_pos == (15.0, 8.0, 2.0)
    assert lc.counts.draft_acceptance_rate == pytest.approx(515 / 604) and lc.counts.mean_acceptance_length is None
