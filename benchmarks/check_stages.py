"""Where the default `dflash-doctor check` spends its time, by stage; side by side with another revision.

    .venv/bin/python benchmarks/check_stages.py                      # this tree: stage table
    .venv/bin/python benchmarks/check_stages.py --baseline main   # that revision and this tree, alternating
    .venv/bin/python benchmarks/check_stages.py -- --max-requests 6  # a smaller check (flags after --)
    .venv/bin/python benchmarks/check_stages.py --baseline main --keep /tmp/runs  # keep the run directories

Each measurement is one whole default `check` (demo pair, demo workload, every K, probes, checks, reports;
the converted GGUF cached) in a fresh subprocess, with the pipeline's functions wrapped by timers. A
stage's time is exclusive: a timed function called inside another is counted once, under its own name,
nested below its caller. The machine is shared, so a comparison alternates baseline and candidate
(``--rounds``) and reports the ratio per round as well as absolute times.

A revision is measured from its own source: ``git archive`` into a temporary folder laid out as the
installed package (the repo's ``engine/``, ``checks/`` and ``app/`` inside ``dflash_doctor/``, as
pyproject.toml maps them), put first on ``PYTHONPATH``; the current virtual environment provides the
dependencies.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (module, attribute, stage label). Whatever a revision lacks is skipped, so one list serves old and new
# code; a stage's row shows where it was called from.
TIMED = [
    ("dflash_doctor.models.pair", "load_pair", "load models"),
    ("dflash_doctor.engine.batched", "generate_greedy_batch", "target decoding (batched greedy answers)"),
    ("dflash_doctor.engine.teacher", "slot_table", "teacher-forced passes (slot_table)"),
    ("dflash_doctor.engine.target.TargetModel", "forward", "target forward"),
    ("dflash_doctor.engine.proposers.dflash.DFlashProposer", "slot_logits", "draft block pass + lm_head"),
    ("dflash_doctor.engine.proposers.dflash.DFlashProposer", "slot_scorer", "draft block pass (head on demand)"),
    ("dflash_doctor.engine.dflash_model.DFlashDraftModel", "teacher_scores", "draft lm_head"),
    ("dflash_doctor.engine.proposers.dflash.DFlashProposer", "prepare_teacher", "draft context K/V"),
    ("dflash_doctor.engine.divergence", "divergence_tensor", "per-token divergence columns"),
    ("dflash_doctor.engine.teacher", "token_rows", "per-token rows"),
    ("dflash_doctor.engine.teacher", "walk_schedule", "schedule walk"),
    ("dflash_doctor.replay.stream", "_rows", "row records (token text)"),
    ("dflash_doctor.rundir.writer.RunWriter", "flush", "journal writes"),
    ("dflash_doctor.rundir.writer.RunWriter", "close", "Parquet consolidation"),
    ("dflash_doctor.pipeline", "_summarize", "summary (bootstrap)"),
    ("dflash_doctor.models.pair.Pair", "measure_step_costs", "cost measurement"),
    ("dflash_doctor.stats.speedup", "build_sweep", "sweep table (bootstrap)"),
    ("dflash_doctor.replay.probes", "lossless_probe", "probe: lossless"),
    ("dflash_doctor.engine.live", "speculative_generate", "live speculative loop"),
    ("dflash_doctor.engine.live", "plain_generate", "plain decoding"),
    ("dflash_doctor.replay.probes", "layer_offset_probe", "probe: layer offset"),
    ("dflash_doctor.models.loading", "weights_fingerprint", "target weights fingerprint"),
    ("dflash_doctor.checks.base", "run_checks", "checks"),
    ("dflash_doctor.report", "render_reports", "report rendering"),
]


# ----------------------------------------------------------------------------- child: one timed check


def _clocks() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads)."""
    return time.perf_counter(), time.process_time()


class StageClock:
    """Exclusive wall and CPU time per call path (outermost timed caller first).

    CPU time is reported beside wall time because on a shared machine wall time mostly measures the
    neighbours; CPU time measures the work (it includes threads spinning while they wait for a core).
    """

    def __init__(self) -> None:
        self.stack: list[list] = []  # [label, start clocks, clocks spent in timed callees]
        self.seconds: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0.0, 0.0])

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.stack.append([label, _clocks(), [0.0, 0.0]])
            try:
                return fn(*args, **kwargs)
            finally:
                name, start, inner = self.stack.pop()
                spent = [now - then for now, then in zip(_clocks(), start)]
                path = tuple(frame[0] for frame in self.stack) + (name,)
                for i in range(2):
                    self.seconds[path][i] += spent[i] - inner[i]
                    if self.stack:
                        self.stack[-1][2][i] += spent[i]

        return timed


def _patch(clock: StageClock) -> None:
    """Wrap every TIMED function where it is defined and where it was imported by name."""
    import dflash_doctor  # noqa: F401 - the tree on PYTHONPATH

    for module_path, attr, label in TIMED:
        owner_path, _, class_name = module_path.rpartition(".")
        try:
            module = importlib.import_module(module_path)
            owner, is_class = module, False
        except ImportError:
            try:
                owner, is_class = getattr(importlib.import_module(owner_path), class_name), True
            except (ImportError, AttributeError):
                continue
        original = getattr(owner, attr, None)
        if original is None:
            continue
        timed = clock.wrap(label, original)
        setattr(owner, attr, timed)
        if not is_class:  # `from module import fn` copies elsewhere
            for other in list(sys.modules.values()):
                if (
                    getattr(other, "__name__", "").startswith("dflash_doctor")
                    and getattr(other, attr, None) is original
                ):
                    setattr(other, attr, timed)


