"""How often one `check` runs the target over a prompt, what each of those uses costs, and what one shared
prefill would save, per prompt length.

    .venv/bin/python benchmarks/check_prefills.py [--lengths 256,1024,4096] [--repeats 3] [--threads 1]

The demo pair (SmolLM2-135M-Instruct fp32 target, the built-in DFlash draft, loaded locally as `check` loads
it) on one long prompt per length, built from the demo workload's own texts, 128 new tokens, K = 15, the
default ``vllm`` end-of-request rule. A `check` uses each prompt:

1. in the target's greedy answer (:func:`~dflash_doctor.engine.batched.generate_greedy_batch`): a prefill
   of the prompt alone, then the decoding steps;
2. in the teacher-forced pass (:func:`~dflash_doctor.engine.teacher.slot_table`): one target forward over
   prompt + answer + tail, tapping the layers the draft reads at every position, once for every K;
3. for the first three first turns only, in the lossless probe's live loop (a prefill of the prompt,
   tapped, then the speculative steps) and in the layer-offset probe (one more forward over prompt +
   answer, tapping every offset's layers).

Timed side by side in one run, medians of ``--repeats``: each use, and the teacher-forced pass split as a
shared prefill would run it (the prompt's forward, tapped, then a forward over answer + tail on its cache:
its second part is what the pass would cost with the prompt prefilled already). The share column prices
the saving against the whole check's time for that request (greedy answer decoded alone, one request per
batch: in a check's batch of 32 the decoding's share per request is smaller, the saving's larger).

Exactness is measured beside the times: whether the greedy answer's prefill computes the same logits as
the engine's own prefill (``TargetModel.forward``), and whether the split teacher-forced pass gives the
same draft guesses (every slot of every anchor at K = 15) as the single pass. Not a test: it asserts
nothing.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np
import torch

from dflash_doctor.engine import batched
from dflash_doctor.engine.live import speculative_generate
from dflash_doctor.engine.schedule import CONVENTIONS
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, walk_schedule
from dflash_doctor.inputs.config import build_config
from dflash_doctor.inputs.workloads import load_workload
from dflash_doctor.models.pair import Pair, load_pair

K = 15
MAX_NEW_TOKENS = 128
CONVENTION = CONVENTIONS["vllm"]


def long_prompt(pair: Pair, length: int) -> list[int]:
    """A chat prompt of about ``length`` tokens: the demo workload's user texts, repeated and cut, then a
    question about them, rendered with the target's chat template."""
    texts = [m["content"] for r in load_workload("demo") for m in (r.messages or ()) if m["role"] == "user"]
    body_ids: list[int] = []
    while len(body_ids) < length:
        body_ids += pair.tokenizer.encode("\n\n".join(texts), add_special_tokens=False)
    question = "\n\nSummarise the texts above in one paragraph."
    n = length
    for _ in range(4):  # the template adds a few tokens, and cutting may merge two: converge on the length
        content = pair.tokenizer.decode(body_ids[:n]) + question
        ids = pair.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5
        if len(ids) == length:
            break
        n += length - len(ids)
    return ids


