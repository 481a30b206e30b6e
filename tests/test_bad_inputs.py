"""Bad inputs, table-driven, one table per boundary: every one is refused in one sentence
naming the input and the fix (UsageError, exit 2 through the CLI), before any work, never a traceback
and never a silent repair. Good inputs next to them must still load, so a rule cannot refuse everything.

Boundaries and the number of bad inputs each table tries: workload files (WORKLOADS), model folders
(MODEL_FOLDERS, WEIGHTS), config files (CONFIG_FILES), check parameters (CHECK_PARAMS), engine responses
(RESPONSES), engine log lines (LOG_LINES)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from dflash_doctor.checks.base import validate_check_params
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.config import build_config, parse_int_grid, parse_k
from dflash_doctor.inputs.validation import check_model_folder
from dflash_doctor.inputs.workloads import load_workload
from dflash_doctor.rundir.load import load_run
from dflash_doctor.serving.server_run import read_completion
from dflash_doctor.serving.responses import MalformedResponse, check_measurement, check_response_shape, parse_response
from dflash_doctor.telemetry.logs import LogContext, parse_log_lines
from dflash_doctor.telemetry.observation import ParseProblems
from dflash_doctor.telemetry.captured_responses import parse_response_lines
from local_servers import QuietHandler, ThreadedServer
from cli_helpers import assert_usage_error, invoke

GOLDEN = Path(__file__).parent / "golden"


def one_sentence(message: str, *fragments: str) -> None:
    assert message.rstrip().endswith("."), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# ----------------------------------------------------------------------------------------------------
# Workload files

USER = {"role": "user", "content": "hi"}
WORKLOADS = [
    (
        "latin1.jsonl",
        json.dumps({"messages": [USER]}).encode() + b"\n" + '{"prompt": "café"}'.encode("latin-1") + b"\n",
        ":2 (byte 0xe9) is not UTF-8 text",
    ),
    ("utf16.jsonl", json.dumps({"prompt": "x"}).encode("utf-16"), "is not UTF-8 text"),
    ("latin1.csv", 'prompt\n"caf'.encode() + "é".encode("latin-1") + b'"\n', "(byte 0xe9) is not UTF-8 text"),
    ("stray_quote.csv", b'id,prompt\na,"hello" world\n', "the CSV is malformed"),
    ("open_quote.csv", b'id,prompt\na,"hello\nb,bye\n', "the CSV is malformed"),
    ("extra_cells.csv", b"id,prompt\na,hello, world\n", ":2: the row has more cells than the header"),
    (
        "human.jsonl",
        json.dumps({"messages": [{"role": "human", "content": "hi"}]}).encode(),
        "role 'human' is not a chat role",
    ),
    (
        "gpt.jsonl",
        json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "gpt", "content": "a"}, USER]}).encode(),
        "role 'gpt' is not a chat role",
    ),
    (
        "empty_role.jsonl",
        json.dumps({"messages": [{"role": "", "content": "hi"}]}).encode(),
        "role '' is not a chat role",
    ),
    (
        "role_case.jsonl",
        json.dumps({"messages": [{"role": "User", "content": "hi"}]}).encode(),
        "role 'User' is not a chat role",
    ),
    ("bom.jsonl", b"\xef\xbb\xbf" + json.dumps({"prompt": "x"}).encode(), "not valid JSON"),
    ("nul.jsonl", b'{"prompt": "x"}\x00\n', "not valid JSON"),
    (
        "string_limit.jsonl",
        json.dumps({"prompt": "x", "max_new_tokens": "5"}).encode(),
        "`max_new_tokens` must be a positive integer",
    ),
]


@pytest.mark.parametrize("name, content, fragment", WORKLOADS, ids=[case[0] for case in WORKLOADS])
def test_a_bad_workload_file_is_refused_naming_the_file(tmp_path, name, content, fragment):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UsageError) as refused:
        load_workload(str(path))
    one_sentence(str(refused.value.message), str(path), fragment)


def test_good_workload_files_next_to_the_bad_ones_still_load(tmp_path):
    (tmp_path / "ok.csv").write_text('id,prompt\na,"hello, ""quoted"" world"\nb,"two\nlines"\n', encoding="utf-8")
    assert [r.prompt for r in load_workload(str(tmp_path / "ok.csv"))] == ['hello, "quoted" world', "two\nlines"]
    roles = [{"role": role, "content": "x"} for role in ("system", "developer", "user", "assistant", "user")]
    (tmp_path / "ok.jsonl").write_text(json.dumps({"messages": roles}) + "\n", encoding="utf-8")
    assert load_workload(str(tmp_path / "ok.jsonl"))[0].messages is not None


# ----------------------------------------------------------------------------------------------------
# Model folders: config.json and weights


def draft_copy(
    tiny_dir: Path, tmp_path: Path, edit=None, config_text: str | None = None, weights: bytes | None = None
) -> Path:
    """A copy of the tiny DFlash draft with its config edited
    (``edit(config)``) or replaced, or its weights replaced."""
    out = tmp_path / "draft"
    out.mkdir()
    config = json.loads((tiny_dir / "dflash" / "config.json").read_text())
    if edit is not None:
        edit(config)
    (out / "config.json").write_text(config_text if config_text is not None else json.dumps(config))
    (out / "model.safetensors").write_bytes(
        weights if weights is not None else (tiny_dir / "dflash" / "model.safetensors").read_bytes()
    )
    return out


def _set(path: str, value):
    def edit(config: dict) -> None:
        *parents, key = path.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[key] = value

    return edit


MODEL_FOLDERS = [
    (
        "layer_ids_floats",
        _set("dflash_config.target_layer_ids", [0.0, 2.7]),
        "`dflash_config.target_layer_ids` is [0.0, 2.7]",
    ),
    (
        "layer_ids_strings",
        _set("dflash_config.target_layer_ids", ["0", "2"]),
        '`dflash_config.target_layer_ids` is ["0", "2"]',
    ),
    ("layer_ids_empty", _set("dflash_config.target_layer_ids", []), "a non-empty list of integer layer indices"),
    ("layer_ids_negative", _set("dflash_config.target_layer_ids", [-1, 2]), "integer layer indices >= 0"),
    ("layer_ids_bools", _set("dflash_config.target_layer_ids", [True, False]), "integer layer indices >= 0"),
    ("layer_ids_scalar", _set("dflash_config.target_layer_ids", 2), "a non-empty list"),
    ("mask_token_float", _set("dflash_config.mask_token_id", 3.5), "`dflash_config.mask_token_id` is 3.5"),
    ("mask_token_negative", _set("dflash_config.mask_token_id", -1), "an integer token id >= 0"),
    ("block_size_zero", _set("block_size", 0), "`block_size` is 0, but it must be an integer >= 1"),
    ("block_size_string", _set("block_size", "6"), '`block_size` is "6"'),
    ("hidden_size_bool", _set("hidden_size", True), "`hidden_size` is true"),
    ("layers_float", _set("num_hidden_layers", 2.0), "`num_hidden_layers` is 2.0"),
    ("eps_negative", _set("rms_norm_eps", -1e-6), "`rms_norm_eps` is -1e-06, but it must be a positive number"),
    ("vocab_string", _set("vocab_size", "512"), '`vocab_size` is "512"'),
]
CONFIG_TEXTS = [
    ("not_json", "{'hidden_size': 32}", "is not valid JSON"),
    ("truncated_json", '{"hidden_size": 32, "dflash_con', "is not valid JSON"),
    ("json_list", "[1, 2, 3]", "holds a JSON list, not an object"),
    ("empty", "", "is not valid JSON"),
]


@pytest.mark.parametrize("name, edit, fragment", MODEL_FOLDERS, ids=[case[0] for case in MODEL_FOLDERS])
def test_a_draft_config_key_of_the_wrong_type_or_range_is_refused_not_truncated(
    tiny_dir, tmp_path, name, edit, fragment
):
    draft = draft_copy(tiny_dir, tmp_path, edit)
    with pytest.raises(UsageError) as refused:
        check_model_folder(draft)
    one_sentence(str(refused.value.message), str(draft / "config.json"), fragment, "fix the value")


@pytest.mark.parametrize("name, text, fragment", CONFIG_TEXTS, ids=[case[0] for case in CONFIG_TEXTS])
def test_a_config_json_that_is_not_a_json_object_is_refused(tiny_dir, tmp_path, name, text, fragment):
    draft = draft_copy(tiny_dir, tmp_path, config_text=text)
    with pytest.raises(UsageError) as refused:
        check_model_folder(draft)
    one_sentence(str(refused.value.message), str(draft / "config.json"), fragment)


def _weights(tiny_dir: Path) -> bytes:
    return (tiny_dir / "dflash" / "model.safetensors").read_bytes()


def _without_a_shape(raw: bytes) -> bytes:
    """The same file with one tensor's shape removed from its header."""
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    del header[next(name for name in header if name != "__metadata__")]["shape"]
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + raw[8 + length :]


