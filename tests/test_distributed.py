"""Many processes (torchrun, gloo) and a target placed over several devices.

The end-to-end test runs ``sweep --devices cpu,cpu`` on the tiny saved models: the CLI launches torchrun
with two ranks, each replays its share, rank 0 merges; the run directory must hold exactly what one
process writes for the same requests (tables row for row, summary, sweep and recommendation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from dflash_doctor.models.placement import placement_of
from dflash_doctor.replay.sharding import expected_work, merge_replays, parse_devices, shard_requests
from dflash_doctor.rundir.writer import PARTS_DIR
from dflash_doctor.errors import UsageError
from dflash_doctor.replay.stream import Replay
from dflash_doctor.rundir.load import load_run
from dflash_doctor.inputs.workloads import Request
from cli_helpers import assert_usage_error, invoke, pair_args
from tiny_models import tiny_target, write_workload

ROOT = Path(__file__).resolve().parents[1]


def test_shares_cover_every_request_once_and_balance_expected_work_not_counts():
    work = [8, 1, 8, 1, 5, 3, 2, 2]
    shares = shard_requests(work, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(work)))
    assert all(share == sorted(share) for share in shares)  # input order
    loads = [sum(work[i] for i in share) for share in shares]
    assert loads == [15, 15]  # dealt by count (every other request) the ranks would carry 23 and 7
    assert shares == shard_requests(list(work), 2)  # deterministic
    assert shard_requests(work, 3) == [
        [0, 6],
        [2, 7],
        [1, 3, 4, 5],
    ]  # 8 | 8 | 5 + 3, then each small one to the lightest: 10 each


def test_expected_work_counts_prompt_tokens_once_and_new_tokens_at_every_k():
    words = len  # a tokenizer stand-in: one token per character
    prompt = Request(id="p", prompt="abcd")
    chat = Request(
        id="c",
        messages=(
            {"role": "user", "content": "ab"},
            {"role": "assistant", "content": "cd"},
            {"role": "user", "content": "e"},
        ),
        max_new_tokens=3,
    )
    assert expected_work(prompt, words, max_new_tokens=10, k=4) == 4 + 10 * 5
    assert expected_work(chat, words, max_new_tokens=10, k=4) == len("ab\ncd\ne") + 3 * 5  # its own max_new_tokens


def test_merged_replay_keeps_every_ranks_full_block_matches():
    # the layer-offset probe reads offset 0 from them; a merge that drops them makes rank 0 draft it again
    first = Replay(full_block_matches={"math-0": np.array([[1, 0]])})
    second = Replay(full_block_matches={"code-0": np.array([[0, 1]]), "chat-0#t1": np.array([[1, 1]])})
    merged = merge_replays([first, second], [])
    assert set(merged.full_block_matches) == {"math-0", "code-0", "chat-0#t1"}
    assert merged.full_block_matches["code-0"] is second.full_block_matches["code-0"]


def test_placement_keeps_embeddings_and_head_on_the_first_device_and_splits_the_layers():
    with torch.device("meta"):
        model = tiny_target(layers=6)
    placement = placement_of(model, ["cuda:0", "cuda:1"])
    layers = [placement[f"model.layers.{i}"] for i in range(6)]
    assert layers == sorted(layers) and set(layers) == {"cuda:0", "cuda:1"}  # contiguous runs on both devices
    assert placement["model.embed_tokens"] == placement["lm_head"] == placement["model.norm"] == "cuda:0"
    placed = {name for name in placement}
    assert all(any(p == name or p.startswith(f"{name}.") for name in placed) for p, _ in model.named_parameters())


def test_devices_entry_that_is_not_a_device_is_refused():
    assert parse_devices(["cuda:0+cuda:1", "cpu"]) == ["cuda:0,cuda:1", "cpu"]
    with pytest.raises(UsageError, match="--devices entry 'gpu0'"):
        parse_devices(["gpu0"])


def _frames_equal(left: pd.DataFrame, right: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(left.reset_index(drop=True), right.reset_index(drop=True))


def test_two_gloo_ranks_write_the_run_one_process_writes(tiny_dir, tmp_path):  # noqa: F811
    workload = write_workload(tmp_path / "workload.jsonl", per_class=3)
    with workload.open("a", encoding="utf-8") as file:  # a two-turn request: its turns stay together and in order
        file.write(
            json.dumps(
                {
                    "id": "chat-two-turns",
                    "class": "chat",
                    "messages": [
                        {"role": "user", "content": "w4 w5"},
                        {"role": "assistant", "content": "w6"},
                        {"role": "user", "content": "w7"},
                        {"role": "user", "content": "w8 w9"},
                    ],
                }
            )
            + "\n"
        )
    profile = tmp_path / "costs.json"  # fixed step costs: measured ones differ between any two runs
    profile.write_text(
        json.dumps({"t_decode_s": 0.01, "t_verify_s": 0.011, "t_draft_s": {str(k): 0.002 * k for k in range(1, 6)}})
    )
    args = [*pair_args(tiny_dir, tiny_dir / "dflash"), "--workload", workload, "--cost-profile", profile]
    single = tmp_path / "single"
    # Both runs with one thread per process: the float sums behind the token columns (KL, margins) depend on
    # the thread count, so equality to the last bit needs the same arithmetic on both sides.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # the sharded run without --out: the launcher names one folder for both ranks (runs/sweep-<second>)
    for extra in (["--out", str(single)], ["--devices", "cpu,cpu"]):
        ran = subprocess.run(
            [sys.executable, "-m", "dflash_doctor", "sweep", *map(str, args), *extra],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert ran.returncode == 0, ran.stderr[-3000:]
    (sharded,) = (tmp_path / "runs").iterdir()
    assert sharded.name.startswith("sweep-") and not (sharded / PARTS_DIR).exists()
    one, two = load_run(single), load_run(sharded)
    assert len(one.requests) == 10 + 1 and len(one.tokens) > 0
    _frames_equal(one.requests, two.requests)
    _frames_equal(one.steps, two.steps)
    _frames_equal(one.tokens, two.tokens)
    for section in ("summary", "recommendation"):
        assert two.meta[section] == one.meta[section], section


def test_torchrun_ranks_without_out_are_refused_before_any_work(tiny_dir, tmp_path, monkeypatch):
    """Each rank would otherwise name a folder of its own; --devices names one for them (above)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = invoke("sweep", *pair_args(tiny_dir, tiny_dir / "dflash"))
    assert_usage_error(result, "torchrun ranks must write one run directory", "--out DIR")
    assert not (tmp_path / "runs").exists()
