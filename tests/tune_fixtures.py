"""A `tune` run's inputs and a whole tune run, against the fake engines of tests/fake_spec_engine.py: a
four-prompt two-class workload, a sweep run whose teacher-forced tau is the fake engines' exact tau, and
:func:`write_tune_run` for views that need a finished tune run (the dashboard in a monitoring install)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from dflash_doctor.cli import app

import fake_spec_engine as fake

MAX_TOKENS = 24
PROMPTS = {
    "m1": ("math", "math: add 2 and 3"),
    "m2": ("math", "math: halve 10"),
    "c1": ("chat", "chat: say hello"),
    "c2": ("chat", "chat: name a colour"),
}


def write_workload(folder: Path) -> Path:
    path = folder / "workload.jsonl"
    path.write_text(
        "".join(json.dumps({"id": rid, "class": cls, "prompt": text}) + "\n" for rid, (cls, text) in PROMPTS.items())
    )
    return path


def expected_tau(scope: str, k: int) -> float:
    steps = [
        a
        for rid, (cls, text) in PROMPTS.items()
        if scope in ("overall", cls)
        for a in fake.per_step_accepted(text, k, MAX_TOKENS)
    ]
    return 1.0 + sum(steps) / len(steps)


def write_sweep_run(folder: Path, ks: list[int]) -> Path:
    """A sweep run directory whose teacher-forced tau is the fake
    engine's exact tau (a perfect prediction of acceptance)."""
    run_dir = folder / "sweep"
    run_dir.mkdir()

    def rows(scope: str) -> list[dict]:
        return [
            {
                "k": k,
                "mean_acceptance_length": expected_tau(scope, k),
                "mean_acceptance_length_ci": [expected_tau(scope, k)] * 2,
            }
            for k in ks
        ]

    sweep = {"overall": rows("overall"), "by_class": {"math": rows("math"), "chat": rows("chat")}}
    (run_dir / "run.json").write_text(
        json.dumps({"summary": {"sweep": sweep}, "models": {"draft": {"kind": "dflash"}}})
    )
    return run_dir


def write_tune_run(root: Path, ks: tuple[int, ...] = (0, 2)) -> Path:
    """``dflash-doctor tune`` over fake engines at ``ks`` (0 = the baseline), written to ``root / "tune"``."""
    root.mkdir(parents=True, exist_ok=True)
    servers = {k: fake.start(k) for k in ks}
    try:
        engine = ",".join(f"{k}=http://127.0.0.1:{s.server_address[1]}" for k, s in servers.items())
        out = root / "tune"
        result = CliRunner().invoke(
            app,
            [
                "tune",
                "--engine",
                engine,
                "--k",
                ",".join(map(str, ks)),
                "--workload",
                str(write_workload(root)),
                "--max-new-tokens",
                str(MAX_TOKENS),
                "--sweep",
                str(write_sweep_run(root, [k for k in ks if k])),
                "--out",
                str(out),
            ],
        )
    finally:
        for server in servers.values():
            server.shutdown()
    assert result.exit_code == 0, result.output
    return out