WEIGHTS = [
    ("tensor_without_shape", _without_a_shape, "has shape null, not a list of integers >= 0"),
    ("truncated_tail", lambda raw: raw[:-100], "is truncated"),
    ("truncated_half", lambda raw: raw[: len(raw) // 2], "is truncated"),
    ("header_only", lambda raw: raw[: 8 + struct.unpack("<Q", raw[:8])[0]], "is truncated"),
    ("empty", lambda raw: b"", "too short to be safetensors"),
    ("header_length_lies", lambda raw: struct.pack("<Q", 10**12) + raw[8:], "is truncated or not safetensors"),
    ("header_not_json", lambda raw: raw[:8] + b"\xff" * (len(raw) - 8), "has a header that is not JSON"),
    ("html_error_page", lambda raw: b"<html><body>404 Not Found</body></html>", "not safetensors"),
]


@pytest.mark.parametrize("name, damage, fragment", WEIGHTS, ids=[case[0] for case in WEIGHTS])
def test_a_damaged_safetensors_file_is_refused_before_loading(tiny_dir, tmp_path, name, damage, fragment):
    draft = draft_copy(tiny_dir, tmp_path, weights=damage(_weights(tiny_dir)))
    with pytest.raises(UsageError) as refused:
        check_model_folder(draft)
    one_sentence(
        str(refused.value.message), str(draft / "model.safetensors"), fragment, "download or copy the file again"
    )


def test_the_cli_refuses_a_truncated_draft_and_float_layer_ids_with_exit_2(tiny_dir, tmp_path):
    truncated = draft_copy(tiny_dir, tmp_path, weights=_weights(tiny_dir)[:-64])
    args = ["--target", tiny_dir / "target", "--workload", tiny_dir / "workload.jsonl", "--max-new-tokens", "4"]
    assert_usage_error(
        invoke("replay", "--draft", truncated, *args, "--out", tmp_path / "a"), "model.safetensors is truncated"
    )
    (truncated / "model.safetensors").write_bytes(_weights(tiny_dir))
    (truncated / "config.json").write_text(
        json.dumps(
            {
                **json.loads((truncated / "config.json").read_text()),
                "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 2.5]},
            }
        )
    )
    assert_usage_error(
        invoke("replay", "--draft", truncated, *args, "--out", tmp_path / "b"),
        "`dflash_config.target_layer_ids` is [0, 2.5]",
    )
    assert check_model_folder(tiny_dir / "dflash")["dflash_config"]["target_layer_ids"]  # the good draft passes


# ----------------------------------------------------------------------------------------------------
# Config files

CONFIG_FILES = [
    ('temperature = "0.5"', "`temperature` is '0.5', but it must be a number"),
    ("max_new_tokens = 12.5", "`max_new_tokens` is 12.5, but it must be an integer"),
    ("max_requests = true", "`max_requests` is True, but it must be an integer"),
    ("seed = 1.0", "`seed` is 1.0, but it must be an integer"),
    ("k = 1.5", "`k` is 1.5"),
    ('k = ["2", "4"]', "`k` is ['2', '4']"),
    ("classes = 3", "`classes` is 3, but it must be a string or a list of strings"),
    ("out = 5", "`out` is 5, but it must be a string"),
    ('trust_remote_code = "yes"', "`trust_remote_code` is 'yes', but it must be true or false"),
    ('thresholds = "strict"', "`thresholds` is 'strict', but it must be a table"),
    ("checks = 3", "`checks` is 3, but it must be a table"),
    ("[checks]\nlossless = 3", "`checks` is {'lossless': 3}"),
    ("engine_concurrency = 2.0", "`engine_concurrency` is 2.0, but it must be an integer"),
    ("devices = [0, 1]", "`devices` is [0, 1]"),
]


@pytest.mark.parametrize("text, fragment", CONFIG_FILES, ids=[case[0] for case in CONFIG_FILES])
def test_a_config_file_value_of_the_wrong_type_is_refused_naming_the_key(tmp_path, text, fragment):
    path = tmp_path / "doctor.toml"
    path.write_text(text + "\n", encoding="utf-8")
    with pytest.raises(UsageError) as refused:
        build_config(path)
    one_sentence(str(refused.value.message), f"config file {path}", fragment, "fix the value")


def test_a_config_file_with_well_typed_values_loads(tmp_path):
    path = tmp_path / "doctor.toml"
    path.write_text(
        'temperature = 1\nk = "1-4"\nclasses = "math,code"\n'
        'devices = ["cuda:0"]\n[checks.lossless]\nnear_tie_ulps = 3\n',
        encoding="utf-8",
    )
    config = build_config(path)
    assert (config.temperature, config.k, config.classes, config.checks) == (
        1,
        (1, 2, 3, 4),
        ("math", "code"),
        {"lossless": {"near_tie_ulps": 3}},
    )


# ----------------------------------------------------------------------------------------------------
# Check parameters: refused before the replay

CHECK_PARAMS = [
    (
        {"lossless": {"near_tie_ulps": "2"}},
        (),
        "check 'lossless' parameter 'near_tie_ulps' is '2', but it must be a number",
    ),
    ({"acceptance": {"min_drafts": 2.5}}, (), "parameter 'min_drafts' is 2.5, but it must be an integer"),
    ({"chat-template-parity": {"target_enable_thinking": "no"}}, (), "must be true or false"),
    ({"lossless": {"near_tie_margin": 0.1}}, (), "check 'lossless' has no parameter 'near_tie_margin'"),
    ({"losless": {}}, (), "unknown check 'losless'; did you mean 'lossless'?"),
    ({"lossless": 3}, (), "[checks.lossless] must be a table of parameters"),
    ({}, ("acceptence",), "unknown check 'acceptence'"),
]


@pytest.mark.parametrize("tables, only, fragment", CHECK_PARAMS, ids=[case[2][:40] for case in CHECK_PARAMS])
def test_bad_check_parameters_are_refused(tables, only, fragment):
    with pytest.raises(UsageError) as refused:
        validate_check_params(tables, only)
    one_sentence(str(refused.value.message), fragment)


def test_check_refuses_bad_check_parameters_before_loading_anything(tmp_path):
    """The target does not exist: a command that loaded it first would say so instead."""
    path = tmp_path / "doctor.toml"
    path.write_text('[checks.lossless]\nnear_tie_ulps = "2"\n', encoding="utf-8")
    result = invoke("check", "--config", path, "--target", tmp_path / "missing", "--out", tmp_path / "run")
    assert_usage_error(result, "check 'lossless' parameter 'near_tie_ulps' is '2'")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------------
# Engine responses


def _golden() -> dict:
    return json.loads((GOLDEN / "vllm_0.32.0_chat_detailed.json").read_text())


def _edited(path: str, value) -> dict:
    body = _golden()
    node = body
    *parents, key = path.split(".")
    for parent in parents:
        node = node[int(parent)] if isinstance(node, list) else node[parent]
    node[key] = value
    return body


RESPONSES = [
    (["not", "an", "object"], "the response is a JSON list, not a completion object"),
    (_edited("choices", {"0": {}}), "`choices` is"),
    (_edited("choices.0.token_ids", "1 2 3"), "`choices[0].token_ids` is '1 2 3', but it must be a list of integers"),
    (_edited("choices.0.token_ids", [1, "2"]), "`choices[0].token_ids`"),
    (_edited("choices.0.message", "hello"), "`choices[0].message` is 'hello'"),
    (_edited("choices.0.message.content", 42), "`choices[0].message.content` is '42', but it must be a string"),
    (_edited("choices.0.finish_reason", 1), "`choices[0].finish_reason`"),
    (_edited("usage.prompt_tokens", "12"), "`usage.prompt_tokens` is '12', but it must be an integer"),
    (_edited("prompt_token_ids", [1.5]), "`prompt_token_ids`"),
    ({**_golden(), "metrics": {"speculative_decoding": 3}}, "`metrics.speculative_decoding` is '3'"),
    (
        {**_golden(), "metrics": {"speculative_decoding": {"num_draft_tokens": "10"}}},
        "`metrics.speculative_decoding.num_draft_tokens`",
    ),
    (
        {**_golden(), "metrics": {"speculative_decoding": {"acceptance_histogram": "1,2"}}},
        "`metrics.speculative_decoding.acceptance_histogram`",
    ),
    ({**_golden(), "timings": {"draft_n": 1.5}}, "`timings.draft_n` is '1.5'"),
    ({**_golden(), "sglext": {"spec_tokens_details": [3]}}, "`sglext.spec_tokens_details` holds '3', not an object"),
    ({**_golden(), "meta_info": {"spec_verify_ct": "7"}}, "`meta_info.spec_verify_ct` is '7'"),
]


@pytest.mark.parametrize("body, fragment", RESPONSES, ids=[case[1][:40] for case in RESPONSES])
def test_an_engine_response_of_an_unexpected_shape_is_refused(body, fragment):
    with pytest.raises(MalformedResponse, match=None) as refused:
        check_response_shape(body)
    assert fragment in str(refused.value), str(refused.value)


def test_the_real_response_passes_and_impossible_counts_are_refused():
    body = _golden()
    check_response_shape(body)
    read_completion(body)
    spec = {"num_spec_tokens": 4, "num_spec_steps": 5, "num_draft_tokens": 20, "num_accepted_draft_tokens": 30}
    with pytest.raises(MalformedResponse, match="claims 30 accepted of 20 drafted tokens"):
        check_measurement(parse_response({**body, "metrics": {"speculative_decoding": spec}}))
    spec["num_accepted_draft_tokens"] = 12
    assert (
        check_measurement(parse_response({**body, "metrics": {"speculative_decoding": spec}})).num_accepted_tokens == 12
    )


# ----------------------------------------------------------------------------------------------------
# Engine log lines: counts no engine can report are refused as data

VLLM = (
    "(APIServer pid=1) INFO 11-30 15:51:53 [metrics.py:120] SpecDecoding "
    "metrics: Mean acceptance length: {tau}, Accepted throughput: 1.00 tokens/s, "
    "Drafted throughput: 2.00 tokens/s, Accepted: {acc} tokens, "
    "Drafted: {drafted} tokens, Per-position acceptance rate: {rates}, "
    "Avg Draft acceptance rate: 6.7%"
)
LOG_LINES = [
    ("vllm", VLLM.format(tau="4.00", acc=60, drafted=20, rates="1.000, 1.000, 1.000, 1.000")),
    ("vllm", VLLM.format(tau="2.00", acc=20, drafted=20, rates="1.500, 0.500, 0.000, 0.000")),
    (
        "llamacpp",
        "slot print_timing: id  0 | task 5 | draft acceptance = "
        "2.25000 (   90 accepted /    40 generated), mean len =  4.00",
    ),
    (
        "trtllm",
        json.dumps(
            {"specDecodingStats": {"numRequestsWithDraftTokens": 2, "numDraftTokens": 8, "numAcceptedTokens": 9}}
        ),
    ),
    (
        "trtllm",
        json.dumps(
            {"specDecodingStats": {"numRequestsWithDraftTokens": -2, "numDraftTokens": 8, "numAcceptedTokens": 3}}
        ),
    ),
]


@pytest.mark.parametrize("engine, line", LOG_LINES, ids=[f"{engine}-{i}" for i, (engine, _) in enumerate(LOG_LINES)])
def test_a_log_line_claiming_impossible_counts_is_refused_as_data(engine, line):
    problems = ParseProblems()
    good = {
        "vllm": VLLM.format(tau="2.00", acc=4, drafted=16, rates="0.500, 0.250, 0.250, 0.000"),
        "llamacpp": (
            "slot print_timing: id  0 | task 5 | draft acceptance = "
            "0.50000 (   20 accepted /    40 generated), mean len =  3.00"
        ),
        "trtllm": json.dumps(
            {"specDecodingStats": {"numRequestsWithDraftTokens": 2, "numDraftTokens": 8, "numAcceptedTokens": 3}}
        ),
    }[engine]
    ctx = LogContext(model="m", origin="server.log", year=2026, problems=problems)
    observations = list(parse_log_lines([good, line], server_kind=engine, ctx=ctx))
    assert (
        len(observations) == 1 and observations[0].origin == "server.log:1"
    )  # the good line is data, the bad one is not
    assert problems.count == 1 and "server.log:2" in (problems.message("log") or "")


# ----------------------------------------------------------------------------------------------------
# Context length: refused before prefill


def test_a_prompt_past_the_targets_positions_is_refused_before_prefill(tiny_dir, tmp_path):
    words = " ".join(f"w{i % 50}" for i in range(600))  # the tiny target has 512 positions
    path = tmp_path / "long.jsonl"
    path.write_text(
        json.dumps({"id": "short", "prompt": "w1 w2"})
        + "\n"
        + json.dumps({"id": "long", "messages": [{"role": "user", "content": words}]})
        + "\n",
        encoding="utf-8",
    )
    result = invoke(
        "replay",
        "--target",
        tiny_dir / "target",
        "--draft",
        tiny_dir / "dflash",
        "--workload",
        path,
        "--max-new-tokens",
        "4",
        "--out",
        tmp_path / "run",
    )
    assert_usage_error(
        result, "request 'long': its prompt of", "runs past the target's 512 positions", "--max-new-tokens"
    )
    assert load_run(tmp_path / "run").requests.empty  # refused before the first prefill: not even the short request ran
    near = tmp_path / "near.jsonl"
    near.write_text(json.dumps({"id": "near", "prompt": " ".join(["w1"] * 500)}) + "\n", encoding="utf-8")
    result = invoke(
        "replay",
        "--target",
        tiny_dir / "target",
        "--draft",
        tiny_dir / "dflash",
        "--workload",
        near,
        "--max-new-tokens",
        "40",
        "--out",
        tmp_path / "near",
    )
    assert_usage_error(result, "plus up to 40 new tokens runs past the target's 512 positions")
    fits = invoke(
        "replay",
        "--target",
        tiny_dir / "target",
        "--draft",
        tiny_dir / "dflash",
        "--workload",
        near,
        "--max-new-tokens",
        "4",
        "--out",
        tmp_path / "fits",
    )
    assert fits.exit_code == 0, fits.output


def test_a_captured_response_claiming_more_accepted_than_drafted_tokens_is_refused_as_data():
    def line(accepted: int) -> str:
        spec = {"num_spec_steps": 4, "num_draft_tokens": 16, "num_accepted_draft_tokens": accepted}
        return json.dumps({"response": {**_golden(), "metrics": {"speculative_decoding": spec}}})

    problems = ParseProblems()
    observations = list(
        parse_response_lines([line(6), line(40)], default_model="m", origin="responses.jsonl", problems=problems)
    )
    assert [o.counts.num_accepted_tokens for o in observations] == [6.0]
    assert problems.count == 1 and "responses.jsonl:2" in (problems.message("response") or "")


@pytest.mark.parametrize("models_body", [[], {"data": {"id": "m"}}, "ok", {"data": "m"}])
def test_a_model_list_of_an_unexpected_shape_is_refused(tmp_path, models_body):
    class Handler(QuietHandler):
        def do_GET(self):  # noqa: N802 (http.server API)
            self.reply_json(models_body)

    with ThreadedServer(Handler) as server:
        url = server.base_url
        result = invoke(
            "check", "--engine", url, "--workload", "demo", "--max-requests", "1", "--out", tmp_path / "run"
        )
    assert_usage_error(result, f"--engine {url}: GET /v1/models answered", "not an OpenAI model list")


K_GRIDS = [("8", (8,)), ("2,4,8", (2, 4, 8)), ("1-4", (1, 2, 3, 4)), (" 1-3, 8 ,2", (1, 2, 3, 8)), ("4-4", (4,))]


@pytest.mark.parametrize("text, expected", K_GRIDS, ids=[case[0] for case in K_GRIDS])
def test_an_integer_grid_reads_lists_and_ranges(text, expected):
    assert parse_k(text) == expected == parse_int_grid(text, "--k", minimum=1)


@pytest.mark.parametrize(
    "text, minimum, fragment",
    [
        (
            "8-4",
            1,
            "is not an integer, a list like 2,4,8 or a range like 1-15",
        ),  # reversed: refused, not an empty range
        ("2,x", 1, "is not an integer"),
        ("-1", 0, "is not an integer"),
        ("0,2", 1, "must hold integers >= 1"),
        ("", 1, "is not an integer"),
    ],
)
def test_a_bad_integer_grid_is_refused_naming_the_flag(text, minimum, fragment):
    with pytest.raises(UsageError) as refused:
        parse_int_grid(text, "--fit-k", minimum=minimum)
    one_sentence(str(refused.value.message), "--fit-k", fragment, "fix the value")
    assert parse_int_grid("0,2", "--k", minimum=0) == (0, 2)  # tune's baseline K = 0
