"""Train or fine-tune a DFlash draft against a frozen target: the recipe of DFlash (arXiv 2602.06036).

Why this recipe: a DFlash draft proposes a whole block in ONE non-causal pass conditioned on the target's
hidden states, so it is trained in exactly that layout. Every training sequence is a prompt plus the
target's OWN greedy continuation, the tokens the target will verify against at temperature 0, so the draft
imitates the target rather than a dataset.

Each step (:func:`train_dflash_draft`):

1. a batch of sequences and random anchors inside each RESPONSE: an anchor plays the last committed token
   of a live step, so the first usable one is the first response token;
2. blocks ``[token[a], mask x (B-1)]`` go through :func:`dflash_doctor.engine.blocks.draft_block_hidden`:
   context strictly before the anchor, bidirectional inside a block, blocks blind to each other (a test
   in tests/test_live.py proves this equals the live drafter);
3. logits = the target's lm_head on slots 1..B-1, labels ``token[a + j]`` (labels past the sequence end
   are ignored); cross-entropy weighted by ``w_j = exp(-(j - 1) / gamma)``, because a miss at slot j
   throws away every later slot, so early slots are worth more;
4. AdamW, linear warm-up then cosine decay, gradient clipping; bf16 autocast on CUDA.

The target is frozen: it supplies the embeddings (block tokens and the mask row), the lm_head and the
tapped hidden states ``hidden_states[l + 1]``, which are computed once per sequence (batched) before
training and kept on the training device.

Data preparation for the CLI (:func:`prepare_sequences`) regenerates responses with batched greedy
decoding and caches the token sequences on disk, so that resumes and re-runs skip generation.

Stopping and resuming, and where things live between GPU runs. A checkpoint (:func:`_save_checkpoint`)
is a set of files under 16 MiB (weights 48 MB and AdamW moments 96 MB for the 3-layer demo draft), and a
resume from it is bit-exact. The GPU machine this project trains on keeps nothing once given back, takes
in about 13 MB per call beside the repository and gives back 64 MiB per call, 16 MiB per file; so:

- within one lease the checkpoint stays on the machine's disk (an ignored folder, kept between calls),
  and a run longer than one command's 10 minutes is the same command run again: it resumes bit for bit
  (``deadline`` of :func:`train_dflash_draft`, `--time-limit`, stops a command cleanly at a checkpoint);
- between leases only the draft's weights travel (back: 4 pieces of ``checkpoint/``; in: in place of the
  demo draft's weights in the working tree, uncommitted until the last segment, so neither the transfer
  nor the repository grows), and the next segment starts from them with ``--init-from``: fresh AdamW
  moments and its own warm-up and cosine (a warm restart), because the moments cannot travel in;
- the answers are carried, not regenerated: the caches of the card's recipe (25,882 sequences, 4.83 M
  response tokens, about 50 MB of JSONL) compress with ``xz -9`` to about 4.5 MB (0.93 bytes per
  response token, measured on 192 real SmolLM2 answers of that recipe; uint16 token ids + xz would save
  0.8 MB more, not worth a second format), one file each way, against 349 s of the H200 (of a ~450 s
  segment) to regenerate them; ``--cached-data-only`` makes a segment refuse instead of regenerating.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence, cast

import torch
import torch.nn.functional as F

from dflash_doctor.engine.batched import generate_greedy_batch
from dflash_doctor.engine.blocks import context_kv_for, draft_block_hidden
from dflash_doctor.engine.cache import accepts_logits_to_keep
from dflash_doctor.engine.dflash_model import DFlashConfig, DFlashDraftModel
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TapRecorder, TargetModel, tap_points
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, walk_schedule
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.workloads import Request, encode_request_turn, read_workload_file, save_workload
from dflash_doctor.models.loading import fingerprint, save_dflash_draft, weights_fingerprint
from dflash_doctor.rundir.tables import StepRow, as_row
from dflash_doctor.stats.metrics import tau_with_ci

if TYPE_CHECKING:
    from dflash_doctor.engine.target import CausalLM

CHECKPOINT_DIR_NAME = "checkpoint"  # resumable state inside the out dir
TRAINING_STATE_FILE = "training_state.json"  # step, loss log, scheduler, RNG, identity and the list of the other pieces
OPTIMIZER_DIR_NAME = "optimizer"  # AdamW's tensors; beside the weights, a loader of the draft would read them as weights
CHECKPOINT_PIECE_BYTES = 15 * 2**20  # shard size: with its header every piece stays under 16 MiB (the GPU machine's file limit)
SEQUENCES_FILE = "sequences.jsonl"  # cached training sequences (first line: the cache key)
EVAL_SEQUENCES_FILE = "eval_sequences.jsonl"  # cached held-out sequences
SAMPLED_SEQUENCES_FILE = "sampled_sequences.jsonl"  # cached extra sampled answers (--samples-per-prompt)
SELF_WRITTEN_PROMPTS_FILE = "self_written_prompts.jsonl"  # cached prompts the target wrote (--self-written-prompts)
DEFAULT_NUM_TAPS = 4  # target layers a new draft conditions on (DFlash uses 5 for 36-layer targets)

# What _save_checkpoint writes into TRAINING_STATE_FILE: a file without one of them is not a whole checkpoint.
_STATE_KEYS = frozenset({"identity", "step", "log", "scheduler", "optimizer_param_groups", "generator", "window", "pieces"})

# TrainConfig fields that do not change what is learned: a resume may differ in these.
_BOOKKEEPING_FIELDS = frozenset({"device", "checkpoint_every", "log_every"})


@dataclass
class TrainConfig:
    """Hyper-parameters of one training run (recorded in training_log.json and the model card)."""

    steps: int = 2000
    batch_size: int = 16  # sequences per step
    anchors_per_sequence: int = 16  # blocks per sequence per step (fewer when a response is shorter)
    lr: float = 6e-4  # peak learning rate of AdamW
    weight_decay: float = 0.01
    warmup_fraction: float = 0.04  # share of the steps with a linear warm-up; cosine decay to 0 after it
    grad_clip_norm: float = 1.0
    loss_decay_gamma: float = 7.0  # slot weight exp(-(j-1)/gamma); DFlash's paper uses 7 for blocks of 16
    seed: int = 0
    device: str = "cpu"
    checkpoint_every: int = 500  # steps between resumable checkpoints (when a checkpoint dir is given)
    log_every: int = 10  # steps between rows of the loss curve

    def __post_init__(self) -> None:
        positive = {"--steps": self.steps, "--batch-size": self.batch_size, "--anchors-per-sequence": self.anchors_per_sequence,
                    "--lr": self.lr, "--loss-decay-gamma": self.loss_decay_gamma, "--checkpoint-every": self.checkpoint_every,
                    "log_every": self.log_every}
        for flag, value in positive.items():
            if not value > 0:
                raise UsageError(f"{flag} {value} must be positive; pass a value above 0.")
        if not 0 <= self.warmup_fraction < 1:
            raise UsageError(f"warmup_fraction {self.warmup_fraction} must be in [0, 1); pick a share of the steps.")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainingResult:
    """The trained draft (eval mode) and its loss curve."""

    draft: DFlashDraftModel
    log: list[dict[str, float]]  # rows {"step", "loss", "accepted_per_block", "lr", "tokens_per_s"}
    resumed_from_step: int  # 0 for a fresh run
    num_sequences: int  # sequences that had room for an anchor (two or more response tokens)
    final_step: int  # config.steps, or fewer when the deadline stopped the run (the checkpoint continues it)


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
        return self.token_ids[self.prompt_length:]


# --------------------------------------------------------------------------------------------------
# The draft's architecture and its mask token

def draft_config_for_target(target_config: Any, *, block_size: int, num_layers: int, target_layer_ids: Sequence[int],
                            mask_token_id: int) -> DFlashConfig:
    """A new draft's config: the target's width, heads and RoPE base (it shares the target's embeddings)."""
    num_target_layers = target_config.num_hidden_layers
    if block_size < 2:
        raise UsageError(f"--block-size {block_size} must be at least 2 (the anchor plus one drafted token).")
    if num_layers < 1:
        raise UsageError(f"--num-layers {num_layers} must be at least 1.")
    bad = [layer for layer in target_layer_ids if not 0 <= layer < num_target_layers]
    if not target_layer_ids or bad:
        raise UsageError(f"--target-layer-ids {list(target_layer_ids)} must name layers 0..{num_target_layers - 1} of the target; fix the list.")
    validate_mask_token_id(mask_token_id, target_config)
    rope = getattr(target_config, "rope_parameters", None) or {}
    heads = target_config.num_attention_heads
    return DFlashConfig(
        hidden_size=target_config.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        intermediate_size=target_config.intermediate_size,
        vocab_size=target_config.vocab_size,
        block_size=block_size,
        target_layer_ids=list(target_layer_ids),
        mask_token_id=mask_token_id,
        num_target_layers=num_target_layers,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
        max_position_embeddings=getattr(target_config, "max_position_embeddings", 40960),
    )


def init_draft_from_target(draft: DFlashDraftModel, target_model: CausalLM) -> list[int]:
    """Copy the target's LAST ``num_layers`` decoder layers (attention, MLP, both norms) and final norm into the draft.

    Why: the draft's layers have the target's width and head layout, and its output goes through the
    target's lm_head, so the layers nearest the head start the draft where the target's own top of the
    stack already maps hidden states to next-token logits (EAGLE-style drafts start from a target layer
    too). Tensors without a counterpart (``fc``, ``hidden_norm``, the per-head ``q_norm``/``k_norm`` a
    Llama target lacks) keep their fresh initialisation. Returns the target layer indices copied.
    """
    decoder = target_model.get_decoder()
    stack = list(decoder.get_submodule("layers").children())
    chosen = list(range(len(stack) - draft.config.num_hidden_layers, len(stack)))
    if chosen[0] < 0:
        raise UsageError(f"--init-from-target: the draft has {draft.config.num_hidden_layers} layers but the target only {len(stack)}; use fewer --num-layers.")
    with torch.no_grad():
        for layer, index in zip(draft.layers, chosen):
            source = stack[index].state_dict()
            for name, tensor in layer.state_dict().items():
                if name in source and source[name].shape == tensor.shape:
                    tensor.copy_(source[name].to(tensor.dtype))
        draft.norm.weight.copy_(decoder.get_submodule("norm").get_parameter("weight").to(draft.norm.weight.dtype))
    return chosen


def _special_ids(target_config: Any, tokenizer: Any = None) -> set[int]:
    """bos / eos / pad / unk ids of the model and its tokenizer: never usable as the mask."""
    ids: set[int] = set()
    for source in (target_config, tokenizer):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            value = getattr(source, name, None) if source is not None else None
            if value is not None:
                ids.update(value if isinstance(value, (list, tuple)) else [value])
    return {int(i) for i in ids}


def validate_mask_token_id(mask_token_id: int, target_config: Any, tokenizer: Any = None) -> None:
    """The mask must be a real embedding row (< vocab) that is not bos/eos/pad/unk (docs/draft-formats.md)."""
    vocab = target_config.vocab_size
    if not 0 <= mask_token_id < vocab:
        raise UsageError(f"--mask-token-id {mask_token_id} is outside the target vocabulary (0..{vocab - 1}); pick a reserved token id.")
    if mask_token_id in _special_ids(target_config, tokenizer):
        raise UsageError(f"--mask-token-id {mask_token_id} is the target's bos/eos/pad/unk token; pick a reserved token the target never generates.")


def choose_mask_token_id(tokenizer: Any, target_config: Any, used_ids: Iterable[int], chat_template: str | None = None) -> int:
    """The highest-id special token that is not bos/eos/pad/unk, not in the chat template and never in the data.

    Why: the mask row must be a real embedding row (the draft embeds masks with the target's own
    ``embed_tokens``) that the target never emits, or an anchor token would look like a mask. Reserved
    special tokens fit; SmolLM2 (vocab 49152, no padding rows) has 17 (ids 0..16) and this picks
    ``<empty_output>`` (16), a Jupyter-notebook marker that chat never produces.
    """
    forbidden = _special_ids(target_config, tokenizer) | set(used_ids)
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    candidates = []
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False) and token_id < target_config.vocab_size and token_id not in forbidden \
                and added.content not in template:
            candidates.append(int(token_id))
    if not candidates:
        raise UsageError("the target tokenizer has no reserved special token that is free to serve as the mask; "
                         "pass --mask-token-id with an id the target never generates.")
    return max(candidates)


