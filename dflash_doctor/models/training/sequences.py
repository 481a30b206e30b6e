"""Training data: each sequence is a prompt (one turn of a request) plus the target's OWN greedy continuation,
generated in batches and cached on disk as token ids (:class:`SequenceRecord`), so resumes and re-runs skip
generation; extra sampled answers and prompts the target writes itself widen the set.

Its own module because it is the slow, target-only part of a run: it needs no draft, and its caches are
what a resumed or repeated run reuses (``--cached-data-only`` refuses instead of regenerating).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from dflash_doctor.engine.batched import generate_greedy_batch
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.workloads import Request, encode_request_turn, read_workload_file, save_workload
from dflash_doctor.models.loading import fingerprint
from dflash_doctor.models.training.new_draft import chat_template_record

if TYPE_CHECKING:
    from dflash_doctor.engine.target import CausalLM


SEQUENCES_FILE = "sequences.jsonl"  # cached training sequences (first line: the cache key)
EVAL_SEQUENCES_FILE = "eval_sequences.jsonl"  # cached held-out sequences
SAMPLED_SEQUENCES_FILE = "sampled_sequences.jsonl"  # cached extra sampled answers (--samples-per-prompt)
SELF_WRITTEN_PROMPTS_FILE = "self_written_prompts.jsonl"  # cached prompts the target wrote (--self-written-prompts)


@dataclass
class SequenceRecord:
    """One training or evaluation sequence: a prompt (one turn of a request) and its response, as token ids."""

    request_id: str
    request_class: str
    turn: int
    prompt_length: int
    token_ids: list[int]

    @property
    def response_ids(self) -> list[int]:
        return self.token_ids[self.prompt_length :]


@torch.inference_mode()
def _read_cache(path: Path, key: dict[str, Any]) -> dict[tuple[str, int], SequenceRecord]:
    """Records of a cache file written under the same key; nothing when the key differs or the file is absent."""
    if not path.is_file():
        return {}
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or json.loads(lines[0]).get("key") != key:
        return {}
    records = {}
    for line in lines[1:]:
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by an interrupted run: regenerate it
            continue
        record = SequenceRecord(
            raw["request_id"], raw["request_class"], raw["turn"], raw["prompt_length"], raw["token_ids"]
        )
        records[(record.request_id, record.turn)] = record
    return records


def _refuse_generation(cache_path: Path, missing: int, total: int) -> None:
    """Why a run restricted to cached data (``generate=False``) cannot start: one sentence."""
    raise UsageError(
        f"--cached-data-only: {cache_path} lacks {missing} of the {total} answers this run needs (absent, or cached "
        "under another key: target, dtype, chat template, --max-new-tokens or --seed); carry the caches of the run "
        "that made them into --out, or drop the flag to generate them."
    )


def _append_records(path: Path, records: Iterable[SequenceRecord]) -> None:
    with path.open("a", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(dataclasses.asdict(record)) + "\n")


def prepare_sequences(
    model: CausalLM,
    tokenizer: Any,
    requests: Sequence[Request],
    *,
    cache_path: Path,
    cache_key: dict[str, Any],
    max_new_tokens: int,
    stop_ids: frozenset[int],
    chat_template: str | None = None,
    use_recorded_responses: bool = False,
    batch_size: int = 32,
    progress: bool = False,
    generate: bool = True,
) -> list[SequenceRecord]:
    """One sequence per turn of every request: the prompt rendered with the chat template + the response.

    Responses are the target's own greedy answers, generated turn by turn (turn t's prompt holds the
    target's answers to the earlier turns) in batches of similar prompt length. With
    ``use_recorded_responses`` a single-turn request's recorded ``response`` (plus the eos token) is used
    instead. Every batch is appended to ``cache_path`` as soon as it is done: a re-run or an interrupted
    run with the same ``cache_key`` (target, template, lengths) generates only what is missing; with
    ``generate=False`` anything missing is a UsageError instead (a GPU segment that must not regenerate).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    cached = _read_cache(cache_path, cache_key)
    needed = [(r.id, turn) for r in requests for turn in range(r.num_turns)]
    if not generate and any(key not in cached for key in needed):
        _refuse_generation(cache_path, sum(key not in cached for key in needed), len(needed))
    if not cached:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps({"key": cache_key}) + "\n", encoding="utf-8")
    eos = tokenizer.eos_token_id
    answers: dict[str, list[str]] = {r.id: [] for r in requests}
    records: dict[tuple[str, int], SequenceRecord] = {}
    total = sum(r.num_turns for r in requests)
    columns = (TextColumn("generating responses"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("generate", total=total)
        for turn in range(max((r.num_turns for r in requests), default=0)):
            pending: list[tuple[Request, list[int]]] = []
            for request in (r for r in requests if r.num_turns > turn):
                record = cached.get((request.id, turn))
                if record is None:
                    prompt = encode_request_turn(tokenizer, request, answers[request.id], chat_template=chat_template)
                    if use_recorded_responses and request.response is not None and request.num_turns == 1:
                        response = list(tokenizer(request.response, add_special_tokens=False)["input_ids"])[
                            : max_new_tokens - 1
                        ]
                        record = SequenceRecord(
                            request.id, request.request_class, turn, len(prompt), prompt + response + [eos]
                        )
                        _append_records(cache_path, [record])
                    else:
                        pending.append((request, prompt))
                        continue
                records[(request.id, turn)] = record
                bar.advance(task)
            pending.sort(key=lambda item: len(item[1]))
            for start in range(0, len(pending), batch_size):
                chunk = pending[start : start + batch_size]
                responses = generate_greedy_batch(
                    model, [p for _, p in chunk], max_new_tokens=max_new_tokens, stop_ids=stop_ids
                )
                new = [
                    SequenceRecord(r.id, r.request_class, turn, len(p), p + out)
                    for (r, p), out in zip(chunk, responses)
                ]
                _append_records(cache_path, new)
                records.update({(rec.request_id, turn): rec for rec in new})
                bar.advance(task, len(new))
            for request in requests:
                if (request.id, turn) in records:
                    answer = [t for t in records[(request.id, turn)].response_ids if t not in stop_ids]
                    answers[request.id].append(tokenizer.decode(answer, skip_special_tokens=True))
    return [records[(r.id, turn)] for r in requests for turn in range(r.num_turns)]


def self_written_prompts(
    model: CausalLM,
    tokenizer: Any,
    count: int,
    *,
    cache_path: Path,
    cache_key: dict[str, Any],
    stop_ids: frozenset[int],
    chat_template: str | None = None,
    max_new_tokens: int = 96,
    temperature: float = 1.0,
    batch_size: int = 256,
    seed: int = 0,
    generate: bool = True,
) -> list[Request]:
    """``count`` user prompts written by the target itself, class ``chat`` (subclass ``self-written``).

    Why: the built-in chat pool is small (about 460 train prompts), and self-distillation wants many
    prompts from the target's own distribution. The target's chat template rendered up to an empty
    user turn (the text before ``{content}``) makes an instruct model write a plausible user message
    (the Magpie trick); its answer is then generated like any other prompt. Cached as a JSONL workload
    under the same key rules as the sequences, so resumes see the same prompts.
    """
    key = {**cache_key, "self_written_prompts": count, "temperature": temperature, "seed": seed}
    key_file = cache_path.with_suffix(".key.json")
    if cache_path.is_file() and key_file.is_file() and json.loads(key_file.read_text(encoding="utf-8")) == key:
        return read_workload_file(cache_path)
    if not generate:
        _refuse_generation(cache_path, count, count)
    marker = "\x00USER\x00"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], chat_template=chat_template, tokenize=False, add_generation_prompt=False
    )
    prefix = list(tokenizer(rendered[: rendered.index(marker)], add_special_tokens=False)["input_ids"])
    torch.manual_seed(seed)
    texts: list[str] = []
    seen: set[str] = set()
    for _ in range(4 * math.ceil(count / batch_size)):  # duplicates and empty turns are dropped; a few rounds more
        if len(texts) >= count:
            break
        for output in generate_greedy_batch(
            model, [prefix] * batch_size, max_new_tokens=max_new_tokens, stop_ids=stop_ids, temperature=temperature
        ):
            if not output or output[-1] not in stop_ids:  # cut by the length limit: not a finished question
                continue
            text = tokenizer.decode(output[:-1], skip_special_tokens=True).strip()
            if text and text not in seen:
                seen.add(text)
                texts.append(text)
    requests = [
        Request(
            id=f"self-written/{i:05d}",
            request_class="chat",
            subclass="self-written",
            messages=({"role": "user", "content": text},),
        )
        for i, text in enumerate(texts[:count])
    ]
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    save_workload(requests, cache_path)
    key_file.write_text(json.dumps(key), encoding="utf-8")
    return requests


