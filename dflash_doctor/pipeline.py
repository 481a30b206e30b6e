"""The commands that replay a workload, as straight sequences: ``replay``, ``sweep``, ``check`` and
``check --engine``.

Each is select requests -> load the pair once -> replay (rows stream to the run directory) ->
summarize the in-memory rows -> (sweep + recommendation) -> (probes on the in-memory turns -> checks)
-> run.json written once at the end -> (reports). Every stage is called once and hands typed values to
the next; nothing is read back from the run directory. The CLI modules parse flags, call one function
here, print a view of the returned :class:`Outcome` and pick the exit code.

Ctrl-C, SIGTERM or SIGHUP during the replay keeps every finished request: the tables are closed, run.json
is written with the summary of what finished (``interrupted``), and the interrupt propagates as
:class:`~dflash_doctor.processes.Stopped` of the same signal, so the command exits 128 + that signal. An
interrupt at any later stage (pricing, probes, checks) reaches the open :class:`RunWriter`, which records
the run as interrupted too.
"""

from __future__ import annotations

import dataclasses
import signal
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import pyarrow as pa

from dflash_doctor.checks.base import CheckContext, run_checks, validate_check_params
from dflash_doctor.engine.schedule import end_of_request
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.check_inputs import safe_folder_name
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.inputs.machine import collect_environment
from dflash_doctor.inputs.validation import safetensors_shapes
from dflash_doctor.inputs.workloads import Request, load_workload
from dflash_doctor.models.loading import weights_fingerprint
from dflash_doctor.models.draft_kinds import resolve_draft_spec, weightless_kind
from dflash_doctor.models.loading import DEMO_DRAFT_DIR
from dflash_doctor.models.pair import Pair, load_pair
from dflash_doctor.processes import Stopped
from dflash_doctor.replay import sharding
from dflash_doctor.replay.probes import layer_offset_probe, lossless_probe, probe_turns
from dflash_doctor.replay.stream import Replay, SharedContinuations, replay_live, replay_teacher
from dflash_doctor.report import render_reports
from dflash_doctor.report.head_to_head import describe_sub_runs, write_head_to_head
from dflash_doctor.rundir.load import Run
from dflash_doctor.rundir.run_record import Probes, PromptFormat, RunMeta, RunRecord
from dflash_doctor.rundir.tables import TABLES, read_table_or_empty
from dflash_doctor.rundir.ownership import claim_run_dir, new_run_dir
from dflash_doctor.rundir.writer import RunWriter, utc_now, write_costs_table
from dflash_doctor.serving.agreement import compare_with_embedded
from dflash_doctor.serving.client import ServerEndpoint, resolve_model, served_model_file
from dflash_doctor.serving.server_settings import server_settings
from dflash_doctor.serving.server_run import measure_server, start_server_record
from dflash_doctor.stages import stage
from dflash_doctor.stats import deviations
from dflash_doctor.stats.head_to_head import Contender, HeadToHead, build_head_to_head
from dflash_doctor.stats.metrics import summarize
from dflash_doctor.stats.speedup import build_sweep, load_cost_profile, recommend
from dflash_doctor.stats.step_costs import CostSamples, fitted_costs

ProgressFactory = Callable[[int], ContextManager[Callable[[Any], None] | None]]  # total turns -> progress callback


@dataclass
class Outcome:
    """What a command produced: where the run directory is and its record (checks included)."""

    run_dir: Path
    record: RunRecord
    why_rejected: deviations.DeviationAnalysis | None = (
        None  # `check`'s deviation analysis (dflash_doctor.stats.deviations), for the terminal
    )
    steps_by_k: dict[int, Any] | None = None  # `check`'s steps at every K of the sweep (frames), for a head-to-head
    cost_samples: CostSamples | None = (
        None  # `check`'s raw step timings (None: priced with a cost profile), for a head-to-head
    )


