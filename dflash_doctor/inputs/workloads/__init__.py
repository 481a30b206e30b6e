"""Requests and workloads: which conversations to replay, split into request classes.

Acceptance differs sharply by kind of request (DFlash reports tau ~7.3 on math, ~5.8 on code, ~3.7 on
chat for the same pair), so every :class:`Request` carries a class (``math``, ``code``, ``chat``...)
by which every result is split, and a finer ``subclass`` (the source set or category).

Where requests come from (:func:`.selection.load_workload`):

- built-in sets (:func:`list_workloads`): ``humaneval`` (code), ``mt-bench`` (two-turn questions),
  ``sharegpt`` (FastChat's ShareGPT-format conversations, chat), ``gsm`` (generated word problems,
  math), ``mix`` (all of them) and ``demo`` (a small balanced sample of ``mix``). The real sets are
  vendored verbatim under ``dflash_doctor/data/workloads/`` (see its NOTICE.md), so they work on a
  fresh install and a run's prompts are pinned by the tool version. Each built-in set has a fixed
  held-out split (``train`` ~80% / ``eval`` ~20%): the demo DFlash draft is trained on ``train`` and
  measured on ``eval``.
- user files: JSONL, CSV or Parquet with ``messages`` (OpenAI chat format) or ``prompt``; OpenAI
  request bodies captured from a gateway load as they are.

Multi-turn replay (MT-Bench style): consecutive user messages at the END of ``messages`` are separate
turns; every later turn is asked after the target's OWN answer to the previous one, never a recorded
answer. Assistant messages earlier in ``messages`` are fixed history. :func:`conversation_turns`
gives one message list per turn with placeholders for the answers, :func:`fill_answers` puts the
target's answers in, :func:`encode_turn` renders and tokenises one turn with the model's own chat
template (transformers renders it in a sandboxed Jinja environment). The engine's loop::

    answers = []
    for turn in range(request.num_turns):
        prompt_ids = encode_request_turn(tokenizer, request, answers, chat_template=template_text)
        answers.append(tokenizer.decode(generate(prompt_ids), skip_special_tokens=True))

Answers go back as text and are rendered again, as a client of vLLM / SGLang sends them.

The package, by job: :mod:`.request` (Request, stratified_sample), :mod:`.builtin` (the shipped sets),
:mod:`.files` (user files in, :func:`save_workload` out), :mod:`.selection` (:func:`load_workload`) and
:mod:`.conversation` (turns and chat-template rendering). Callers import the names below from here.
"""

from dflash_doctor.inputs.workloads.request import Request, count_trailing_user_messages, stratified_sample
from dflash_doctor.inputs.workloads.builtin import (
    BUILTIN_NAMES,
    CODE_INSTRUCTION,
    DEMO_REQUESTS_PER_CLASS,
    EVAL_FRACTION,
    MATH_INSTRUCTION,
    MT_BENCH_CLASS,
    NUM_WORD_PROBLEMS,
    SPLITS,
    WORD_PROBLEM_SEED,
    WorkloadInfo,
    extra_word_problems,
    list_workloads,
    load_builtin,
)
from dflash_doctor.inputs.workloads.files import (
    CHAT_ROLES,
    FILE_SUFFIXES,
    read_csv,
    read_jsonl,
    read_parquet,
    read_workload_file,
    save_workload,
)
from dflash_doctor.inputs.workloads.selection import load_workload
from dflash_doctor.inputs.workloads.conversation import (
    ANSWER_OF_TURN,
    conversation_turns,
    encode_request_turn,
    encode_turn,
    fill_answers,
    read_chat_template,
)

__all__ = [
    "Request",
    "count_trailing_user_messages",
    "stratified_sample",
    "BUILTIN_NAMES",
    "CODE_INSTRUCTION",
    "DEMO_REQUESTS_PER_CLASS",
    "EVAL_FRACTION",
    "MATH_INSTRUCTION",
    "MT_BENCH_CLASS",
    "NUM_WORD_PROBLEMS",
    "SPLITS",
    "WORD_PROBLEM_SEED",
    "WorkloadInfo",
    "extra_word_problems",
    "list_workloads",
    "load_builtin",
    "CHAT_ROLES",
    "FILE_SUFFIXES",
    "read_csv",
    "read_jsonl",
    "read_parquet",
    "read_workload_file",
    "save_workload",
    "load_workload",
    "ANSWER_OF_TURN",
    "conversation_turns",
    "encode_request_turn",
    "encode_turn",
    "fill_answers",
    "read_chat_template",
]