def sampled_sequences(
    model: CausalLM,
    records: Sequence[SequenceRecord],
    *,
    samples_per_prompt: int,
    temperature: float,
    cache_path: Path,
    cache_key: dict[str, Any],
    max_new_tokens: int,
    stop_ids: frozenset[int],
    batch_size: int = 256,
    seed: int = 0,
    progress: bool = False,
    generate: bool = True,
) -> list[SequenceRecord]:
    """``samples_per_prompt`` sampled continuations of each record's prompt: more, varied training data.

    A small prompt pool (about a thousand prompts) is memorised within a few epochs if the draft only
    sees the greedy answers; sampled answers from the target itself stay on the target's distribution
    (what the draft must imitate) while multiplying the distinct contexts. Cached like
    :func:`prepare_sequences`; turn ``t`` sample ``s`` is stored as turn ``1000 * (s + 1) + t``.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    key = {**cache_key, "samples_per_prompt": samples_per_prompt, "temperature": temperature, "seed": seed}
    cached = _read_cache(cache_path, key)
    jobs = [(record, 1000 * (sample + 1) + record.turn) for record in records for sample in range(samples_per_prompt)]
    pending = [(record, turn) for record, turn in jobs if (record.request_id, turn) not in cached]
    if pending and not generate:
        _refuse_generation(cache_path, len(pending), len(jobs))
    if not cached:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps({"key": key}) + "\n", encoding="utf-8")
    pending.sort(key=lambda job: job[0].prompt_length)
    torch.manual_seed(seed)
    columns = (TextColumn("sampling responses"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("sample", total=len(pending))
        for start in range(0, len(pending), batch_size):
            chunk = pending[start : start + batch_size]
            prompts = [record.token_ids[: record.prompt_length] for record, _ in chunk]
            responses = generate_greedy_batch(
                model, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids, temperature=temperature
            )
            new = [
                SequenceRecord(r.request_id, r.request_class, turn, r.prompt_length, list(p) + out)
                for (r, turn), p, out in zip(chunk, prompts, responses)
            ]
            _append_records(cache_path, new)
            cached.update({(rec.request_id, rec.turn): rec for rec in new})
            bar.advance(task, len(new))
    return [cached[(record.request_id, turn)] for record, turn in jobs]


def data_cache_key(
    target_dir: Path,
    *,
    max_new_tokens: int,
    dtype: str,
    chat_template: str | None,
    use_recorded_responses: bool = False,
) -> dict[str, Any]:
    """What the cached sequences depend on: target weights, answer length, dtype, chat template, response source."""
    return {
        "target": fingerprint(target_dir),
        "max_new_tokens": max_new_tokens,
        "dtype": dtype,
        "chat_template_sha256": chat_template_record(chat_template)["chat_template_sha256"],
        "use_recorded_responses": use_recorded_responses,
    }


def prepare_training_data(
    model: CausalLM,
    tokenizer: Any,
    requests: Sequence[Request],
    held_out: Sequence[Request],
    *,
    out_dir: Path,
    cache_key: dict[str, Any],
    max_new_tokens: int,
    stop_ids: frozenset[int],
    chat_template: str | None = None,
    use_recorded_responses: bool = False,
    samples_per_prompt: int = 0,
    sample_temperature: float = 0.8,
    batch_size: int = 32,
    seed: int = 0,
    progress: bool = True,
    generate: bool = True,
) -> tuple[list[SequenceRecord], list[SequenceRecord]]:
    """Training records (greedy answers, then ``samples_per_prompt`` sampled ones each) and held-out records.

    Everything is cached in ``out_dir`` (:data:`SEQUENCES_FILE`, :data:`SAMPLED_SEQUENCES_FILE`,
    :data:`EVAL_SEQUENCES_FILE`), so a run over a subset of the same requests generates nothing new;
    ``generate=False`` refuses to generate what is missing (see :func:`prepare_sequences`).
    """
    records = prepare_sequences(
        model,
        tokenizer,
        requests,
        cache_path=out_dir / SEQUENCES_FILE,
        cache_key=cache_key,
        max_new_tokens=max_new_tokens,
        stop_ids=stop_ids,
        chat_template=chat_template,
        use_recorded_responses=use_recorded_responses,
        batch_size=batch_size,
        progress=progress,
        generate=generate,
    )
    if samples_per_prompt > 0:
        records = records + sampled_sequences(
            model,
            records,
            samples_per_prompt=samples_per_prompt,
            temperature=sample_temperature,
            cache_path=out_dir / SAMPLED_SEQUENCES_FILE,
            cache_key=cache_key,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
            batch_size=batch_size,
            seed=seed,
            progress=progress,
            generate=generate,
        )
    eval_records = (
        prepare_sequences(
            model,
            tokenizer,
            held_out,
            cache_path=out_dir / EVAL_SEQUENCES_FILE,
            cache_key=cache_key,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
            chat_template=chat_template,
            batch_size=batch_size,
            progress=progress,
            generate=generate,
        )
        if held_out
        else []
    )
    return records, eval_records
