"""`dflash-doctor tune`: the step-up experiment on the user's engine (dflash_doctor/tune, docs/tune.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from dflash_doctor.cli import options as opt
from dflash_doctor.cli.root import app
from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.ownership import claim_run_dir, new_run_dir, release_run_dir
from dflash_doctor.rundir.tables import TUNE_JSON
from dflash_doctor.serving.http import secret
from dflash_doctor.inputs.config import DoctorConfig, parse_int_grid
from dflash_doctor.inputs.validation import finite_number
from dflash_doctor.tune.loads import CONCURRENCY, REQUEST_RATE, LoadLevel
from dflash_doctor.tune.servers import plan_servers
from dflash_doctor.tune.views import print_tune, write_reports


def claim_tune_dir(run_dir: Path, overwrite: bool) -> None:
    """--out is this tune's before any server starts (rundir.ownership: one live writer, no earlier run
    replaced unasked); a run directory of another command (a replay, a check) is refused even with
    --overwrite, since tune's files beside its run.json would leave neither run readable."""
    if (run_dir / "run.json").is_file() and not (run_dir / TUNE_JSON).is_file():
        raise UsageError(
            f"--out {run_dir} holds the run directory of another command (its run.json); "
            f"pass a new folder for the tune run."
        )
    claim_run_dir(run_dir, overwrite=overwrite)


Launch = Annotated[
    Optional[str],
    typer.Option(
        "--launch",
        help=(
            "Shell command starting the server with speculation; {k} is replaced "
            "by K (templates for vLLM, SGLang and llama.cpp in docs/tune.md)."
        ),
    ),
]
LaunchBaseline = Annotated[
    Optional[str], typer.Option("--launch-baseline", help="The same server without speculation: the K=0 run.")
]
TuneServers = Annotated[
    Optional[str],
    typer.Option(
        "--engine",
        help="With --launch: the URL the launched server answers at. Without: one running server per K, 0=URL,8=URL.",
    ),
]
TuneK = Annotated[str, typer.Option("--k", help="K grid, 0 = speculation off: e.g. 0,2,4,8,15.")]
Concurrency = Annotated[
    Optional[str],
    typer.Option(
        "--concurrency",
        show_default="1",
        help="Closed loop: requests kept in flight, the next sent when one is answered, e.g. 1,8; a batch-size grid "
        "(what vLLM's num_speculative_tokens_per_batch_size is keyed on).",
    ),
]
RequestRate = Annotated[
    Optional[str],
    typer.Option(
        "--request-rate",
        help="Open loop, instead of --concurrency: requests per second arriving whatever is in flight (production "
        "traffic; `vllm bench serve --request-rate`), e.g. 2,4,inf (inf = all at once); arrivals seeded by --seed.",
    ),
]
Burstiness = Annotated[
    Optional[float],
    typer.Option(
        "--burstiness",
        show_default="1",
        help=(
            "With --request-rate: gamma shape of the inter-arrival "
            "times (1 = Poisson, below 1 burstier, above 1 steadier)."
        ),
    ),
]
MaxConcurrency = Annotated[
    Optional[int],
    typer.Option(
        "--max-concurrency",
        show_default="no cap",
        help=(
            "With --request-rate: at most this many requests in flight; a later "
            "arrival waits for a slot (`vllm bench serve --max-concurrency`)."
        ),
    ),
]
FitK = Annotated[
    Optional[str],
    typer.Option(
        "--fit-k",
        help="The K the step costs are fitted from (default: the two smallest K > 0); the others are predicted.",
    ),
]
SweepDir = Annotated[
    Optional[str],
    typer.Option("--sweep", help="An earlier `sweep` run of the same workload and pair, instead of replaying here."),
]
StartTimeout = Annotated[
    float, typer.Option("--start-timeout", help="Seconds to wait for a server to answer GET /v1/models.")
]