def _claim(config: DoctorConfig, command: str) -> Path:
    """The run directory, taken for this process before any work (:mod:`dflash_doctor.rundir.ownership`);
    under torchrun rank 0 owns it for every rank (the others write only their part below it), so the
    ranks need it named (``--devices`` names it for them)."""
    ranks = sharding.current_ranks()
    if config.out:
        run_dir = Path(config.out)
    elif ranks.sharded:
        raise UsageError(
            f"the {ranks.world_size} torchrun ranks must write one run directory; pass --out DIR "
            "(the --devices shortcut picks one itself)."
        )
    else:
        run_dir = new_run_dir(command)
    if ranks.is_main:
        claim_run_dir(run_dir, overwrite=config.overwrite)
    return run_dir


def no_progress(total: int) -> ContextManager[None]:
    return nullcontext(None)


def _start(
    config: DoctorConfig, command: str, scenario=None, run_dir: Path | None = None
) -> tuple[list[Request], Pair, DoctorConfig]:
    """Select the workload and load the pair (a scenario edits them before anything runs; one whose incident
    lives in a checkpoint's files writes the draft it serves into ``run_dir`` first)."""
    requests = load_workload(
        config.workload, classes=config.classes, max_requests=config.max_requests, seed=config.seed
    )
    if scenario is not None and scenario.served_draft is not None and run_dir is not None:
        config = dataclasses.replace(config, draft=str(scenario.served_draft(run_dir / "served-draft")))
    config = dataclasses.replace(config, device=sharding.device_for_rank(config, sharding.current_ranks()))
    pair = load_pair(config, server_settings(config.engine_config) if config.engine_config else None)
    pair.check_k_fits(config.k)  # before a writer opens: a refused --k leaves no run behind
    if pair.proposer.remembers_requests and sharding.current_ranks().sharded:
        raise UsageError(
            f"the {pair.kind.name} speculator remembers earlier requests in their order, which a replay split over "
            "ranks cannot keep; run it in one process, without --devices or torchrun."
        )
    if scenario is not None:
        pair, requests, config = scenario.apply(pair, requests, config)
    return requests, pair, config


def _new_record(config: DoctorConfig, pair: Pair, command: str, **meta: Any) -> RunRecord:
    return RunRecord(
        meta=RunMeta(command=command, created_at=utc_now(), **meta),
        models={"target": pair.target_info, "draft": pair.draft_info},
        environment=collect_environment(pair.target_info.facts.get("attn_implementation")),
        config=config.as_dict(),
    )


def _summarize(record: RunRecord, replay: Replay, seed: int) -> None:
    record.meta.interrupted = replay.interrupted
    record.summary = summarize(replay.steps_frame(), replay.requests_frame(), seed=seed)


def _sweep(record: RunRecord, pair: Pair, replay: Replay, config: DoctorConfig, run_dir: Path) -> CostSamples | None:
    """``summary.sweep`` and ``recommendation``: tau and net speedup per K with their intervals, priced with
    step costs timed here with their spread (raw samples in ``costs.parquet``) or from ``--cost-profile``;
    returns the samples (None for a profile) for a head-to-head to price with."""
    source = "cost profile" if config.cost_profile else f"timing the steps (up to {config.timing_budget_s:g} s)"
    with stage(f"pricing K {k_text(config.k)}: {source}, intervals per class"):
        if config.cost_profile:
            samples, costs = None, load_cost_profile(config.cost_profile)
        else:
            samples = pair.measure_step_costs(config.k, budget_s=config.timing_budget_s, seed=config.seed)
            costs = fitted_costs(samples)
        priced = build_sweep(replay.sweep_frames(), costs, replay.estimate_by_k, cost_samples=samples, seed=config.seed)
    if samples is not None:
        write_costs_table(run_dir, pa.Table.from_pandas(samples.to_frame(), preserve_index=False))
    record.summary.sweep = priced.sweep
    strict_max_k = int(config.thresholds.get("strict_max_k", 4))
    share = float(config.thresholds.get("conservative_share", 0.95))
    record.recommendation = recommend(
        priced.sweep.scopes(),
        replicates=priced.replicates,
        timing_violations=samples.violations if samples is not None else (),
        shape_effect_ks=samples.shape_effect_ks if samples is not None else (),
        conservative_share=share,
        strict_classes=config.strict_classes,
        strict_max_k=strict_max_k,
    )
    return samples


