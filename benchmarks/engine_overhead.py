"""The live loop's own overhead on CPU: wall time spent OUTSIDE model forwards, as a share of wall time.

SmolLM2-135M-Instruct (the demo target) with (a) a weaker autoregressive draft (the target with 4-bit
fake-quantised decoder weights) and (b) the shipped demo DFlash draft, over a few prompts of the built-in
``demo`` workload. Every model computation the loop asks for is timed: the target's forward, the draft's
forward, the DFlash context K/V projection, and the target embedding / lm_head the DFlash proposer borrows.
Nested calls count once (a depth counter), so "model time" is the time at least one of them is running;
the rest of the wall time is the loop: acceptance, cache cropping, tensor glue, and the per-token
divergence records (reported with and without them). The aim is an overhead below 10%.

    python benchmarks/engine_overhead.py [--requests 3] [--max-new-tokens 48] [--threads 2] [--profile]

Not a test: it prints figures and asserts nothing. ``--profile`` adds a cProfile of the loop (top
functions by own time) for finding hot spots.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import functools
import pstats
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dflash_doctor.models.derive import fake_quantize
from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.proposers.base import Proposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.models.loading import (
    DEMO_DRAFT_DIR,
    demo_target_path,
    load_causal_lm,
    load_dflash_draft,
    resolve_model_dir,
)
from dflash_doctor.models.pair import stop_ids_of
from dflash_doctor.inputs.workloads import encode_request_turn, load_workload

QUANTIZED_DRAFT_BITS = 4


@dataclass
class SmolPair:
    """The demo target, its tokenizer and stop ids, a weaker autoregressive draft, the demo DFlash draft."""

    target_model: torch.nn.Module
    tokenizer: object
    stop_ids: frozenset[int]
    quantized_draft: torch.nn.Module
    dflash_draft: torch.nn.Module


def load_smollm2_pair() -> SmolPair:
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(str(demo_target_path()))
    target_model = load_causal_lm(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return SmolPair(
        target_model=target_model,
        tokenizer=tokenizer,
        stop_ids=stop_ids_of(target_model, tokenizer),
        quantized_draft=fake_quantize(copy.deepcopy(target_model), bits=QUANTIZED_DRAFT_BITS),
        dflash_draft=load_dflash_draft(DEMO_DRAFT_DIR),
    )


def demo_prompts(tokenizer, num_requests: int, seed: int = 0) -> list[torch.Tensor]:
    """First-turn prompt ids of ``num_requests`` demo-workload requests, stratified over classes."""
    requests = load_workload("demo", max_requests=num_requests, seed=seed)
    return [torch.tensor(encode_request_turn(tokenizer, request)) for request in requests]


class ModelClock:
    """Accumulates wall time while any wrapped model call is running (outermost call only)."""

    def __init__(self) -> None:
        self.model_time_s = 0.0
        self._depth = 0
        self._entered = 0.0
        self._restore: list[Callable[[], None]] = []

    def wrap(self, owner: object, method_name: str) -> None:
        """Time ``owner.method_name`` (an instance attribute shadows the class method until :meth:`unwrap`)."""
        original = getattr(owner, method_name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if self._depth == 0:
                self._entered = time.perf_counter()
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.model_time_s += time.perf_counter() - self._entered

        setattr(owner, method_name, timed)
        self._restore.append(lambda: delattr(owner, method_name))

    def unwrap(self) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()


def instrument(clock: ModelClock, target_model: torch.nn.Module, draft_model: torch.nn.Module | None) -> None:
    clock.wrap(target_model, "forward")
    clock.wrap(target_model.get_input_embeddings(), "forward")
    clock.wrap(target_model.get_output_embeddings(), "forward")
    if draft_model is not None:
        clock.wrap(draft_model, "forward")
        if hasattr(draft_model, "context_kv"):
            clock.wrap(draft_model, "context_kv")


@dataclass
class Measurement:
    wall_s: float
    model_s: float
    output_tokens: int
    steps: int

    @property
    def overhead_share(self) -> float:
        return (self.wall_s - self.model_s) / self.wall_s

    def line(self, label: str) -> str:
        per_step_ms = 1e3 * (self.wall_s - self.model_s) / max(self.steps, 1)
        return (
            f"{label:<50} wall {self.wall_s:7.2f} s  model {self.model_s:7.2f} s  "
            f"overhead {100 * self.overhead_share:5.1f}%  ({per_step_ms:5.2f} ms/step, "
            f"{self.output_tokens / self.wall_s:5.1f} tok/s)"
        )


def measure(
    target_model: torch.nn.Module,
    draft_model: torch.nn.Module | None,
    make_proposer: Callable[[TargetModel], Proposer] | None,
    prompts: list[torch.Tensor],
    *,
    k: int,
    max_new_tokens: int,
    stop_ids: frozenset[int],
    record_tokens: bool = True,
    hidden_state_indices: tuple[int, ...] = (),
) -> Measurement:
    """Run every prompt once (speculative, or plain decoding when ``make_proposer`` is None) under the clock."""
    clock = ModelClock()
    instrument(clock, target_model, draft_model)
    wall = 0.0
    tokens = steps = 0
    try:
        for prompt in prompts:
            target = TargetModel(target_model, hidden_state_indices)
            started = time.perf_counter()
            if make_proposer is None:
                result = plain_generate(target, prompt, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
                steps += len(result.output_ids)
            else:
                result = speculative_generate(
                    target,
                    make_proposer(target),
                    prompt,
                    k=k,
                    max_new_tokens=max_new_tokens,
                    stop_ids=stop_ids,
                    record_tokens=record_tokens,
                )
                steps += len(result.steps)
            wall += time.perf_counter() - started
            tokens += len(result.output_ids)
    finally:
        clock.unwrap()
    return Measurement(wall_s=wall, model_s=clock.model_time_s, output_tokens=tokens, steps=steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3, help="demo-workload requests (stratified over classes)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--ar-k", type=int, default=4, help="K for the autoregressive draft")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--profile", action="store_true", help="also cProfile each speculative configuration")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    pair = load_smollm2_pair()
    prompts = demo_prompts(pair.tokenizer, args.requests)
    dflash = pair.dflash_draft
    dflash_k = dflash.config.block_size - 1
    configs = [
        (
            f"autoregressive 4-bit draft, K={args.ar_k}",
            pair.quantized_draft,
            lambda t: AutoregressiveProposer(pair.quantized_draft),
            args.ar_k,
            (),
        ),
        (
            f"demo DFlash draft, K={dflash_k}",
            dflash,
            lambda t: DFlashProposer(dflash, t),
            dflash_k,
            dflash.hidden_state_indices,
        ),
    ]
    print(
        f"CPU, torch {torch.__version__}, {torch.get_num_threads()} threads; SmolLM2-135M-Instruct fp32; "
        f"{len(prompts)} prompts x {args.max_new_tokens} new tokens (prompt lengths {[len(p) for p in prompts]})"
    )
    common = dict(max_new_tokens=args.max_new_tokens, stop_ids=pair.stop_ids)
    # warm-up: first calls allocate caches and pick kernels
    measure(pair.target_model, None, None, prompts[:1], k=0, **{**common, "max_new_tokens": 4})
    print(measure(pair.target_model, None, None, prompts, k=0, **common).line("plain greedy decoding (reference)"))
    for label, draft_model, make_proposer, k, taps in configs:
        measure(
            pair.target_model,
            draft_model,
            make_proposer,
            prompts[:1],
            k=k,
            hidden_state_indices=taps,
            **{**common, "max_new_tokens": 4},
        )
        for record in (True, False):
            m = measure(
                pair.target_model,
                draft_model,
                make_proposer,
                prompts,
                k=k,
                record_tokens=record,
                hidden_state_indices=taps,
                **common,
            )
            print(m.line(f"{label}{'' if record else ', no token records'}"))
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            measure(pair.target_model, draft_model, make_proposer, prompts, k=k, hidden_state_indices=taps, **common)
            profiler.disable()
            print(f"--- cProfile, {label}: top 20 by own time")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
