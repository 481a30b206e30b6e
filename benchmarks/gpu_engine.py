"""GPU figures for the engine on a Qwen3-8B-shaped target and a DFlash-b16-shaped draft (random bf16 weights
built from configs, no download), measured so that two runs agree. ``--target`` picks another
target shape: a Qwen3.5-9B-shaped hybrid (three gated-delta-net layers to one attention layer;
a rejected draft costs a restore and a re-run of the kept tokens, engine/cache.py) or a gpt-oss-20b-shaped
MoE with attention sinks and sliding windows (eager attention, as transformers requires).

1. Live loop: time per draft/verify step, with and without per-token records, against the floor of ONE
   draft block forward plus ONE target forward over B = 16 tokens plus one host round trip per step (the
   least a host-driven loop does), run step after step at the loop's mean context so that the GPU sees the
   same duty cycle as in the loop. Each loop run is followed by its own floor run (the ratio uses the floor
   measured next to it), records on/off alternate their order between repeats, min / median / max are
   printed, and the mean SM clock during each kind of run is sampled through NVML.
2. Teacher-forced replay: analysed tokens per second over one long sequence, and the achieved share of the
   bf16 matrix rate, against both the nominal rate (--peak-tflops) and the one measured here (8192^3 matmul).
   Records are timed twice: as a small run computes them (eager, in blocks) and as a long run does once
   compiling has paid (engine/divergence.py COMPILE_AFTER_SCORES); sections 0 and 1 run before any compile.
   FLOPs are counted from the shapes: every linear layer, the target's causal attention and the draft's
   attention over the keys each block may see (the masked-out keys a kernel may also touch are not counted).
3. A profile of one teacher-forced pass: GPU kernel time by kernel family and the top kernels, plus the
   GPU's busy share of the wall time (the rest is launch and synchronisation overhead).
0. Before all of these, in a process that has run nothing on the GPU yet: the first live-loop call (records
   off, then records on) against the same call repeated, step by step, to say where a command's one-off
   warm-up goes.
4. With ``--official`` (the PyPI ``dflash`` package installed): the live loop against the official
   ``dflash_generate`` loop on the same weights (ours saved as a z-lab checkpoint and loaded by the official
   class), records off, both warmed, rounds alternating which runs first until the median of the rounds'
   paired ratios (official / ours) is known within 5% or two minutes pass; the ratio is printed with its 95%
   interval (one timing each gave 4.1x and 0.85x twenty minutes apart: no single sample is the answer);
   outputs compared token for token.

Warm-ups run every shape the measured runs use (same prompt, same lengths); times come from CUDA events;
the GPU's clocks, temperature and throttle state are printed before and after.

Usage: python benchmarks/gpu_engine.py [--target qwen3-8b|qwen3.5-9b|gpt-oss-20b] [--repeats 6] [--peak-tflops 790]
       [--out DIR] [--official] [--first-calls] [--tiny]
``--tiny`` runs the same code on a small config on CPU (a smoke test of the script itself).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3_5TextConfig, Qwen3Config

from dflash_doctor.engine import attention, divergence
from dflash_doctor.engine.dflash_model import DFlashConfig, DFlashDraftModel, default_target_layer_ids
from dflash_doctor.engine.live import speculative_generate
from dflash_doctor.engine.schedule import CONVENTIONS
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel, attention_implementation
from dflash_doctor.engine.teacher import TeacherSequence, slot_table
from dflash_doctor.models.loading import load_dflash_draft, save_dflash_draft
from dflash_doctor.stats.step_costs import MIN_ROUNDS, TARGET_RELATIVE_HALF_WIDTH, median_interval, relative_half_width

QWEN3_8B = dict(
    hidden_size=4096,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=1000,
)
# transformers' Qwen3_5TextConfig defaults are the Qwen3.5-9B text shape (hidden 4096, 32 layers, 8 of them
# attention with 16 x 256 heads, 24 gated delta nets with 16 key / 32 value heads of 128, vocab 248,320)
TARGETS = {
    "qwen3-8b": lambda tiny: Qwen3Config(
        **(TINY if tiny else QWEN3_8B), max_position_embeddings=8192, rope_theta=1e6, tie_word_embeddings=False
    ),
    "qwen3.5-9b": lambda tiny: Qwen3_5TextConfig(
        **(
            dict(
                TINY,
                num_hidden_layers=8,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
            )
            if tiny
            else {}
        ),
        tie_word_embeddings=False,
    ),
    "gpt-oss-20b": lambda tiny: GptOssConfig(
        **(
            dict(TINY, num_local_experts=4, num_experts_per_tok=2)
            if tiny
            else dict(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4)
        ),
        tie_word_embeddings=False,
    ),
}
BLOCK_SIZE = 16
OFFICIAL_BUDGET_S = 120.0  # the official-loop comparison's timing budget: rounds stop when tight or past this
FLOOR_STEPS = 24


class SmClock:
    """Mean SM clock while a block runs, sampled through NVML every 10 ms (None where NVML is missing)."""

    def __init__(self, device: str):
        self.mean: float | None = None
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._handle = None
        if device == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            except Exception:  # NVML is optional: the figures stand without it
                self._handle = None

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self._samples.append(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))

    def __enter__(self) -> "SmClock":
        if self._handle is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._stop.set()
            self._thread.join()
            self.mean = statistics.mean(self._samples) if self._samples else None


def build(name: str, tiny: bool, device: str, dtype: torch.dtype):
    """The target of shape ``name`` and a 5-layer (2 when tiny) DFlash-b16 draft tapping five layers spread
    over it (Qwen3-8B: 1, 9, 17, 25, 33, as z-lab's draft)."""
    config = TARGETS[name](tiny)
    config._attn_implementation = attention_implementation(config)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    layers = config.num_hidden_layers
    ids = default_target_layer_ids(layers, 5) if not tiny else [1, 2, 3]
    draft_cfg = DFlashConfig(
        hidden_size=config.hidden_size,
        num_hidden_layers=2 if tiny else 5,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        block_size=BLOCK_SIZE,
        target_layer_ids=ids,
        mask_token_id=config.vocab_size - 1,
        num_target_layers=layers,
    )
    with torch.device(device):
        draft = DFlashDraftModel(draft_cfg).to(dtype).eval()
    return target, draft


class Clock:
    """Seconds of work between two points: CUDA events on a GPU; on a CPU the host's wall clock, or with
    ``cpu_time`` the process's CPU seconds (for one-thread runs: other work on a shared machine does not
    inflate them the way it inflates wall time)."""

    def __init__(self, device: str, *, cpu_time: bool = False):
        self.cuda = device.startswith("cuda")
        self.host_clock = time.process_time if cpu_time else time.perf_counter

    def time(self, fn) -> tuple[float, object]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, result
        started = self.host_clock()
        result = fn()
        return self.host_clock() - started, result

    def median(self, fn, repeats: int) -> float:
        return statistics.median(self.time(fn)[0] for _ in range(repeats))


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """min / median / max."""
    return " / ".join(f"{v * scale:.{digits}f}" for v in (min(values), statistics.median(values), max(values)))


def gpu_state(device: str) -> str:
    """Clocks, temperature, power and active throttle reasons as nvidia-smi reports them (read only)."""
    if device != "cuda":
        return "cpu"
    fields = "clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,pstate,clocks_throttle_reasons.active"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi unavailable ({exc})"
    return f"{torch.cuda.get_device_name()}: sm clock, max sm clock, mem clock, temp, power, pstate, throttle = {out}"


@torch.inference_mode()
def matmul_rate(device: str, clock: Clock) -> float:
    """Measured bf16 matrix rate in TFLOP/s (8192^3 on random data; 3 warm-ups, median of 10)."""
    n = 8192 if device == "cuda" else 512
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    return 2 * n**3 / clock.median(lambda: a @ b, 10) / 1e12


@torch.inference_mode()
def live_step_vs_floor(
    target_model, draft, device: str, clock: Clock, context: int, new_tokens: int, repeats: int
) -> None:
    k = BLOCK_SIZE - 1
    target = TargetModel(target_model, draft.hidden_state_indices)
    proposer = DFlashProposer(draft, target)
    vocab = target_model.config.vocab_size
    prompt = torch.randint(0, vocab - 2, (context,), device=device)
    # the floor at the loop's mean context (it grows by about one token per step with a random draft)
    floor_prompt = torch.randint(0, vocab - 2, (context + new_tokens // 2,), device=device)
    block = torch.randint(0, vocab - 2, (BLOCK_SIZE,), device=device)

    def loop(record: bool):
        return speculative_generate(target, proposer, prompt, k=k, max_new_tokens=new_tokens, record_tokens=record)

    def prefill():
        target.reset()
        target.forward(prompt, logits_from=len(prompt) - 1)

    def floor() -> float:
        """Per step: one draft block, one verify forward over B tokens, one host round trip (as the loop needs)."""
        target.reset()
        proposer.start(floor_prompt, target.forward(floor_prompt, logits_from=len(floor_prompt) - 1).features)
        base = target.cache_length

        def steps():
            for _ in range(FLOOR_STEPS):
                proposer.propose(1, k, k)
                target.forward(block).logits[-1, 0].item()
                target.crop(base)

        return clock.time(steps)[0] / FLOOR_STEPS

    for record in (True, False):  # warm-up: every shape of the measured runs (the last steps draft fewer tokens)
        loop(record)
    floor()
    prefill_s = clock.median(prefill, 3)
    runs = {True: [], False: []}  # (step seconds, floor seconds measured right after)
    first = {True: [], False: []}  # ratios of runs that came first in their pair
    clocks = {"loop": [], "floor": []}  # mean SM clock (MHz) during each measurement
    for r in range(repeats):
        for position, record in enumerate((True, False) if r % 2 == 0 else (False, True)):
            with SmClock(device) as sm:
                seconds, result = clock.time(lambda: loop(record))
            clocks["loop"].append(sm.mean)
            step = (seconds - prefill_s) / len(result.steps)
            with SmClock(device) as sm:
                floor_s = floor()
            clocks["floor"].append(sm.mean)
            runs[record].append((step, floor_s))
            if position == 0:
                first[record].append(step / floor_s)
    print(
        f"\nlive loop: context {context}, {new_tokens} new tokens, K={k}, {repeats} repeats (records on/off order "
        f"alternated), prefill {prefill_s * 1e3:.1f} ms subtracted; floor = one draft block + verify over "
        f"{BLOCK_SIZE} tokens + one host round trip, {FLOOR_STEPS} steps at context {len(floor_prompt)}"
    )
    print(f"{'':26}{'step ms min/med/max':>26} {'floor ms min/med/max':>26} {'ratio min/med/max':>22}")
    for record in (True, False):
        steps, floors = [s for s, _ in runs[record]], [f for _, f in runs[record]]
        ratios = [s / f for s, f in runs[record]]
        label = "with per-token records" if record else "without per-token records"
        print(f"{label:26}{spread(steps, 1e3):>26} {spread(floors, 1e3):>26} {spread(ratios, 1, 3):>22}")
    on = statistics.median(s for s, _ in runs[True])
    off = statistics.median(s for s, _ in runs[False])
    # the floor does not depend on which loop ran before it: all floor runs estimate the same quantity
    pooled = statistics.median(f for record in runs for _, f in runs[record])
    print(
        f"median step / median of all {2 * repeats} floor runs "
        f"({pooled * 1e3:.2f} ms): with records {on / pooled:.3f}, "
        f"without {off / pooled:.3f}"
    )
    firsts = ", ".join(
        f"{'with' if record else 'without'} {statistics.median(first[record]):.3f}" for record in first if first[record]
    )
    print(
        f"records cost {1e3 * (on - off):+.2f} ms per step (median with - median without); ratio when measured first "
        f"in its pair: {firsts}"
    )
    if all(clocks.values()) and None not in clocks["loop"] + clocks["floor"]:
        print(
            f"mean SM clock during loop runs {spread(clocks['loop'], 1, 0)} MHz, during floor runs "
            f"{spread(clocks['floor'], 1, 0)} MHz (min/med/max)"
        )


@torch.inference_mode()
def first_run(target_model, draft, device: str, context: int, new_tokens: int) -> None:
    """The first live-loop calls of a process (records off, then on) against the same calls repeated: the
    extra time of a first call is the warm-up every command pays once; per-step times say where it goes
    (all in the first steps: one-off initialisation; spread over the steps: work repeated per new shape)."""
    k = BLOCK_SIZE - 1
    target = TargetModel(target_model, draft.hidden_state_indices)
    proposer = DFlashProposer(draft, target)
    prompt = torch.randint(0, target_model.config.vocab_size - 2, (context,), device=device)

    def call(record: bool, tokens: torch.Tensor = prompt):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = speculative_generate(target, proposer, tokens, k=k, max_new_tokens=new_tokens, record_tokens=record)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started, result

    print(
        f"\nfirst calls of this process: context {context}, {new_tokens} new tokens, K={k}, attention backends "
        f"{attention.ENGINE_SDPA_BACKENDS}"
    )
    print(f"{'':34}{'whole s':>9}{'steps':>7}{'ms/step':>9}{'first 3 steps ms':>26}{'rest: median step ms':>22}")
    longer = torch.cat([prompt, prompt[:37]])  # a request of another length: every step meets new shapes
    for label, record, tokens in (
        ("first call, records off", False, prompt),
        ("second call, records off", False, prompt),
        ("first call, records on", True, prompt),
        ("second call, records on", True, prompt),
        (f"records on, new length {len(longer)}", True, longer),
    ):
        seconds, result = call(record, tokens)
        step_ms = [1e3 * (s.draft_time_s + s.verify_time_s) for s in result.steps]
        head = ", ".join(f"{ms:.0f}" for ms in step_ms[:3])
        rest = statistics.median(step_ms[3:]) if len(step_ms) > 3 else float("nan")
        print(
            f"{label:34}{seconds:9.2f}{len(result.steps):7d}{1e3 * seconds / max(1, len(result.steps)):9.1f}"
            f"{head:>26}{rest:22.1f}"
        )


@torch.inference_mode()
def official_vs_ours(
    target_model, draft, device: str, dtype: torch.dtype, context: int, new_tokens: int, repeats: int
) -> None:
    """Time per step of the official ``dflash_generate`` and of our live loop (records off, the official
    end-of-request convention) on the same weights and prompt; each call includes its prefill."""
    import dflash.model as official

    if device != "cuda":
        official._cuda_time = time.perf_counter  # its stats timer synchronises CUDA (the --tiny smoke run)
    k = BLOCK_SIZE - 1
    with tempfile.TemporaryDirectory() as scratch:
        save_dflash_draft(draft, Path(scratch) / "draft")
        theirs = official.DFlashDraftModel.from_pretrained(Path(scratch) / "draft", dtype=dtype).to(device).eval()
        ours = load_dflash_draft(Path(scratch) / "draft", dtype=str(dtype).removeprefix("torch."), device=device)
    target = TargetModel(target_model, ours.hidden_state_indices)
    proposer = DFlashProposer(ours, target)
    prompt = torch.randint(0, target_model.config.vocab_size - 2, (context,), device=device)
    clock = Clock(device)

    def run_ours():
        result = speculative_generate(
            target,
            proposer,
            prompt,
            k=k,
            max_new_tokens=new_tokens,
            record_tokens=False,
            convention=CONVENTIONS["official"],
        )
        return result.output_ids, len(result.steps)

    def run_theirs():
        stats = official.dflash_generate(
            theirs, target_model, prompt[None], new_tokens, None, block_size=BLOCK_SIZE, return_stats=True
        )
        return stats.output_ids[0, context:].tolist(), len(stats.acceptance_lengths)

    loops = {"ours": run_ours, "official": run_theirs}
    outputs = {name: fn() for name, fn in loops.items()}  # warm-up, twice: every shape of the measured runs
    outputs = {name: fn() for name, fn in loops.items()}
    per_step: dict[str, list[float]] = {name: [] for name in loops}
    ratios: list[float] = []  # official / ours per round: paired, so a slow spell of the machine cancels
    started = time.perf_counter()
    for r in range(max(repeats, MIN_ROUNDS) * 10):
        if r >= max(repeats, MIN_ROUNDS) and (
            relative_half_width(ratios) <= TARGET_RELATIVE_HALF_WIDTH
            or time.perf_counter() - started > OFFICIAL_BUDGET_S
        ):
            break
        for name in ("ours", "official") if r % 2 == 0 else ("official", "ours"):
            seconds, (_, steps) = clock.time(loops[name])
            per_step[name].append(seconds / steps)
        ratios.append(per_step["official"][-1] / per_step["ours"][-1])
    ours_ids, theirs_ids = outputs["ours"][0], outputs["official"][0][: len(outputs["ours"][0])]
    parted = next((i for i, (a, b) in enumerate(zip(ours_ids, theirs_ids)) if a != b), None)
    # in bfloat16 the two loops' attention kernels differ (ours: FlashAttention; theirs: torch's choice, cuDNN on
    # an H100/H200), so random weights' near ties may go either way: where they part is printed, not hidden
    agreement = "equal" if parted is None and len(ours_ids) == len(theirs_ids) else f"part at token {parted}"
    print(
        f"\nlive loop vs the official dflash_generate: context {context}, {new_tokens} new tokens, block "
        f"{BLOCK_SIZE}, records off, {len(ratios)} paired rounds "
        "(order alternated, until the ratio's interval is within "
        f"+-{TARGET_RELATIVE_HALF_WIDTH:.0%} or {OFFICIAL_BUDGET_S:g} s), prefill included; outputs "
        f"{agreement}; steps ours {outputs['ours'][1]}, official {outputs['official'][1]}"
    )
    for name, values in per_step.items():
        print(f"  {name:10} ms/step min/med/max {spread(values, 1e3)}")
    ratio, low, high = median_interval(ratios)
    print(
        f"  official / ours: {ratio:.2f}x [{low:.2f}, {high:.2f}] (median of the paired rounds' ratios, 95% interval)"
    )


def target_attention_flops(config, length: int) -> float:
    """Causal attention FLOPs of one pass over ``length`` tokens, layer by layer: a full layer sees every
    earlier key, a sliding one at most its window, a gated delta net a state of key x value per head."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    full = 4 * config.num_attention_heads * config.head_dim
    flops = 0.0
    for kind in kinds:
        if kind == "linear_attention":  # state update and read-out: ~2 multiply-adds per state entry and token
            flops += (
                4 * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * length
            )
        elif kind == "sliding_attention":
            flops += full * sum(min(i + 1, config.sliding_window) for i in range(length))
        else:
            flops += full * length * (length + 1) / 2
    return flops


def teacher_flops(target_model, draft, prompt_len: int, n_out: int, k: int) -> dict[str, float]:
    """Matrix FLOPs of one teacher-forced pass (2 per multiply-add), counted from the shapes. A MoE's
    expert weights ([experts, ...] tensors) count for the share of experts each token is routed to."""
    tc, dc = target_model.config, draft.config
    length = prompt_len + n_out
    anchors = n_out - 1
    head = tc.hidden_size * tc.vocab_size
    routed = getattr(tc, "num_experts_per_tok", 1) / getattr(
        tc, "num_local_experts", getattr(tc, "num_experts", 1) or 1
    )
    t_linear = sum(
        p.numel() * (1 if p.dim() == 2 else routed) for p in target_model.model.layers.parameters() if p.dim() >= 2
    )
    t_attention = target_attention_flops(tc, length)
    kv = dc.num_key_value_heads * dc.head_dim
    fc = draft.fc.weight.numel()
    per_layer = sum(p.numel() for p in draft.layers[0].parameters() if p.dim() == 2)
    context_per_layer = 2 * dc.hidden_size * kv  # k_proj, v_proj of the context rows
    rows = anchors * (k + 1)
    # block row of anchor a sees a context keys (positions < a) and the k + 1 rows of its own block
    seen = sum(prompt_len + a + k + 1 for a in range(anchors)) * (k + 1)
    d_attention = dc.num_hidden_layers * 4 * dc.num_attention_heads * dc.head_dim * seen
    return {
        "target": 2 * (t_linear + head) * length + t_attention,
        "draft context": 2 * (fc + dc.num_hidden_layers * context_per_layer) * length,
        "draft blocks": 2 * dc.num_hidden_layers * per_layer * rows + d_attention,
        "draft lm_head": 2 * head * anchors * k,
    }


@torch.inference_mode()
def teacher_throughput(
    target_model, draft, device: str, clock: Clock, length: int, repeats: int, peaks: dict[str, float]
) -> tuple:
    target = TargetModel(target_model, draft.hidden_state_indices)
    proposer = DFlashProposer(draft, target)
    ids = torch.randint(0, target_model.config.vocab_size - 2, (length,)).tolist()
    prompt_len = 64
    sequence = TeacherSequence(ids[:prompt_len], ids[prompt_len:])
    k = BLOCK_SIZE - 1

    def replay(record: bool):
        return slot_table(target, proposer, sequence, k, record_divergence=record)

    def target_only():
        target.reset()
        target.forward(torch.tensor(ids, device=device), logits_from=prompt_len)
        target.reset()

    for record in (False, True):  # warm-up with the measured sequence itself: every shape
        _, target_pass = replay(record)
    plain = [clock.time(lambda: replay(False))[0] for _ in range(repeats)]
    with sdpa_kernel(attention.ENGINE_SDPA_BACKENDS or list(SDPBackend)):  # the live loop's kernels, warmed
        replay(False)
        live_loop_backends = [clock.time(lambda: replay(False))[0] for _ in range(repeats)]
    # records as a small run computes them (eager, in blocks: compiling has not paid yet), then as a long one does
    fused = divergence._fused_columns()
    recorded_eager = [clock.time(lambda: replay(True))[0] for _ in range(max(2, repeats // 2))]
    eager_label = "compiled" if fused.wanted(0) else "eager blocks"
    fused.compile_after = 0
    replay(True)  # the compile
    recorded = [clock.time(lambda: replay(True))[0] for _ in range(max(2, repeats // 2))]
    target_s = [clock.time(target_only)[0] for _ in range(repeats)]
    draft_s = [
        clock.time(lambda: slot_table(target, proposer, sequence, k, record_divergence=False, target_pass=target_pass))[
            0
        ]
        for _ in range(repeats)
    ]
    flops = teacher_flops(target_model, draft, prompt_len, len(sequence.output_ids), k)
    total = sum(flops.values())
    draft_flops = total - flops["target"]
    anchors = len(sequence.output_ids) - 1

    def share(f: float, seconds: list[float]) -> str:
        rate = f / statistics.median(seconds) / 1e12
        return f"{rate:.0f} TFLOP/s = " + ", ".join(
            f"{100 * rate / peak:.1f}% of {name} {peak:.0f}" for name, peak in peaks.items()
        )

    print(
        f"\nteacher-forced replay: {length} tokens ({anchors} anchors x K={k}); {total / 1e12:.1f} TFLOP counted "
        "(" + ", ".join(f"{name} {f / 1e12:.1f}" for name, f in flops.items()) + ")"
    )
    print(
        f"  whole pass, ms min/med/max      {spread(plain, 1e3, 1):>22}  {anchors / statistics.median(plain):,.0f} "
        f"analysed tokens/s; {share(total, plain)}"
    )
    print(
        f"  without cuDNN (live loop's)     {spread(live_loop_backends, 1e3, 1):>22}  "
        f"{share(total, live_loop_backends)}"
    )
    for label, times in ((f"records, {eager_label}", recorded_eager), ("records, compiled", recorded)):
        print(
            f"  with {label:27}{spread(times, 1e3, 1):>22}  (records "
            f"x{statistics.median(times) / statistics.median(plain):.2f})"
        )
    print(f"  target forward alone            {spread(target_s, 1e3, 1):>22}  {share(flops['target'], target_s)}")
    print(f"  draft passes alone              {spread(draft_s, 1e3, 1):>22}  {share(draft_flops, draft_s)}")
    return target, proposer, sequence, k


def kernel_family(name: str) -> str:
    lowered = name.lower()
    if any(word in lowered for word in ("fmha", "flash", "attention", "attn", "cudnn")):
        return "attention"
    if any(word in lowered for word in ("gemm", "xmma", "cutlass", "nvjet", "wgmma", "sm90")):
        return "matrix (gemm)"
    if any(word in lowered for word in ("reduce", "argmax", "softmax", "norm")):
        return "reductions"
    if any(word in lowered for word in ("copy", "cat", "index", "gather", "scatter", "fill")):
        return "copies / indexing"
    return "elementwise / other"


@torch.inference_mode()
def profile_teacher(target, proposer, sequence, k: int, device: str, out: Path | None) -> None:
    """Kernel time by family for one teacher-forced pass, and the GPU's busy share of its wall time."""
    if device != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        slot_table(target, proposer, sequence, k, record_divergence=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    kernels: dict[str, tuple[float, int]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            spent, count = kernels.get(event.name, (0.0, 0))
            kernels[event.name] = (spent + event.device_time_total, count + 1)  # microseconds
    busy = sum(spent for spent, _ in kernels.values()) / 1e6
    families: dict[str, float] = {}
    for name, (spent, _) in kernels.items():
        families[kernel_family(name)] = families.get(kernel_family(name), 0.0) + spent / 1e6
    print(
        f"\nprofile of one teacher-forced pass (profiler on): wall {wall * 1e3:.1f} ms, kernels {busy * 1e3:.1f} ms "
        f"({100 * busy / wall:.0f}% busy; the rest is launch / sync overhead)"
    )
    for family, spent in sorted(families.items(), key=lambda item: -item[1]):
        print(f"  {family:24}{spent * 1e3:9.1f} ms {100 * spent / busy:5.1f}%")
    print("  top kernels:")
    for name, (spent, count) in sorted(kernels.items(), key=lambda item: -item[1][0])[:10]:
        print(f"  {spent / 1e3:9.1f} ms {count:6d}x  {name[:110]}")
    if out is not None:
        (out / "teacher_profile.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--target", choices=sorted(TARGETS), default="qwen3-8b", help="the target's shape")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="nominal bf16 dense matrix rate of the GPU")
    parser.add_argument("--out", type=Path, default=None, help="folder for the full profile table")
    parser.add_argument(
        "--official", action="store_true", help="also time the official dflash_generate loop (PyPI dflash)"
    )
    parser.add_argument(
        "--first-calls",
        action="store_true",
        help="section 0 only (run it twice, in two processes, to see what torch's on-disk compile "
        "caches save a command's second run)",
    )
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    clock = Clock(device)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}; before: {gpu_state(device)}")
    target_model, draft = build(args.target, args.tiny, device, dtype)
    parameters = sum(p.numel() for p in target_model.parameters())
    print(
        f"target {args.target}{' (tiny)' if args.tiny else ''}: {parameters / 1e9:.2f}B parameters, attention "
        f"{target_model.config._attn_implementation}, draft taps layers {list(draft.config.target_layer_ids)}"
    )
    first_run(target_model, draft, device, context=128 if args.tiny else 1024, new_tokens=32 if args.tiny else 96)
    if args.first_calls:
        return
    measured = matmul_rate(device, clock)
    print(f"measured matrix rate: {measured:.0f} TFLOP/s ({'bf16 8192^3' if device == 'cuda' else 'fp32 512^3'})")
    live_step_vs_floor(
        target_model,
        draft,
        device,
        clock,
        context=128 if args.tiny else 1024,
        new_tokens=32 if args.tiny else 64,
        repeats=args.repeats,
    )
    peaks = {"nominal": args.peak_tflops, "measured": measured}
    replay = teacher_throughput(
        target_model, draft, device, clock, length=256 if args.tiny else 2112, repeats=args.repeats, peaks=peaks
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    profile_teacher(*replay, device=device, out=args.out)
    if args.official:
        official_vs_ours(
            target_model,
            draft,
            device,
            dtype,
            context=128 if args.tiny else 1024,
            new_tokens=32 if args.tiny else 96,
            repeats=args.repeats,
        )
    print(f"\nafter: {gpu_state(device)}")


if __name__ == "__main__":
    main()