def _finish(writer: RunWriter, record: RunRecord, replay: Replay) -> None:
    """run.json gets the final record when the writer closes; an interrupted replay ends the command here,
    with the signal that interrupted it."""
    writer.meta = record.to_json()
    if replay.interrupted:
        raise Stopped(replay.interrupt_signal or signal.SIGINT)


def run_replay(config: DoctorConfig, *, progress: ProgressFactory = no_progress) -> Outcome:
    """`replay`: every turn through the live loop at K = the largest --k (the draft's default without one)."""
    run_dir = _claim(config, "replay")
    requests, pair, config = _start(config, "replay")
    k = max(config.k) if config.k else pair.default_k
    record = _new_record(config, pair, "replay")
    with RunWriter(run_dir, record.to_json()) as writer:
        with progress(sum(r.num_turns for r in requests)) as on_turn:
            replay = replay_live(
                pair,
                requests,
                k=k,
                max_new_tokens=config.max_new_tokens,
                temperature=config.temperature,
                seed=config.seed,
                writer=writer,
                progress=on_turn,
                convention=end_of_request(config.end_of_request),
            )
        _summarize(record, replay, config.seed)
        _finish(writer, record, replay)
    return Outcome(run_dir, record)


def run_sweep(config: DoctorConfig, *, exact_blocks: bool = False, progress: ProgressFactory = no_progress) -> Outcome:
    """`sweep`: one teacher-forced pass answering every K (default 1..block-1, or 1..8), net speedup per
    class and the recommended K."""
    run_dir = _claim(config, "sweep")
    requests, pair, config = _start(config, "sweep")
    if not config.k:
        config = dataclasses.replace(config, k=tuple(range(1, pair.default_k + 1)))
    record = _new_record(config, pair, "sweep")
    writer, replay = _teacher(pair, requests, config, exact_blocks, run_dir, record, progress)
    with writer:
        _summarize(record, replay, config.seed)
        if not replay.interrupted:
            _sweep(record, pair, replay, config, run_dir)
        _finish(writer, record, replay)
    return Outcome(run_dir, record)


def _teacher(
    pair: Pair,
    requests: Sequence[Request],
    config: DoctorConfig,
    exact_blocks: bool,
    run_dir: Path,
    record: RunRecord,
    progress: ProgressFactory,
    shared: SharedContinuations | None = None,
) -> tuple[RunWriter, Replay]:
    """The teacher-forced replay into the run directory (this rank's share under torchrun; rank 0 gets
    the merged replay, the other ranks end here): the open writer and the replay. ``shared``: the
    target's answers a head-to-head hands from one speculator's replay to the next."""

    if not sharding.current_ranks().is_main:
        progress = no_progress  # one progress bar, rank 0's

    def replay(writer: RunWriter, mine: Sequence[Request]) -> Replay:
        with progress(sum(r.num_turns for r in mine)) as on_turn:
            return replay_teacher(
                pair,
                mine,
                ks=config.k,
                max_new_tokens=config.max_new_tokens,
                temperature=config.temperature,
                seed=config.seed,
                exact_blocks=exact_blocks,
                writer=writer,
                progress=on_turn,
                convention=end_of_request(config.end_of_request),
                shared=shared,
            )

    work = sharding.work_of(pair.tokenizer, config.max_new_tokens, max(config.k))
    return sharding.replay_into(run_dir, record.to_json(), requests, replay, work)


def check_sweep_ks(asked: Sequence[int], default_k: int) -> tuple[int, ...]:
    """The K values `check` prices: the user's list or range as given (its largest is the K they serve), or,
    for one K or none, every K from 1 up to the larger of it and the draft's default, so the recommendation
    can say whether a smaller K pays better than the one served."""
    if len(asked) > 1:
        return tuple(sorted(set(asked)))
    return tuple(range(1, max((default_k, *asked)) + 1))


def k_text(ks: Sequence[int]) -> str:
    """K values as a person writes them: a range ``1-15`` when they are consecutive, else a list ``2, 4, 8``."""
    ks = sorted(set(ks))
    if len(ks) > 2 and ks == list(range(ks[0], ks[-1] + 1)):
        return f"{ks[0]}-{ks[-1]}"
    return ", ".join(map(str, ks))


