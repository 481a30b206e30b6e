"""`dflash-doctor check --engine URL` end to end: measure on the server, replay locally, judge, report.

1. Bad input fails before anything is sent: the URL, the server's reachability and model name.
2. The workload goes to the server (engine_run.py); its own figures become the run directory.
3. With a local pair (``--target`` / ``--draft``), the embedded engine replays the same turns
   (agreement.py, stored as ``probes.engine_agreement``) and the ``engine-agreement`` check judges the
   comparison; without one, the checks that read only the run (acceptance per class on the server's
   numbers) still run.
4. run.json (the typed record, ``source.kind = serving-engine``) and the reports are written even when
   a check fails.
"""

from __future__ import annotations

from pathlib import Path

from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.serving.client import EngineEndpoint, resolve_model
from dflash_doctor.serving.engine_run import measure_engine, start_engine_record


def has_local_pair(config: DoctorConfig) -> bool:
    """With --engine, the embedded replay runs only when the user names a local pair to compare with."""
    return config.target is not None or config.draft is not None


def run_engine_doctor(config: DoctorConfig, *, only=(), skip=(), progress=None):
    """The whole `check --engine`: returns the pipeline's Outcome (run directory + record, checks included)."""
    from dflash_doctor import pipeline
    from dflash_doctor.checks.base import CheckContext, run_checks
    from dflash_doctor.stats.metrics import summarize
    from dflash_doctor.rundir.record import Summary
    from dflash_doctor.replay.stream import Replay
    from dflash_doctor.report import render_reports
    from dflash_doctor.rundir.load import Run
    from dflash_doctor.rundir.tables import TABLES
    from dflash_doctor.rundir.writer import RunWriter
    from dflash_doctor.inputs.workloads import load_workload

    assert config.engine is not None, "run_engine_doctor serves `check --engine URL` only"
    endpoint = resolve_model(EngineEndpoint.from_url(config.engine, model=config.engine_model, timeout_s=config.engine_timeout_s))
    requests = load_workload(config.workload, classes=config.classes, max_requests=config.max_requests, seed=config.seed)
    local = None
    if has_local_pair(config):  # a bad local pair fails before any request is sent
        from dflash_doctor.models.pair import load_pair

        local = load_pair(config)
    run_dir = Path(config.out) if config.out else pipeline.default_run_dir("check")
    record = start_engine_record(config, endpoint)
    if local is not None:
        record.models.update({"local target": local.target_info, "local draft": local.draft_info})
    with RunWriter(run_dir, record.to_json()) as writer:
        progress_factory = progress or pipeline._no_progress
        with progress_factory(sum(r.num_turns for r in requests)) as on_turn:
            measured = measure_engine(endpoint, requests, config, writer, record, concurrency=config.engine_concurrency, progress=on_turn)
        record.meta.interrupted = measured.interrupted
        record.summary = Summary.from_json(summarize(measured.steps_frame(), measured.requests_frame(), seed=config.seed))
        writer.meta = record.to_json()
        if measured.failure is not None:
            raise measured.failure
        if measured.interrupted:
            raise KeyboardInterrupt
        if local is not None and local.kind.engine_agreement:
            from dflash_doctor.serving.agreement import compare_with_embedded

            record.probes.engine_agreement = compare_with_embedded(local, measured.turns, config, seed=config.seed)
        if local is not None:
            ctx = pipeline.check_context(local, requests, config, record, Replay(request_rows=measured.request_rows))
        else:
            ctx = CheckContext(run_meta=record.to_json(), config=config)
        record.checks = run_checks(ctx, only=only, skip=skip)
        writer.meta = record.to_json()
    render_reports(Run(run_dir, record, measured.requests_frame(), measured.steps_frame(), TABLES["tokens"].empty_table().to_pandas()))
    return pipeline.Outcome(run_dir, record)


def print_engine_comparison(record, console) -> None:
    """Per class: the server's tau beside the embedded replay's on the same outputs (when it ran)."""
    from rich.table import Table

    data = record.probes.engine_agreement
    if not data:
        return
    table = Table(title=f"Server ({record.source.details.get('kind')}) vs embedded replay on the same outputs (tau, bonus included)")
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