@app.command(
    epilog="Example: dflash-doctor tune --engine 0=http://127.0.0.1:8000,8=http://127.0.0.1:8001 --k 0,8 "
    "--max-requests 12 (servers you run; --launch/--launch-baseline start them per K: docs/tune.md)"
)
@opt.config_command(
    "target",
    "draft",
    "draft_kind",
    "workload",
    "classes",
    "max_requests",
    "max_new_tokens",
    "temperature",
    "device",
    "dtype",
    "out",
    "overwrite",
    "seed",
    "chat_template",
    "strict_classes",
    "trust_remote_code",
    "engine_model",
)
def tune(
    config: DoctorConfig,
    launch: Launch = None,
    launch_baseline: LaunchBaseline = None,
    engine: TuneServers = None,
    k: TuneK = "0,2,4,8",
    concurrency: Concurrency = None,
    request_rate: RequestRate = None,
    burstiness: Burstiness = None,
    max_concurrency: MaxConcurrency = None,
    fit_k: FitK = None,
    sweep: SweepDir = None,
    start_timeout: StartTimeout = 900.0,
    engine_api_key: opt.ServerApiKey = None,
) -> None:
    """Measure K = 0 (off) and each K on your engine per class and
    load; fit its step costs, predict the rest, recommend its setting.

    Load is a closed loop (--concurrency: a fixed number of requests in flight, a benchmark's batch size) or an
    open loop (--request-rate: requests arrive at a rate, Poisson or --burstiness, whatever is in flight, as
    production traffic does: latency then includes queueing when the server falls behind)."""
    # imported here, not above: the experiment imports torch (through
    # the replay's turn rules), which `tune --help` must not
    from dflash_doctor.tune.experiment import TuneGrid, default_fit_ks, parse_rates, run_tune
    from dflash_doctor.tune.measure import TimedRequest

    cfg = config
    start_timeout = finite_number(
        start_timeout, "--start-timeout", above=0, maximum=86400 * 7, fix="pass a positive number of seconds"
    )  # nan: a deadline never passed
    ks = parse_int_grid(k, "--k", minimum=0)
    fit_ks = parse_int_grid(fit_k, "--fit-k", minimum=1) if fit_k else default_fit_ks(ks)
    if not set(fit_ks) <= set(ks):
        raise UsageError(
            f"--fit-k {','.join(map(str, fit_ks))} names K that --k {k} does not measure; fit from K in the grid."
        )
    if concurrency is not None and request_rate is not None:
        raise UsageError(
            "--concurrency (closed loop) and --request-rate (open loop) are two ways to load the server; give one."
        )
    for flag, value in (("--burstiness", burstiness), ("--max-concurrency", max_concurrency)):
        if value is not None and request_rate is None:
            raise UsageError(f"{flag} shapes the arrivals of --request-rate; give --request-rate too, or drop {flag}.")
    if max_concurrency is not None and max_concurrency < 1:
        raise UsageError(f"--max-concurrency {max_concurrency} must be 1 or more requests in flight; fix the value.")
    if burstiness is not None and not burstiness > 0:
        raise UsageError(f"--burstiness {burstiness} must be above 0 (1 = Poisson arrivals); fix the value.")
    loads = (
        tuple(LoadLevel(REQUEST_RATE, rate, burstiness or 1.0, max_concurrency) for rate in parse_rates(request_rate))
        if request_rate is not None
        else tuple(
            LoadLevel(CONCURRENCY, level) for level in parse_int_grid(concurrency or "1", "--concurrency", minimum=1)
        )
    )
    grid = TuneGrid(
        ks=ks,
        loads=loads,
        fit_ks=fit_ks,
        engine=engine,
        launch=launch,
        launch_baseline=launch_baseline,
        sweep_dir=sweep,
        start_timeout_s=start_timeout,
    )
    console = Console(stderr=True)

    def progress(k_now: int, load: LoadLevel, timed: TimedRequest) -> None:
        console.print(
            f"K={k_now} {load.label} {timed.request_id}: {timed.num_output_tokens} tokens in {timed.e2e_s:.2f} s",
            highlight=False,
        )

    api_key = secret(engine_api_key, "--engine-api-key") if engine_api_key else None
    plan_servers(grid.ks, grid.engine, grid.launch, grid.launch_baseline)  # flag errors before a folder is claimed
    run_dir = Path(cfg.out) if cfg.out else new_run_dir("tune")
    claim_tune_dir(run_dir, cfg.overwrite)
    try:
        outcome = run_tune(grid, cfg, run_dir, on_request=progress, api_key=api_key)
        write_reports(outcome.run_dir, outcome.result)
    finally:
        release_run_dir(run_dir)
    print_tune(outcome.result, Console())
    console.print(f"wrote {outcome.run_dir}")
