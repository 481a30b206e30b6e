"""Time of the deviation analysis ("Why rejected") on a synthetic run of about 1M drafted tokens.

Builds the tokens / steps / requests tables with numpy (no model), writes them as a run's Parquet
files, and prints side by side: reading the tables (what every view pays anyway), the deviation
analysis of one run (report section, terminal summary, dashboard page) and the pattern growth between
two runs (``compare``). Not a test: nothing asserts; it should take seconds, not minutes.

    python benchmarks/deviations.py [--num-tokens 1000000] [--k 8] [--num-requests 2000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_doctor.stats import deviations
from dflash_doctor.rundir.tables import REQUESTS_SCHEMA, STEPS_SCHEMA, TOKENS_SCHEMA

CLASSES = np.array(["chat", "code", "math", "multilingual"])
CATEGORY_NAMES = np.array(list(deviations.CATEGORIES))
VOCAB_SIZE = 50_000


def synthetic_tables(num_tokens: int, k: int, num_requests: int, seed: int, special_boost: float = 0.0):
    """Steps of K drafted slots with geometric acceptance; special tokens rejected more when boosted."""
    rng = np.random.default_rng(seed)
    num_steps = num_tokens // k
    request = np.sort(rng.integers(0, num_requests, num_steps))
    step = np.arange(num_steps) - np.searchsorted(request, request)  # index within its request
    category = rng.choice(len(CATEGORY_NAMES), size=(num_steps, k), p=[0.05, 0.15, 0.08, 0.15, 0.07, 0.3, 0.18, 0.02])
    reject_p = np.where(category == 0, 0.3 + special_boost, 0.2)
    rejected = rng.random((num_steps, k)) < reject_p
    num_accepted = np.where(rejected.any(axis=1), rejected.argmax(axis=1), k)
    slot = np.arange(k)[None, :]
    target = rng.integers(0, VOCAB_SIZE, (num_steps, k))
    draft = np.where(
        slot == num_accepted[:, None], (target + 1 + rng.integers(0, 50, (num_steps, 1))) % VOCAB_SIZE, target
    )
    position = np.zeros(num_steps, dtype=np.int64)
    advance = num_accepted + 1
    cumulative = np.cumsum(advance) - advance
    position = 1 + cumulative - cumulative[np.searchsorted(request, request)]
    request_ids = np.char.add("req-", np.arange(num_requests).astype(str))
    cls = CLASSES[np.arange(num_requests) % len(CLASSES)]
    steps = pd.DataFrame(
        {
            "request_id": request_ids[request],
            "class": cls[request],
            "step": step.astype(np.int32),
            "position": position.astype(np.int32),
            "k": np.int16(k),
            "num_drafted": np.int16(k),
            "num_accepted": num_accepted.astype(np.int16),
            "bonus_token": rng.integers(0, VOCAB_SIZE, num_steps).astype(np.int32),
            "draft_time_s": 0.004,
            "verify_time_s": 0.02,
        }
    )
    flat = lambda a: np.asarray(a).reshape(-1)  # noqa: E731  [S, K] -> [S*K], step-major like the writer
    rows = num_steps * k
    texts = np.char.add("t", (np.arange(VOCAB_SIZE) % 997).astype(str))
    tokens = pd.DataFrame(
        {
            "request_id": np.repeat(steps["request_id"].to_numpy(), k),
            "class": np.repeat(steps["class"].to_numpy(), k),
            "step": np.repeat(step, k).astype(np.int32),
            "position": flat(position[:, None] + slot).astype(np.int32),
            "offset": np.tile(np.arange(1, k + 1), num_steps).astype(np.int16),
            "draft_token": flat(draft).astype(np.int32),
            "target_token": flat(target).astype(np.int32),
            "draft_text": texts[flat(draft) % VOCAB_SIZE],
            "target_text": texts[flat(target) % VOCAB_SIZE],
            "accepted": flat(slot < num_accepted[:, None]),
            "target_prob_of_draft": rng.random(rows, dtype=np.float32),
            "draft_prob_of_target": rng.random(rows, dtype=np.float32),
            "target_rank_in_draft": rng.integers(0, 10, rows).astype(np.int32),
            "kl_target_draft": rng.random(rows, dtype=np.float32),
            "total_variation": rng.random(rows, dtype=np.float32),
            "target_entropy": (rng.random(rows, dtype=np.float32) * 3),
            "target_top1_margin": rng.random(rows, dtype=np.float32),
            "draft_topk_ids": None,
            "target_topk_ids": None,
            "target_category": CATEGORY_NAMES[flat(category)],
        }
    )
    last = steps.groupby("request_id").agg(end=("position", "max"))
    requests = pd.DataFrame(
        {
            "request_id": request_ids,
            "class": cls,
            "subclass": None,
            "turn": (np.arange(num_requests) % 2).astype(np.int16),
            "prompt_num_tokens": rng.integers(20, 3000, num_requests).astype(np.int32),
            "output_token_ids": [list(range(int(last["end"].get(r, 0)) + k + 2)) for r in request_ids],
            "output_text": "",
            "num_output_tokens": 0,
            "num_steps": 0,
            "num_drafts": 0,
            "num_draft_tokens": 0,
            "num_accepted_tokens": 0,
            "tau": 1.0,
            "stop_reason": "max_new_tokens",
            "wall_time_s": 0.0,
        }
    )
    return tokens, steps, requests


def write(folder: Path, tables) -> None:
    folder.mkdir(parents=True)
    for name, frame, schema in zip(
        ("tokens", "steps", "requests"), tables, (TOKENS_SCHEMA, STEPS_SCHEMA, REQUESTS_SCHEMA)
    ):
        pq.write_table(pa.Table.from_pandas(frame, schema=schema, preserve_index=False), folder / f"{name}.parquet")


def read(folder: Path):
    return tuple(pq.read_table(folder / f"{name}.parquet").to_pandas() for name in ("tokens", "steps", "requests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tokens", type=int, default=1_000_000)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        base_dir, new_dir = Path(scratch) / "base", Path(scratch) / "new"
        write(base_dir, synthetic_tables(args.num_tokens, args.k, args.num_requests, seed=0))
        write(new_dir, synthetic_tables(args.num_tokens, args.k, args.num_requests, seed=1, special_boost=0.3))

        start = time.perf_counter()
        tokens, steps, requests = read(base_dir)
        read_s = time.perf_counter() - start
        start = time.perf_counter()
        tables = deviations.deviation_tables(tokens, steps, requests)
        analysis = deviations.analyze(tables)
        analyze_s = time.perf_counter() - start
        new_tables = deviations.deviation_tables(*read(new_dir))
        start = time.perf_counter()
        grown = deviations.grown_patterns(tables, new_tables)
        compare_s = time.perf_counter() - start

    print(
        f"{len(tokens):,} drafted tokens, {len(steps):,} steps, "
        f"{len(requests):,} requests, {len(analysis.by_class)} classes"
    )
    print(f"{'read the three tables':<40}{read_s:8.2f} s   1.00x")
    print(f"{'deviation analysis (all classes)':<40}{analyze_s:8.2f} s   {analyze_s / read_s:.2f}x of the read")
    print(f"{'patterns that grew (compare, 2 runs)':<40}{compare_s:8.2f} s   {compare_s / read_s:.2f}x of the read")
    print(
        f"top grown pattern: {grown[0]['class']} {grown[0]['kind']} "
        f"{grown[0]['pattern']} (+{grown[0]['growth']:.2f} lost tokens per draft)"
    )


if __name__ == "__main__":
    main()