def chat_template_record(chat_template: str | None) -> dict[str, Any]:
    """What config.json records under ``dflash_doctor`` so checks can compare the served template with this one."""
    text = chat_template or ""
    return {"chat_template_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest() if text else None,
            "chat_template": chat_template}


# --------------------------------------------------------------------------------------------------
# Data: batched greedy generation, cached on disk

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
        record = SequenceRecord(raw["request_id"], raw["request_class"], raw["turn"], raw["prompt_length"], raw["token_ids"])
        records[(record.request_id, record.turn)] = record
    return records


def _refuse_generation(cache_path: Path, missing: int, total: int) -> None:
    """Why a run restricted to cached data (``generate=False``) cannot start: one sentence."""
    raise UsageError(f"--cached-data-only: {cache_path} lacks {missing} of the {total} answers this run needs (absent, or cached "
                     "under another key: target, dtype, chat template, --max-new-tokens or --seed); carry the caches of the run "
                     "that made them into --out, or drop the flag to generate them.")


def _append_records(path: Path, records: Iterable[SequenceRecord]) -> None:
    with path.open("a", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(dataclasses.asdict(record)) + "\n")


def prepare_sequences(model: CausalLM, tokenizer: Any, requests: Sequence[Request], *, cache_path: Path,
                      cache_key: dict[str, Any], max_new_tokens: int, stop_ids: frozenset[int],
                      chat_template: str | None = None, use_recorded_responses: bool = False,
                      batch_size: int = 32, progress: bool = False, generate: bool = True) -> list[SequenceRecord]:
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
                        response = list(tokenizer(request.response, add_special_tokens=False)["input_ids"])[:max_new_tokens - 1]
                        record = SequenceRecord(request.id, request.request_class, turn, len(prompt), prompt + response + [eos])
                        _append_records(cache_path, [record])
                    else:
                        pending.append((request, prompt))
                        continue
                records[(request.id, turn)] = record
                bar.advance(task)
            pending.sort(key=lambda item: len(item[1]))
            for start in range(0, len(pending), batch_size):
                chunk = pending[start:start + batch_size]
                responses = generate_greedy_batch(model, [p for _, p in chunk], max_new_tokens=max_new_tokens, stop_ids=stop_ids)
                new = [SequenceRecord(r.id, r.request_class, turn, len(p), p + out) for (r, p), out in zip(chunk, responses)]
                _append_records(cache_path, new)
                records.update({(rec.request_id, turn): rec for rec in new})
                bar.advance(task, len(new))
            for request in requests:
                if (request.id, turn) in records:
                    answer = [t for t in records[(request.id, turn)].response_ids if t not in stop_ids]
                    answers[request.id].append(tokenizer.decode(answer, skip_special_tokens=True))
    return [records[(r.id, turn)] for r in requests for turn in range(r.num_turns)]


