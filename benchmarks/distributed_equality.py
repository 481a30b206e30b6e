"""The distributed paths of the real CLI on tiny saved models, against one process.

Runs ``sweep`` three ways on the same requests and compares the run directories:
one process on the first device; ``--devices A,B`` (the torchrun launcher, one rank per device); and
``--device A,B`` (one process, the target's layers placed over both devices by ``device_map``).
Prints, for each, whether the tables and the summary equal the one-process run's (data parallel must
be identical; placement may differ in the last bits of float32 on GPUs, so it prints the largest gap).

Usage: python benchmarks/distributed_equality.py --devices cuda:0,cuda:1   (or cpu,cpu for a smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "tests")
)  # the tests' helpers, imported by bare name there too

from dflash_doctor.models.loading import save_dflash_draft  # noqa: E402
from dflash_doctor.rundir.load import load_run  # noqa: E402
from tiny_models import tiny_dflash, tiny_target, tiny_tokenizer, write_workload  # noqa: E402


def sweep(root: Path, out: Path, *flags: str) -> float:
    args = [
        "--target",
        root / "target",
        "--draft",
        root / "dflash",
        "--workload",
        root / "workload.jsonl",
        "--max-new-tokens",
        "16",
        "--cost-profile",
        root / "costs.json",
        "--out",
        out,
        *flags,
    ]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "dflash_doctor", "sweep", *map(str, args)], capture_output=True, text=True
    )
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-4000:])
        raise SystemExit(f"sweep {' '.join(flags)} failed ({done.returncode})")
    return time.perf_counter() - start


def compare(one: Path, other: Path) -> str:
    a, b = load_run(one), load_run(other)
    identical = all(
        getattr(a, t).reset_index(drop=True).equals(getattr(b, t).reset_index(drop=True))
        for t in ("requests", "steps", "tokens")
    )
    identical = (
        identical and a.meta["summary"] == b.meta["summary"] and a.meta["recommendation"] == b.meta["recommendation"]
    )
    same_tokens = a.requests["output_token_ids"].map(list).tolist() == b.requests["output_token_ids"].map(list).tolist()
    gap = (
        float(
            np.nanmax(np.abs(a.tokens["target_prob_of_draft"].to_numpy() - b.tokens["target_prob_of_draft"].to_numpy()))
        )
        if same_tokens
        else float("nan")
    )
    return (
        f"identical={identical} same continuations={same_tokens} largest "
        f"target_prob_of_draft gap={gap:.2e} ({len(a.requests)} turns)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", default="cuda:0,cuda:1")
    args = parser.parse_args()
    first = args.devices.split(",")[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = tiny_target(hidden=64, layers=6)
        target.save_pretrained(root / "target")
        tiny_tokenizer().save_pretrained(root / "target")
        save_dflash_draft(tiny_dflash(target, block_size=6, layer_ids=(0, 3, 5)), root / "dflash")
        write_workload(root / "workload.jsonl", per_class=6)
        (root / "costs.json").write_text(
            json.dumps({"t_decode_s": 0.01, "t_verify_s": 0.011, "t_draft_s": {str(k): 0.002 * k for k in range(1, 6)}})
        )
        seconds = sweep(root, root / "single", "--device", first)
        print(f"one process on {first}: {seconds:.1f} s")
        seconds = sweep(root, root / "ranks", "--devices", args.devices)
        print(
            f"--devices {args.devices} (torchrun, one rank each): {seconds:.1f} s; "
            f"vs one process: {compare(root / 'single', root / 'ranks')}"
        )
        seconds = sweep(root, root / "placed", "--device", args.devices)
        print(
            f"--device {args.devices} (one target placed over both): {seconds:.1f} s; "
            f"vs one process: {compare(root / 'single', root / 'placed')}"
        )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