def run_check(
    config: DoctorConfig,
    *,
    scenario=None,
    only: Sequence[str] = (),
    skip: Sequence[str] = (),
    exact_blocks: bool = False,
    progress: ProgressFactory = no_progress,
    shared: SharedContinuations | None = None,
) -> Outcome:
    """`check`: teacher-forced replay of every K up to the draft's block (and the served K), the sweep,
    the probes, every check, run.json, then the reports. The run directory and reports are written even
    when a check fails, so CI keeps the evidence. ``shared``: see :class:`SharedContinuations`."""
    validate_check_params(config.checks, only, skip)
    run_dir = _claim(config, "check")
    requests, pair, config = _start(config, "check", scenario, run_dir)
    served_k = max(config.k) if config.k else None  # the K the user serves, when they said
    sweep_config = dataclasses.replace(config, k=check_sweep_ks(config.k, pair.default_k))
    record = _new_record(
        sweep_config, pair, "check", scenario=scenario.name if scenario is not None else None, served_k=served_k
    )
    writer, replay = _teacher(pair, requests, sweep_config, exact_blocks, run_dir, record, progress, shared)
    with writer:
        _summarize(record, replay, config.seed)
        if replay.interrupted:
            _finish(writer, record, replay)
        cost_samples = _sweep(record, pair, replay, sweep_config, run_dir)
        record.probes = _probes(pair, requests, replay, sweep_config)
        ctx_config = dataclasses.replace(config, k=(served_k,) if served_k else ())
        record.checks = run_checks(
            check_context(pair, requests, ctx_config, record, replay.request_rows), only=only, skip=skip
        )
        _finish(writer, record, replay)
    tokens = TABLES["tokens"]  # token rows are never held in memory: the report's token viewer reads them back
    run = Run(
        run_dir,
        record,
        replay.requests_frame(),
        replay.steps_frame(),
        read_table_or_empty(run_dir / "tokens.parquet", tokens),
    )
    analysis = deviations.analyze_run(run)  # once: every report format and the terminal show it
    render_reports(run, analysis=analysis, plotly=config.plotly)
    return Outcome(run_dir, record, analysis, replay.sweep_frames(), cost_samples)


def run_server_check(
    config: DoctorConfig,
    *,
    only: Sequence[str] = (),
    skip: Sequence[str] = (),
    progress: ProgressFactory = no_progress,
    api_key: str | None = None,
) -> Outcome:
    """`check --engine URL`: measure on the server, replay locally, judge, report.

    1. Bad input fails before anything is sent: the URL, the server's reachability and model name, and a
       local pair when one is named.
    2. The workload goes to the server (:mod:`dflash_doctor.serving.server_run`); its own figures become
       the run directory.
    3. With a local pair (``--target`` / ``--draft``), the embedded engine replays the same turns
       (:mod:`dflash_doctor.serving.agreement`, stored as ``probes.engine_agreement``) and the
       ``engine-agreement`` check judges the comparison; without one, the checks that read only the run
       (acceptance per class on the server's numbers) still run.
    4. run.json (the typed record, ``source.kind = serving-engine``) and the reports are written even when
       a check fails.

    ``api_key`` (``--engine-api-key``) is a secret: it lives in the endpoint's client only, not in
    ``config``, so no run directory or report can hold it.
    """
    if config.engine is None:
        raise UsageError(
            "check --engine needs the URL of a running OpenAI-compatible server; pass --engine http://host:port."
        )
    validate_check_params(config.checks, only, skip)
    run_dir = _claim(config, "check")
    endpoint = resolve_model(
        ServerEndpoint.from_url(
            config.engine, model=config.engine_model, timeout_s=config.engine_timeout_s, api_key=api_key
        )
    )
    requests = load_workload(
        config.workload, classes=config.classes, max_requests=config.max_requests, seed=config.seed
    )
    # the embedded replay runs only when the user names a local pair to compare with; a bad one fails
    # before any request is sent
    local = (
        load_pair(config, server_settings(config.engine_config) if config.engine_config else None)
        if config.target is not None or config.draft is not None
        else None
    )
    record = start_server_record(config, endpoint, served_model_file(endpoint))
    if local is not None:
        record.models.update({"local target": local.target_info, "local draft": local.draft_info})
    with RunWriter(run_dir, record.to_json()) as writer:
        with progress(sum(r.num_turns for r in requests)) as on_turn:
            measured = measure_server(
                endpoint, requests, config, writer, record, concurrency=config.engine_concurrency, progress=on_turn
            )
        record.meta.interrupted = measured.interrupted
        record.summary = summarize(measured.steps_frame(), measured.requests_frame(), seed=config.seed)
        writer.meta = record.to_json()
        if measured.failure is not None:
            raise measured.failure
        if measured.interrupted:
            raise Stopped(measured.interrupt_signal or signal.SIGINT)
        if local is not None and local.kind.engine_agreement:
            record.probes.engine_agreement = compare_with_embedded(local, measured.turns, config, seed=config.seed)
        if local is not None:
            ctx = check_context(local, requests, config, record, measured.request_rows)
        else:
            ctx = CheckContext(record=record, config=config)
        record.checks = run_checks(ctx, only=only, skip=skip)
        writer.meta = record.to_json()
    render_reports(
        Run(
            run_dir,
            record,
            measured.requests_frame(),
            measured.steps_frame(),
            TABLES["tokens"].empty_table().to_pandas(),
        ),
        plotly=config.plotly,
    )
    return Outcome(run_dir, record)