def self_written_prompts(model: CausalLM, tokenizer: Any, count: int, *, cache_path: Path, cache_key: dict[str, Any],
                         stop_ids: frozenset[int], chat_template: str | None = None, max_new_tokens: int = 96,
                         temperature: float = 1.0, batch_size: int = 256, seed: int = 0, generate: bool = True) -> list[Request]:
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
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=False)
    prefix = list(tokenizer(rendered[:rendered.index(marker)], add_special_tokens=False)["input_ids"])
    torch.manual_seed(seed)
    texts: list[str] = []
    seen: set[str] = set()
    for _ in range(4 * math.ceil(count / batch_size)):  # duplicates and empty turns are dropped; a few rounds more
        if len(texts) >= count:
            break
        for output in generate_greedy_batch(model, [prefix] * batch_size, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                            temperature=temperature):
            if not output or output[-1] not in stop_ids:  # cut by the length limit: not a finished question
                continue
            text = tokenizer.decode(output[:-1], skip_special_tokens=True).strip()
            if text and text not in seen:
                seen.add(text)
                texts.append(text)
    requests = [Request(id=f"self-written/{i:05d}", request_class="chat", subclass="self-written",
                        messages=({"role": "user", "content": text},)) for i, text in enumerate(texts[:count])]
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    save_workload(requests, cache_path)
    key_file.write_text(json.dumps(key), encoding="utf-8")
    return requests