class Timed:
    """Wall seconds of each call to the wrapped module function, collected under a label."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - start)

        return timed


def clock(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


@torch.inference_mode()
def measure(pair: Pair, prompt: list[int], repeats: int) -> dict[str, float]:
    target, proposer = pair.target, pair.proposer
    taps = proposer.needs.hidden_state_indices
    device = target.device
    prompt_t = torch.tensor(prompt, device=device)
    prefills = Timed()
    original = batched._prefill
    batched._prefill = prefills.wrap(original)
    times: dict[str, list[float]] = {}
    figures: dict[str, float] = {}
    try:
        for _ in range(repeats):
            # 1. the greedy answer, as replay_teacher asks for it (the tail an engine drafting past the end needs)
            seconds, outputs = clock(
                lambda: batched.generate_greedy_batch(
                    target.model, [prompt], max_new_tokens=MAX_NEW_TOKENS, stop_ids=pair.stop_ids, past_end=K - 1
                )
            )
            output = outputs[0]
            end = next((i + 1 for i, t in enumerate(output[:MAX_NEW_TOKENS]) if t in pair.stop_ids), MAX_NEW_TOKENS)
            answer, tail = output[:end], output[end : end + K - 1]
            times.setdefault("greedy prefill", []).append(prefills.seconds[-1])
            times.setdefault("greedy decode", []).append(seconds - prefills.seconds[-1])
            # 2. the teacher-forced pass: one forward over prompt + answer + tail, then the draft's work
            known = torch.tensor(prompt + answer + tail, device=device)
            target.reset()
            seconds, full = clock(lambda: target.forward(known, taps=taps, logits_from=len(prompt)))
            target.reset()
            times.setdefault("teacher forward", []).append(seconds)
            sequence = TeacherSequence(prompt, answer, tail)

            def drafted_from(matches: np.ndarray) -> list[int]:
                steps = walk_schedule(matches, answer, K, MAX_NEW_TOKENS, pair.stop_ids, CONVENTION)
                return [s.position - 1 for s in steps]

            seconds, _ = clock(
                lambda: slot_table(
                    target,
                    proposer,
                    sequence,
                    K,
                    full_anchors=drafted_from,
                    target_pass=(full.logits, full.features),
                    max_new_tokens=MAX_NEW_TOKENS,
                    convention=CONVENTION,
                )
            )
            times.setdefault("teacher draft work", []).append(seconds)
            # the same pass split as a shared prefill runs it: the
            # prompt (tapped, the live loop's prefill), then the rest
            target.reset()
            seconds, head = clock(lambda: target.forward(prompt_t, taps=taps, logits_from=len(prompt) - 1))
            times.setdefault("prompt prefill, tapped", []).append(seconds)
            seconds, rest = clock(lambda: target.forward(known[len(prompt) :], taps=taps))
            target.reset()
            times.setdefault("teacher forward after a shared prefill", []).append(seconds)
            # 3. the lossless probe's live loop (its own prefill included)
            seconds, live = clock(
                lambda: speculative_generate(
                    target,
                    proposer,
                    prompt_t,
                    k=K,
                    max_new_tokens=MAX_NEW_TOKENS,
                    stop_ids=pair.stop_ids,
                    record_tokens=False,
                )
            )
            times.setdefault("live loop (prefill + steps)", []).append(seconds)
        # exactness, once (deterministic): the greedy prefill's logits vs the engine's, split vs single pass
        states, last = original(target.model, [tuple(prompt)], 1)
        figures["greedy vs engine prefill, max |logit diff|"] = float((last[0].float() - head.logits[-1]).abs().max())
        figures["split vs single pass, max |logit diff|"] = float((rest.logits - full.logits).abs().max())
        assert full.features is not None and head.features is not None and rest.features is not None
        split_features = torch.cat([head.features, rest.features])
        figures["split vs single pass, max |feature diff|"] = float((split_features - full.features).abs().max())
        tables = [
            slot_table(target, proposer, sequence, K, target_pass=pass_, record_divergence=False)[0]
            for pass_ in ((full.logits, full.features), (rest.logits, split_features))
        ]
        figures["split vs single pass, differing guesses"] = float((tables[0].guesses != tables[1].guesses).sum())
        figures["guesses"] = float(tables[0].guesses.size)
        walked = [
            walk_schedule(t.matches, answer, K, MAX_NEW_TOKENS, pair.stop_ids, CONVENTION, t.drafted) for t in tables
        ]
        taus = [1 + sum(s.num_accepted for s in steps) / max(len(steps), 1) for steps in walked]
        figures["tau single pass"], figures["tau split"] = taus
        live_steps = [s for s in live.steps if s.num_drafted]
        figures["tau live (the probe's own llamacpp rule)"] = 1 + sum(s.num_accepted for s in live_steps) / max(
            len(live_steps), 1
        )
        figures["live output == greedy answer"] = float(live.output_ids == answer)
        figures["answer tokens"] = float(len(answer))
    finally:
        batched._prefill = original
    return {**{name: statistics.median(values) for name, values in times.items()}, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--lengths", default="256,1024,4096", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = load_pair(build_config())
    lengths = [int(n) for n in args.lengths.split(",")]
    measure(pair, long_prompt(pair, 64), 1)  # warm-up
    print(
        f"CPU, torch {torch.__version__}, {torch.get_num_threads()} thread(s); demo pair (SmolLM2-135M-Instruct fp32, "
        f"DFlash draft), {MAX_NEW_TOKENS} new tokens, K = {K}, medians of {args.repeats}"
    )
    rows = []
    for length in lengths:
        prompt = long_prompt(pair, length)
        m = measure(pair, prompt, args.repeats)
        m["prompt tokens"] = len(prompt)
        rows.append(m)
        print(f"\nprompt {len(prompt)} tokens, answer {int(m['answer tokens'])} tokens")
        for name, value in m.items():
            print(f"  {name:48s} {value:10.4g}")
    print(
        "\n| prompt | greedy prefill s | greedy decode s | teacher forward s | of it the prompt s | teacher draft s "
        "| live prefill s | live steps s | request s (probed) | teacher sharing saves | + live sharing saves |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m in rows:
        prompt_part = m["teacher forward"] - m["teacher forward after a shared prefill"]
        live_prefill = m["prompt prefill, tapped"]
        live_steps = m["live loop (prefill + steps)"] - live_prefill
        plain = m["greedy prefill"] + m["greedy decode"] + m["teacher forward"] + m["teacher draft work"]
        probed = plain + m["live loop (prefill + steps)"] + m["teacher forward"]  # + the layer-offset forward
        print(
            f"| {int(m['prompt tokens'])} | {m['greedy prefill']:.2f} | {m['greedy decode']:.2f} "
            f"| {m['teacher forward']:.2f} | {prompt_part:.2f} | {m['teacher draft work']:.2f} | {live_prefill:.2f} "
            f"| {live_steps:.2f} | {plain:.1f} ({probed:.1f}) | {prompt_part / plain:.0%} ({prompt_part / probed:.0%}) "
            f"| {live_prefill / probed:.0%} |"
        )


if __name__ == "__main__":
    main()