def child(out_json: Path, check_args: list[str], run_dir: Path | None) -> None:
    clock = StageClock()
    _patch(clock)
    from typer.testing import CliRunner

    from dflash_doctor.cli import app

    with tempfile.TemporaryDirectory() as scratch:
        start = _clocks()
        result = CliRunner().invoke(app, ["check", *check_args, "--out", str(run_dir or Path(scratch) / "run")])
        total = [now - then for now, then in zip(_clocks(), start)]
    if result.exit_code not in (0, 1):
        raise SystemExit(f"check failed ({result.exit_code}): {result.output[-2000:]}")
    stages = [[list(path), wall, cpu] for path, (wall, cpu) in clock.seconds.items()]
    out_json.write_text(json.dumps({"total_s": total[0], "total_cpu_s": total[1], "stages": stages}))


# ----------------------------------------------------------------------------- parent


def stage_revision(revision: str, dest: Path) -> Path:
    """``revision``'s source laid out as the installed package (pyproject's package-dir), in ``dest``."""
    src = dest / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(src, filter="data")
    mapping = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    tree = dest / "tree"
    for package, folder in sorted(mapping.items(), key=lambda item: item[0].count(".")):
        target = tree.joinpath(*package.split("."))
        if not target.exists():
            shutil.copytree(src / folder, target)
    return tree


def measure(tree: Path | None, label: str, check_args: list[str], keep: Path | None) -> dict:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree) + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        print(f"measuring {label} ...", file=sys.stderr, flush=True)
        run_dir = ["--run-dir", str(keep / "".join(c if c.isalnum() else "-" for c in label))] if keep else []
        command = [sys.executable, __file__, "--child", out.name, *run_dir, "--", *check_args]
        subprocess.run(command, check=True, env=env, cwd=tempfile.gettempdir())
        return json.loads(Path(out.name).read_text())


def print_stages(label: str, result: dict) -> None:
    total, total_cpu = result["total_s"], result["total_cpu_s"]
    print(f"\n{label}: wall {total:.1f} s, CPU {total_cpu:.1f} s")
    print(f"{'stage (nested under its caller)':58s} {'wall s':>8s} {'share':>6s} {'CPU s':>8s} {'share':>6s}")
    timed = [0.0, 0.0]
    for path, wall, cpu in sorted(result["stages"], key=lambda item: item[0]):
        timed = [timed[0] + wall, timed[1] + cpu]
        print(
            f"{'  ' * (len(path) - 1) + path[-1]:58s} {wall:8.1f} {wall / total:6.1%} {cpu:8.1f} {cpu / total_cpu:6.1%}"
        )
    wall, cpu = total - timed[0], total_cpu - timed[1]
    print(
        f"{'other (CLI, workload, untimed code)':58s} {wall:8.1f} {wall / total:6.1%} {cpu:8.1f} {cpu / total_cpu:6.1%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a git revision to measure side by side with this tree")
    parser.add_argument("--rounds", type=int, default=1, help="baseline/candidate pairs, alternating")
    parser.add_argument("--keep", type=Path, help="keep each check's run directory here (to diff their report.json)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "check_args", nargs="*", help="after --: extra `check` flags (default: none, the default check)"
    )
    args = parser.parse_args()
    if args.child:
        child(Path(args.child), args.check_args, args.run_dir)
        return
    shown = " ".join(["check", *args.check_args])
    if not args.baseline:
        print_stages(f"this tree, `{shown}`", measure(None, "this tree", args.check_args, args.keep))
        return
    with tempfile.TemporaryDirectory() as scratch:
        tree = stage_revision(args.baseline, Path(scratch))
        pairs = [
            (
                measure(tree, f"{args.baseline} (round {r + 1})", args.check_args, args.keep),
                measure(None, f"this tree (round {r + 1})", args.check_args, args.keep),
            )
            for r in range(args.rounds)
        ]
    for index, (base, new) in enumerate(pairs, 1):
        print_stages(f"baseline {args.baseline}, round {index}, `{shown}`", base)
        print_stages(f"this tree, round {index}, `{shown}`", new)
    print(f"\n`{shown}`: baseline {args.baseline} vs this tree (ratio = baseline / this tree)")
    print("round  baseline wall s  this tree wall s  ratio   baseline CPU s  this tree CPU s  ratio")
    for index, (base, new) in enumerate(pairs, 1):
        print(
            f"{index:5d}  {base['total_s']:15.1f}  {new['total_s']:16.1f}  {base['total_s'] / new['total_s']:5.2f}x"
            f"  {base['total_cpu_s']:15.1f}  {new['total_cpu_s']:15.1f}  "
            f"{base['total_cpu_s'] / new['total_cpu_s']:5.2f}x"
        )


if __name__ == "__main__":
    main()