def sampled_sequences(model: CausalLM, records: Sequence[SequenceRecord], *, samples_per_prompt: int,
                      temperature: float, cache_path: Path, cache_key: dict[str, Any], max_new_tokens: int,
                      stop_ids: frozenset[int], batch_size: int = 256, seed: int = 0,
                      progress: bool = False, generate: bool = True) -> list[SequenceRecord]:
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
            chunk = pending[start:start + batch_size]
            prompts = [record.token_ids[:record.prompt_length] for record, _ in chunk]
            responses = generate_greedy_batch(model, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                              temperature=temperature)
            new = [SequenceRecord(r.request_id, r.request_class, turn, r.prompt_length, list(p) + out)
                   for (r, turn), p, out in zip(chunk, prompts, responses)]
            _append_records(cache_path, new)
            cached.update({(rec.request_id, rec.turn): rec for rec in new})
            bar.advance(task, len(new))
    return [cached[(record.request_id, turn)] for record, turn in jobs]


def data_cache_key(target_dir: Path, *, max_new_tokens: int, dtype: str, chat_template: str | None,
                   use_recorded_responses: bool = False) -> dict[str, Any]:
    """What the cached sequences depend on: target weights, answer length, dtype, chat template, response source."""
    return {"target": fingerprint(target_dir), "max_new_tokens": max_new_tokens, "dtype": dtype,
            "chat_template_sha256": chat_template_record(chat_template)["chat_template_sha256"],
            "use_recorded_responses": use_recorded_responses}


def prepare_training_data(model: CausalLM, tokenizer: Any, requests: Sequence[Request], held_out: Sequence[Request], *,
                          out_dir: Path, cache_key: dict[str, Any], max_new_tokens: int, stop_ids: frozenset[int],
                          chat_template: str | None = None, use_recorded_responses: bool = False, samples_per_prompt: int = 0,
                          sample_temperature: float = 0.8, batch_size: int = 32, seed: int = 0,
                          progress: bool = True, generate: bool = True) -> tuple[list[SequenceRecord], list[SequenceRecord]]:
    """Training records (greedy answers, then ``samples_per_prompt`` sampled ones each) and held-out records.

    Everything is cached in ``out_dir`` (:data:`SEQUENCES_FILE`, :data:`SAMPLED_SEQUENCES_FILE`,
    :data:`EVAL_SEQUENCES_FILE`), so a run over a subset of the same requests generates nothing new;
    ``generate=False`` refuses to generate what is missing (see :func:`prepare_sequences`).
    """
    records = prepare_sequences(model, tokenizer, requests, cache_path=out_dir / SEQUENCES_FILE, cache_key=cache_key,
                                max_new_tokens=max_new_tokens, stop_ids=stop_ids, chat_template=chat_template,
                                use_recorded_responses=use_recorded_responses, batch_size=batch_size, progress=progress,
                                generate=generate)
    if samples_per_prompt > 0:
        records = records + sampled_sequences(
            model, records, samples_per_prompt=samples_per_prompt, temperature=sample_temperature,
            cache_path=out_dir / SAMPLED_SEQUENCES_FILE, cache_key=cache_key, max_new_tokens=max_new_tokens,
            stop_ids=stop_ids, batch_size=batch_size, seed=seed, progress=progress, generate=generate,
        )
    eval_records = prepare_sequences(model, tokenizer, held_out, cache_path=out_dir / EVAL_SEQUENCES_FILE, cache_key=cache_key,
                                     max_new_tokens=max_new_tokens, stop_ids=stop_ids, chat_template=chat_template,
                                     batch_size=batch_size, progress=progress, generate=generate) if held_out else []
    return records, eval_records


# --------------------------------------------------------------------------------------------------
# Features and the training objective

def _forward_without_logits(model: torch.nn.Module) -> dict[str, Any]:
    """Ask for one row of logits where the model allows it: features need hidden states, not [N, T, V] logits."""
    return {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}


