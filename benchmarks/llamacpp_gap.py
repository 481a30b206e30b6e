"""The acceptance gap between engines, by cause: tau per class of several `check` runs on the same workload.

    .venv/bin/python benchmarks/llamacpp_gap.py embedded=runs/embedded vllm=runs/vllm llama-q4_1=runs/llama ...

The first run is the reference. For each run: tau (bonus included; every engine's figures converted to
vLLM's definition, docs/definitions.md) with its 95% bootstrap interval per class, the mean draft length
(draft tokens / verify steps: n-max and the tail convention), and against the reference, turn by turn:
the share of turns whose prompt has the same number of tokens (chat template and tokeniser) and whose
output text is identical (same greedy text: same target numerics, or kernels that part only at near-ties).
docs/llamacpp.md gives the commands that wrote the runs and reads the table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_doctor.rundir.load import load_run  # noqa: E402


def _tau(metrics: dict) -> str:
    low, high = metrics.get("mean_acceptance_length_ci") or (float("nan"), float("nan"))
    return f"{metrics['mean_acceptance_length']:.2f} [{low:.2f}, {high:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="NAME=RUN_DIR, the reference first")
    args = parser.parse_args()
    runs = {name: load_run(Path(path)) for name, _, path in (item.partition("=") for item in args.runs)}
    reference = next(iter(runs.values())).requests.set_index("request_id")
    classes = sorted(next(iter(runs.values())).meta["summary"]["by_class"])
    print(
        "| run | "
        + " | ".join(["overall", *classes])
        + " | draft tokens / step | same prompt length | same output text |"
    )
    print("|---" * (len(classes) + 5) + "|")
    for name, run in runs.items():
        summary = run.meta["summary"]
        taus = [_tau(summary["overall"]), *(_tau(summary["by_class"][c]) for c in classes)]
        requests = run.requests.set_index("request_id")
        shared = requests.index.intersection(reference.index)
        same_prompt = (requests.loc[shared, "prompt_num_tokens"] == reference.loc[shared, "prompt_num_tokens"]).mean()
        same_text = (requests.loc[shared, "output_text"] == reference.loc[shared, "output_text"]).mean()
        per_step = requests["num_draft_tokens"].sum() / requests["num_drafts"].sum()
        print(f"| {name} | " + " | ".join(taus) + f" | {per_step:.1f} | {same_prompt:.0%} | {same_text:.0%} |")


if __name__ == "__main__":
    main()