def _probes(pair: Pair, requests: Sequence[Request], replay: Replay, config: DoctorConfig) -> Probes:
    turns = probe_turns(replay.turns)
    probes = Probes(
        prompt_format=PromptFormat(
            num_raw_prompts=sum(r.prompt is not None for r in requests),
            num_templated=sum(r.messages is not None for r in requests),
        ),
        target_weights_fingerprint=weights_fingerprint(pair.target.model),
    )
    if config.temperature == 0:
        with stage(f"lossless probe: {len(turns)} requests live at K={max(config.k)} vs plain decoding"):
            probes.lossless = lossless_probe(pair, turns, k=max(config.k), dtype=config.dtype)
    if pair.kind.with_layer_ids is not None:
        with stage("layer-offset probe: target layer ids shifted by -1 and +1"):
            offset = layer_offset_probe(pair, turns, replay.full_block_matches)
        if offset is not None:
            probes.offset_probe, probes.offset_probe_drafts = offset
    return probes


def _output_ids_by_class(request_rows: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    """The ids the target produced, per request class, in the rows' order (checks that bound acceptance by
    what a draft can propose judge each class as well as the run)."""
    by_class: dict[str, list[int]] = {}
    for row in request_rows:
        by_class.setdefault(str(row["class"]), []).extend(int(t) for t in row["output_token_ids"])
    return by_class


def check_context(
    pair: Pair,
    requests: Sequence[Request],
    config: DoctorConfig,
    record: RunRecord,
    request_rows: Sequence[dict[str, Any]],
):
    """Everything the checks read, gathered once from the loaded pair, the record and the requests rows
    (the replay's, or the server's under ``--engine``)."""
    from transformers import AutoTokenizer

    draft_tokenizer = None
    if pair.kind.ships_tokenizer and pair.draft_dir is not None:
        try:
            draft_tokenizer = AutoTokenizer.from_pretrained(pair.draft_dir)
        except (OSError, ValueError):
            draft_tokenizer = None
    recorded = pair.draft_config.get("dflash_doctor") or {}
    corpus = [m["content"] for r in requests for m in (r.messages or []) if isinstance(m.get("content"), str)]
    corpus += [r.prompt for r in requests if r.prompt]
    return CheckContext(
        target_tokenizer=pair.tokenizer,
        draft_tokenizer=draft_tokenizer,
        target_config=pair.target.model.config,
        draft_config=pair.draft_config or None,  # a speculator without weights has no config.json to check
        draft_kind=pair.kind.name,
        environment=record.environment,
        engine_config=pair.server_settings,
        corpus=corpus,
        target_template=pair.chat_template or getattr(pair.tokenizer, "chat_template", None),
        draft_template=getattr(draft_tokenizer, "chat_template", None) if draft_tokenizer is not None else None,
        draft_training_template=recorded.get("chat_template"),
        record=record,
        config=config,
        output_token_ids_by_class=_output_ids_by_class(request_rows),
        draft_weight_shapes=draft_weight_shapes(pair.draft_dir) if pair.draft_dir is not None else {},
    )


def draft_weight_shapes(draft_dir: Path) -> dict[str, list[int]]:
    """Tensor shapes of the draft's safetensors (headers only), for draft-config's fc / own-head rules."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(Path(draft_dir).glob("*.safetensors")):
        shapes.update({name.removeprefix("model."): shape for name, shape in safetensors_shapes(file).items()})
    return shapes


@dataclass
class HeadToHeadOutcome:
    """``check --draft A --draft B ...``: the folder holding one sub-folder per speculator's check, each
    speculator's outcome, and the head-to-head (``head_to_head.json`` / ``.md`` / ``.html`` beside them)."""

    root: Path
    outcomes: dict[str, Outcome]
    head_to_head: HeadToHead  # as head_to_head.json holds it, the sub-runs' facts included


def contender_names(drafts: Sequence[str | None]) -> list[str]:
    """A short, unique folder and table name per ``--draft``: a weightless speculator's kind name, else
    the checkpoint's folder name (``None``: the built-in demo draft); a repeat gets ``-2``, ``-3``..."""
    names: list[str] = []
    for draft in drafts:
        named = weightless_kind(draft) if draft is not None else None
        # the resolved folder's name, made a safe folder name: `x/..` names its parent, never `..` beside --out
        folder = Path(draft or DEMO_DRAFT_DIR).resolve().name.removesuffix(".gguf")
        base = named[0].name if named is not None else safe_folder_name(folder)
        name, count = base, 1
        while name in names:
            count += 1
            name = f"{base}-{count}"
        names.append(name)
    return names


def run_head_to_head(
    config: DoctorConfig,
    drafts: Sequence[str | None],
    *,
    only: Sequence[str] = (),
    skip: Sequence[str] = (),
    exact_blocks: bool = False,
    progress: ProgressFactory = no_progress,
) -> HeadToHeadOutcome:
    """Each speculator's full ``check`` on the same workload, target and seed (one sub-folder each),
    then the head-to-head over them (:mod:`dflash_doctor.stats.head_to_head`).

    The target's continuations are generated once, by the first speculator's replay, and reused by the
    others (:class:`SharedContinuations`): every speculator is judged on the very same turns, and the
    generation (most of a check's time on a CPU) is not repeated. ``--draft-kind`` applies to the
    checkpoints; a weightless speculator keeps its own kind."""
    if config.engine is not None:
        raise UsageError(
            "--engine measures one served speculator; compare speculators with several --draft and no --engine."
        )
    kinds = [
        "auto" if draft is not None and weightless_kind(draft) is not None else config.draft_kind for draft in drafts
    ]
    for draft, kind in zip(drafts, kinds):  # each --draft refused now if it can be, before a model or folder is made
        resolve_draft_spec(draft or str(DEMO_DRAFT_DIR), kind)
    root = _claim(config, "check")
    outcomes: dict[str, Outcome] = {}
    shared = SharedContinuations()
    for name, draft, kind in zip(contender_names(drafts), drafts, kinds):
        one = dataclasses.replace(
            config, draft=draft, draft_kind=kind, out=str(root / name), overwrite=config.overwrite
        )
        outcomes[name] = run_check(
            one, only=only, skip=skip, exact_blocks=exact_blocks, progress=progress, shared=shared
        )
    contenders = [
        Contender(name, outcome.record, outcome.steps_by_k or {}, outcome.cost_samples, outcome.run_dir)
        for name, outcome in outcomes.items()
    ]
    head_to_head = describe_sub_runs(root, build_head_to_head(contenders, seed=config.seed))
    write_head_to_head(root, head_to_head)
    return HeadToHeadOutcome(root, outcomes, head_to_head)
