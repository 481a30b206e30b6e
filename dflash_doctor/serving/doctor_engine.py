"""`dflash-doctor check --engine URL` end to end: measure on the server, replay locally, judge, report.

1. Bad input fails before anything is sent: the URL, the server's reachability and model name.
2. The workload goes to the server (engine_run.py); its own figures become the run directory.
3. With a local pair (``--target`` / ``--draft``), the embedded engine replays the same turns
   (agreement.py) and the ``engine-agreement`` check judges the comparison; without one, the checks
   that read only the run (acceptance per class on the server's numbers) still run.
4. run.json and the reports are written even when a check fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_doctor.config import DoctorConfig
from dflash_doctor.serving.client import EngineEndpoint, resolve_model
from dflash_doctor.serving.engine_run import measure_engine, start_engine_meta


def has_local_pair(config: DoctorConfig) -> bool:
    """With --engine, the embedded replay runs only when the user names a local pair to compare with."""
    return config.target is not None or config.draft is not None


def run_engine_doctor(config: DoctorConfig, *, only=(), skip=(), console=None):
    """The whole `check --engine`: returns (run_dir, check results, meta)."""
    from dflash_doctor import runner
    from dflash_doctor.checks.base import CheckContext, run_checks
    from dflash_doctor.report import render_reports
    from dflash_doctor.schema import write_run_json

    endpoint = resolve_model(EngineEndpoint.from_url(config.engine, model=config.engine_model, timeout_s=config.engine_timeout_s))
    requests = runner.select_requests(config)
    local = runner.load_engine(config) if has_local_pair(config) else None  # a bad local pair fails before any request
    run_dir = Path(config.out) if config.out else runner.default_run_dir("check")
    meta = start_engine_meta(config, endpoint)
    with runner.ProgressReporter(sum(r.num_turns for r in requests), console) as progress:
        answered = measure_engine(endpoint, requests, config, run_dir, meta, concurrency=config.engine_concurrency, progress=progress)
    extras: dict[str, Any] = {}
    if local is not None:
        from dflash_doctor import doctor
        from dflash_doctor.serving.agreement import compare_with_embedded

        meta["models"]["local"] = local.models_meta
        if local.models_meta["draft"]["kind"] == "dflash":
            extras["engine_agreement"] = compare_with_embedded(local, answered, config, seed=config.seed)
        ctx = doctor.check_context(local, requests, config, meta, extras)
    else:
        ctx = CheckContext(run_meta=meta, config=config, extras=extras)
    results = run_checks(ctx, only=only, skip=skip)
    meta["checks"] = [r.to_dict() for r in results]
    meta["probes"] = {k: v for k, v in extras.items()}
    write_run_json(run_dir, meta)
    render_reports(run_dir)
    return run_dir, results, meta


def print_engine_comparison(meta: dict[str, Any], console) -> None:
    """Per class: the server's tau beside the embedded replay's on the same outputs (when it ran)."""
    from rich.table import Table

    data = (meta.get("probes") or {}).get("engine_agreement")
    if not data:
        return
    table = Table(title=f"Server ({meta['engine'].get('kind')}) vs embedded replay on the same outputs (tau, bonus included)")
    for column in ("class", "turns", "server tau", "95% CI", "embedded tau", "95% CI", "difference [95% CI]"):
        table.add_column(column)
    blocks = [("overall", data["tau"]["overall"]), *data["tau"]["by_class"].items()]
    for name, block in blocks:
        if not block:
            continue
        ci = lambda v: f"[{v[0]:.2f}, {v[1]:.2f}]"  # noqa: E731
        table.add_row(name, str(block["num_turns"]), f"{block['engine_tau']:.3f}", ci(block["engine_tau_ci"]),
                      f"{block['embedded_tau']:.3f}", ci(block["embedded_tau_ci"]), f"{block['difference']:+.3f} {ci(block['difference_ci'])}")
    console.print(table)
    shares = ", ".join(f"{name} {stats['share']:.0%}" for name, stats in data["per_step"].items() if stats.get("share") is not None)
    console.print(f"per-step acceptance reproduced at the engine's own anchors: {shares}")