@torch.inference_mode()
def extract_features(target_model: CausalLM, sequences: Sequence[Sequence[int]], hidden_state_indices: Sequence[int],
                     *, batch_size: int = 8, device: torch.device | str = "cpu",
                     dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Concatenated taps ``[L_i, n*H]`` for every sequence: one frozen-target pass per sequence, batched.

    Sequences are grouped by length and right-padded; causal attention keeps every real row what an unpadded
    pass gives (to rounding: the kernels sum in another order), so no attention mask is needed. Only the taps
    are kept (hooks, :class:`~dflash_doctor.engine.target.TapRecorder`), not every layer's states. Results
    stay on ``device`` in ``dtype`` (default: the target's).
    """
    extra = _forward_without_logits(target_model)
    model_device = next(target_model.parameters()).device
    points = tap_points(target_model)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    features: dict[int, torch.Tensor] = {}  # by sequence index: computed in length order, returned in input order
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(len(sequences[i]) for i in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, index in enumerate(chunk):
            ids[row, :len(sequences[index])] = torch.tensor(list(sequences[index]))
        with TapRecorder(points, tuple(hidden_state_indices)) as recorder:  # the taps only, not every layer's states
            target_model(input_ids=ids.to(model_device), **extra)
        taps = recorder.features(model_device)  # [n, width, F]
        for row, index in enumerate(chunk):
            features[index] = taps[row, :len(sequences[index])].to(device, dtype=dtype or taps.dtype).clone()
    return [features[i] for i in range(len(sequences))]


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weight of slots 1..B-1: ``exp(-(j - 1) / gamma)`` -> [B-1], 1.0 for the first drafted slot."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def sample_anchors(prompt_lengths: torch.Tensor, lengths: torch.Tensor, width: int, num_anchors: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct anchors ``[N, A]`` in each response (positions ``P_i .. L_i - 2``) and their validity.

    An anchor needs one label after it, hence ``L_i - 2``; rows with fewer usable positions than A are
    filled with invalid anchors.
    """
    positions = torch.arange(width)
    usable = (positions >= prompt_lengths[:, None]) & (positions <= lengths[:, None] - 2)
    scores = torch.rand(usable.shape, generator=generator).masked_fill(~usable, -1.0)
    top = scores.topk(min(num_anchors, width), dim=1)
    return top.indices, top.values >= 0


def block_loss(draft: DFlashDraftModel, target_model: CausalLM, token_ids: torch.Tensor, lengths: torch.Tensor,
               features: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor,
               weights: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Decay-weighted cross-entropy of every block, the number of labels, and accepted tokens per block.

    token_ids [N, T], lengths [N], features [N, T, F], anchors / anchor_valid [N, A], weights [B-1].
    "Accepted per block" counts the leading slots whose argmax equals the label: what a live step at
    K = B-1 would accept on these sequences (a running estimate of tau - 1).
    """
    block_size = draft.config.block_size
    n, width = token_ids.shape
    embedding = cast(torch.nn.Embedding, target_model.get_input_embeddings())
    hidden = draft_block_hidden(draft, embedding.weight, token_ids, context_kv_for(draft, features),
                                anchors, anchor_valid, block_size)  # [N, A, B, H]
    label_positions = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)  # [N, A, B-1]
    label_valid = anchor_valid[:, :, None] & (label_positions < lengths[:, None, None])
    labels = token_ids.gather(1, label_positions.clamp(max=width - 1).view(n, -1)).view_as(label_positions)
    rows = hidden[:, :, 1:][label_valid]  # [M, H]
    head = cast(torch.nn.Linear, target_model.get_output_embeddings())  # a causal LM's vocabulary head
    logits = head(rows.to(head.weight.dtype)).float()  # [M, V]
    targets = labels[label_valid]
    row_weights = weights.to(logits.device).expand_as(label_positions)[label_valid]
    loss = (row_weights * F.cross_entropy(logits, targets, reduction="none")).sum() / row_weights.sum()
    with torch.no_grad():
        correct = torch.zeros_like(label_valid)
        correct[label_valid] = logits.argmax(dim=-1) == targets
        accepted = correct.long().cumprod(dim=-1).sum(dim=-1)[anchor_valid]  # [valid blocks]
    return loss, targets.numel(), accepted.float().mean()


# --------------------------------------------------------------------------------------------------
# The training loop

def _lr_factor(step: int, total_steps: int, warmup_steps: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _data_fingerprint(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> str:
    digest = hashlib.sha256()
    for tokens, prompt_length in zip(sequences, prompt_lengths):
        digest.update(json.dumps([prompt_length, list(tokens)]).encode())
    return digest.hexdigest()[:20]


def _architecture(config: DFlashConfig) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(config).items() if k != "extra"}


def _resume_identity(config: TrainConfig, draft: DFlashDraftModel, data: str) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed: hyper-parameters, architecture, data and starting weights
    (``draft`` before training: a fresh one from the seed, or an ``--init-from`` draft)."""
    train = {k: v for k, v in config.as_dict().items() if k not in _BOOKKEEPING_FIELDS}
    return {"train_config": train, "architecture": _architecture(draft.config), "data": data, "init": weights_fingerprint(draft)}


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _save_checkpoint(path: Path, draft: DFlashDraftModel, state: dict[str, Any], extra_config: dict[str, Any] | None) -> None:
    """Write a resumable checkpoint in pieces of at most :data:`CHECKPOINT_PIECE_BYTES`, replacing the old one atomically.

    Why pieces: a checkpoint must survive being copied through channels that take files of 16 MiB at
    most (the GPU machine this project trains on); nothing in it is pickled. The layout follows
    transformers' sharded checkpoints: ``config.json`` + ``model-0000i-of-0000n.safetensors`` +
    ``model.safetensors.index.json`` (the draft itself, loadable as is), ``optimizer/optimizer-*.safetensors``
    (+ index; AdamW's per-parameter tensors keyed ``<parameter index>.<name>``) and
    :data:`TRAINING_STATE_FILE` (identity, step, loss log, scheduler, optimizer hyper-parameters, the data
    generator's state, and the size and sha256 of every other piece, so a resume refuses a missing or
    cut-short copy instead of training from it).
    """
    from huggingface_hub import save_torch_state_dict

    staging = path.with_name(path.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)
    save_dflash_draft(draft, staging, extra_config=extra_config, max_shard_bytes=CHECKPOINT_PIECE_BYTES)
    optimizer = state["optimizer"]
    moments = {f"{index}.{name}": tensor.detach().cpu() for index, entries in optimizer["state"].items() for name, tensor in entries.items()}
    (staging / OPTIMIZER_DIR_NAME).mkdir()
    save_torch_state_dict(moments, staging / OPTIMIZER_DIR_NAME, filename_pattern="optimizer{suffix}.safetensors",
                          max_shard_size=CHECKPOINT_PIECE_BYTES, metadata={"format": "pt"})
    pieces = {piece.relative_to(staging).as_posix(): {"bytes": piece.stat().st_size, "sha256": _sha256(piece)}
              for piece in sorted(staging.rglob("*")) if piece.is_file()}
    record = {"identity": state["identity"], "step": state["step"], "log": state["log"], "scheduler": state["scheduler"],
              "optimizer_param_groups": optimizer["param_groups"],
              "generator": base64.b64encode(state["generator"].numpy().tobytes()).decode("ascii"), "window": state["window"],
              "pieces": pieces}
    (staging / TRAINING_STATE_FILE).write_text(json.dumps(record) + "\n", encoding="utf-8")
    previous = path.with_name(path.name + ".old")
    if path.exists():
        path.replace(previous)
    staging.replace(path)
    if previous.exists():
        shutil.rmtree(previous)


def remove_checkpoint(path: Path) -> None:
    """Remove the checkpoint in ``path`` and what an interrupted :func:`_save_checkpoint` left beside it (its
    ``.tmp`` staging, the moved-aside ``.old`` that :func:`_load_checkpoint` would restore), so a run told
    to start afresh cannot resume it."""
    for folder in (path, path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")):
        shutil.rmtree(folder, ignore_errors=True)


def _identity_difference(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """What differs between a checkpoint's identity and this run's, in words ("" when nothing does)."""
    saved_train = saved.get("train_config", {})
    parts = [f"{name} {saved_train.get(name)} there, {value} now" for name, value in current["train_config"].items()
             if saved_train.get(name) != value]
    parts += [f"other {words}" for key, words in (("architecture", "draft architecture"), ("data", "training sequences"),
                                                   ("init", "starting weights")) if saved.get(key) != current[key]]
    return "; ".join(parts)


def _load_checkpoint(path: Path, identity: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """Weights and training state (on the CPU) of the checkpoint in ``path``; None when there is none.

    Every piece is checked against the size and sha256 :data:`TRAINING_STATE_FILE` lists before anything
    is read, and the run's identity (hyper-parameters, architecture, data, starting weights) must match:
    each failure is one sentence naming the piece or the difference (UsageError).
    """
    from safetensors.torch import load_file

    previous = path.with_name(path.name + ".old")
    if not path.exists() and previous.is_dir():  # killed between the two renames of _save_checkpoint: the last one is whole
        previous.replace(path)
    state_file = path / TRAINING_STATE_FILE
    if not state_file.is_file():
        if path.is_dir() and any(path.iterdir()):
            raise UsageError(f"{path} holds checkpoint files but no {TRAINING_STATE_FILE} (the piece that lists the others); "
                             "copy it too, or remove the folder to start afresh.")
        return None
    try:
        record = json.loads(state_file.read_text(encoding="utf-8"))
        pieces = dict(record["pieces"])
        if not _STATE_KEYS <= record.keys():
            raise KeyError(sorted(_STATE_KEYS - record.keys()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UsageError(f"{state_file} is cut short or damaged (not the JSON a checkpoint writes); copy it again.") from None
    for name, expected in pieces.items():
        piece = path / name
        if not piece.is_file():
            raise UsageError(f"checkpoint piece {piece} is missing; copy all {len(pieces) + 1} pieces of the checkpoint "
                             f"({TRAINING_STATE_FILE} lists them).")
        if piece.stat().st_size != expected["bytes"]:
            raise UsageError(f"checkpoint piece {piece} has {piece.stat().st_size} bytes instead of {expected['bytes']} "
                             "(cut short in a copy?); copy it again.")
        if _sha256(piece) != expected["sha256"]:
            raise UsageError(f"checkpoint piece {piece} is not the file the checkpoint wrote (sha256 differs); copy it again.")
    difference = _identity_difference(record["identity"], json.loads(json.dumps(identity)))
    if difference:
        raise UsageError(f"{path} holds the checkpoint of another training run ({difference}); resume it with its own flags "
                         "(--steps too: its cosine schedule ends at its own steps), continue its finished draft with "
                         "--init-from and a fresh --out (new optimizer and schedule), or start afresh with a fresh --out.")
    weights: dict[str, torch.Tensor] = {}
    optimizer_state: dict[int, dict[str, torch.Tensor]] = {}
    for name in pieces:
        if name.startswith(f"{OPTIMIZER_DIR_NAME}/") and name.endswith(".safetensors"):
            for key, tensor in load_file(path / name).items():
                index, _, entry = key.partition(".")
                optimizer_state.setdefault(int(index), {})[entry] = tensor
        elif name.endswith(".safetensors"):
            weights.update(load_file(path / name))
    generator = torch.frombuffer(bytearray(base64.b64decode(record["generator"])), dtype=torch.uint8)
    state = {"step": record["step"], "log": record["log"], "scheduler": record["scheduler"], "generator": generator, "window": record["window"],
             "optimizer": {"state": optimizer_state, "param_groups": record["optimizer_param_groups"]}}
    return weights, state


def train_dflash_draft(target_model: CausalLM, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                       config: TrainConfig, draft: DFlashDraftModel, *, checkpoint_dir: Path | None = None,
                       extra_config: dict[str, Any] | None = None, feature_batch_size: int = 8,
                       features: Sequence[torch.Tensor] | None = None, deadline: float | None = None,
                       progress: bool = False) -> TrainingResult:
    """Train ``draft`` (a new one, or a checkpoint to fine-tune) on ``sequences`` against the frozen target.

    ``sequences[i]`` is prompt + response token ids and ``prompt_lengths[i]`` where the response starts.
    With ``checkpoint_dir``, a resumable checkpoint (:func:`_save_checkpoint`: pieces under 16 MiB) is
    written every ``config.checkpoint_every`` steps and at the end, and a run started on a directory that
    holds one continues from it bit for bit: the same weights and loss log as a run never stopped. It
    needs the same hyper-parameters, architecture, data and starting weights; ``config.steps`` too, because
    the cosine schedule is laid out over them (a longer run from a finished draft is a new run that starts
    from it: ``--init-from``, fresh AdamW moments, its own warm-up and cosine). The target's parameters are
    frozen in place (``requires_grad_(False)``).
    ``features`` (one ``[L_i, n*H]`` tensor per sequence, from :func:`extract_features` with the draft's
    taps) skips the frozen-target pass: runs that differ only in their hyper-parameters share it.
    ``deadline`` (a :func:`time.perf_counter` value) stops the run at the first loss-log row past it, with a
    checkpoint there: a command that must end by a time limit stops cleanly, and the same call later goes on
    bit for bit (a row boundary, so the resumed loss log is the uninterrupted one).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    if len(sequences) != len(prompt_lengths) or (features is not None and len(features) != len(sequences)):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths"
                         + (f" and {len(features)} feature tensors" if features is not None else ""))
    usable = [i for i, (tokens, p) in enumerate(zip(sequences, prompt_lengths)) if len(tokens) >= p + 2]
    if not usable:
        raise UsageError("no training sequence has two or more response tokens; raise --max-new-tokens or use another workload.")
    given_features = [features[i] for i in usable] if features is not None else None
    sequences = [list(sequences[i]) for i in usable]
    prompt_lengths = [int(prompt_lengths[i]) for i in usable]
    device = torch.device(config.device)
    target_model.requires_grad_(False).eval()
    draft.to(device=device, dtype=torch.float32)

    identity = _resume_identity(config, draft, _data_fingerprint(sequences, prompt_lengths))
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup_steps = max(1, round(config.warmup_fraction * config.steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, config.steps, warmup_steps))
    step, log = 0, []
    resumed = _load_checkpoint(checkpoint_dir, identity) if checkpoint_dir is not None else None
    if resumed is not None:
        weights, state = resumed
        draft.load_state_dict(weights)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        generator.set_state(state["generator"])
        step, log = int(state["step"]), list(state["log"])
    resumed_from_step = step

    def checkpoint() -> None:
        if checkpoint_dir is not None:
            window = {"loss_sum": float(loss_sum), "accepted_sum": float(accepted_sum), "labels": labels_sum, "steps": window_steps}
            state = {"identity": identity, "step": step, "log": log, "optimizer": optimizer.state_dict(), "window": window,
                     "scheduler": scheduler.state_dict(), "generator": generator.get_state()}
            _save_checkpoint(checkpoint_dir, draft, state, extra_config)

    token_tensors = [torch.tensor(s, device=device) for s in sequences]
    # bf16 on CUDA: the draft reads them under bf16 autocast anyway, and it halves the memory of a large data set
    features = given_features or extract_features(target_model, sequences, draft.hidden_state_indices, batch_size=feature_batch_size,
                                                  device=device, dtype=torch.bfloat16 if device.type == "cuda" else None)
    all_prompt_lengths = torch.tensor(prompt_lengths)
    all_lengths = torch.tensor([len(s) for s in sequences])
    weights = slot_weights(draft.config.block_size, config.loss_decay_gamma).to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    draft.train()
    columns = (TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]:.3f}"),
               TextColumn("accepted/block {task.fields[accepted]:.2f}"), TextColumn("{task.fields[tokens_per_s]:,.0f} label tok/s"),
               TimeRemainingColumn())
    # the loss-log row being summed; a checkpoint between two rows carries it, so the resumed log is the straight one
    window = resumed[1]["window"] if resumed is not None else {"loss_sum": 0.0, "accepted_sum": 0.0, "labels": 0, "steps": 0}
    loss_sum = torch.full((), window["loss_sum"], device=device)
    accepted_sum = torch.full((), window["accepted_sum"], device=device)
    labels_sum, window_steps, window_started = window["labels"], window["steps"], time.perf_counter()
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("train", total=config.steps, completed=step, loss=float("nan"), accepted=float("nan"), tokens_per_s=0.0)
        while step < config.steps:
            batch = torch.randperm(len(sequences), generator=generator)[: config.batch_size]
            lengths, batch_prompt_lengths = all_lengths[batch], all_prompt_lengths[batch]
            width = int(lengths.max())
            anchors, anchor_valid = sample_anchors(batch_prompt_lengths, lengths, width, config.anchors_per_sequence, generator)
            token_ids = torch.nn.utils.rnn.pad_sequence([token_tensors[i] for i in batch.tolist()], batch_first=True)
            batch_features = torch.nn.utils.rnn.pad_sequence([features[i] for i in batch.tolist()], batch_first=True)
            with autocast:
                loss, num_labels, accepted = block_loss(draft, target_model, token_ids, lengths.to(device), batch_features,
                                                        anchors.to(device), anchor_valid.to(device), weights)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), config.grad_clip_norm)
            optimizer.step()
            scheduler.step()
            step += 1
            loss_sum += loss.detach()
            accepted_sum += accepted
            labels_sum += num_labels
            window_steps += 1
            if step % config.log_every == 0 or step == config.steps:
                elapsed = time.perf_counter() - window_started
                row = {"step": step, "loss": float(loss_sum) / window_steps, "accepted_per_block": float(accepted_sum) / window_steps,
                       "lr": optimizer.param_groups[0]["lr"], "tokens_per_s": float(labels_sum) / max(elapsed, 1e-9)}
                log.append(row)
                bar.update(task, completed=step, loss=row["loss"], accepted=row["accepted_per_block"], tokens_per_s=row["tokens_per_s"])
                loss_sum.zero_()
                accepted_sum.zero_()
                labels_sum, window_steps, window_started = 0, 0, time.perf_counter()
                if deadline is not None and time.perf_counter() > deadline:
                    break
            if step % config.checkpoint_every == 0 and step < config.steps:
                checkpoint()
    checkpoint()
    draft.eval()
    return TrainingResult(draft=draft, log=log, resumed_from_step=resumed_from_step, num_sequences=len(sequences), final_step=step)


# --------------------------------------------------------------------------------------------------
# Held-out acceptance at temperature 0

@torch.inference_mode()
def held_out_steps(target_model: CausalLM, draft: DFlashDraftModel, records: Sequence[SequenceRecord], *,
                   stop_ids: frozenset[int], k: int | None = None) -> list[dict[str, Any]]:
    """Per-step rows (``request_id``, ``class``, ``k``, ``num_drafted``, ``num_accepted``...) of the live loop at T = 0.

    When a record's response is the target's own greedy continuation, the live loop at temperature 0
    commits exactly those tokens, so teacher-forced replay (:mod:`dflash_doctor.engine.teacher`, through
    the proposer interface like every other replay) gives its steps without running it. A response cut
    by the generation limit ends with a token that can only be a bonus; one ended by a stop token can be
    drafted up to the stop. The rows feed :func:`dflash_doctor.stats.metrics.tau_with_ci`; all turns of a
    request share its id (the bootstrap unit).
    """
    target = TargetModel(target_model)
    proposer = DFlashProposer(draft, target)
    k = min(k or proposer.max_k, proposer.max_k)
    rows = []
    for record in records:
        prompt, output = list(record.token_ids[:record.prompt_length]), list(record.token_ids[record.prompt_length:])
        if not output:
            continue
        table, _ = slot_table(target, proposer, TeacherSequence(prompt, output), k, record_divergence=False)
        limit = len(output) + (1 if output[-1] in stop_ids else 0)
        rows += [as_row(StepRow(request_id=record.request_id, request_class=record.request_class, **vars(step)))
                 for step in walk_schedule(table.matches, output, k, limit, stop_ids)]
    return rows


def tau_by_class(steps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pooled tau of :func:`held_out_steps` rows with its bootstrap interval over requests, overall and per class."""
    import pandas as pd

    frame = pd.DataFrame(steps)
    out = {}
    for name, group in [("overall", frame), *sorted(frame.groupby("class"))]:
        tau, interval = tau_with_ci(group, group=str(name))
        out[str(name)] = {"tau": tau, "tau_ci": interval, "num_requests": int(group["request_id"].nunique())}
    return out
