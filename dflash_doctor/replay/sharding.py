"""Scaling ``sweep`` and ``check`` over many processes with PyTorch's own machinery (torchrun).

Data parallel (``torchrun --nproc-per-node N`` or the ``--devices`` shortcut that launches it): every rank
loads the pair on its own device and replays its share of the requests. The share is deterministic and
balanced by expected work (:func:`shard_requests`: prompt tokens plus new tokens at every K), so the ranks
finish together. Each rank streams its rows into its own part of the run directory (``parts/rank-<r>/``, the usual
journal); rank 0 then gathers the in-memory replays over a gloo group (only Python objects travel, so gloo serves
CPU and GPU ranks alike), merges the parts into the run directory in the order a single process writes
them and carries on alone (summary, sweep, probes, checks, reports). The merged run is the run one
process makes of the same requests: identical at temperature 0, where nothing is random; above 0 each
rank draws its own sampled trajectories (seeded), so the figures agree in distribution only. A rank's
own target may span several GPUs (:mod:`dflash_doctor.models.placement`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.inputs.workloads import Request
from dflash_doctor.processes import run_in_group
from dflash_doctor.replay.stream import Replay
from dflash_doctor.rundir.ownership import new_run_dir
from dflash_doctor.rundir.writer import RunWriter, part_dir

GROUP_SEPARATOR = "+"  # joins the GPUs of one rank's target in --devices: cuda:0+cuda:1


@dataclass(frozen=True)
class Ranks:
    """This process's place among the torchrun processes of one command."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1


def current_ranks() -> Ranks:
    """The torchrun environment of this process (a plain process is rank 0 of 1)."""
    return Ranks(
        int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
    )


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def expected_work(request: Request, count_tokens: Callable[[str], int], max_new_tokens: int, k: int) -> int:
    """What replaying ``request`` costs, in token-slots: the target reads its context once (every
    message's text, or the raw prompt) and each of its turns' new tokens once, and the draft guesses K
    slots for each new token (its block passes and the divergence columns, most of a replay's time on
    short contexts). The request's own ``max_new_tokens`` wins over the run's, as in replay."""
    text = (
        request.prompt if request.messages is None else "\n".join(str(m.get("content", "")) for m in request.messages)
    )
    new_tokens = request.num_turns * (request.max_new_tokens or max_new_tokens)
    return count_tokens(text or "") + new_tokens * (1 + k)


def work_of(tokenizer: Any, max_new_tokens: int, k: int) -> Callable[[Request], int]:
    """:func:`expected_work` with the target's tokenizer counting the prompts' tokens."""
    return lambda request: expected_work(request, lambda text: len(tokenizer.encode(text)), max_new_tokens, k)


def shard_requests(work: Sequence[float], world_size: int) -> list[list[int]]:
    """Each rank's requests (indices into ``work``, in input order), shared by expected work so that the
    ranks finish together: the largest first, each to the least loaded rank so far (ties: the lower
    index, the lower rank). Shared by count, one long-context request beside short ones left a rank
    idle for most of the run. Deterministic: it depends on the work list alone, so every rank computes
    the same shares without talking to the others."""
    loads = [0.0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += work[index]
        shares[rank].append(index)
    return [sorted(share) for share in shares]


# ----------------------------------------------------------------------------------------------------
# Devices


def parse_devices(entries: Sequence[str]) -> list[str]:
    """``--devices`` entries as the ``--device`` value of each rank (``cuda:0+cuda:1`` -> ``cuda:0,cuda:1``)."""
    ranks = []
    for entry in entries:
        group = [d.strip() for d in entry.split(GROUP_SEPARATOR) if d.strip()]
        if (
            not group
            or any(not _is_device(d) for d in group)
            or (len(group) > 1 and any(not d.startswith("cuda:") for d in group))
        ):
            raise UsageError(
                f"--devices entry {entry!r} is not a device like cuda:0 or "
                "cpu, or GPUs joined by + like cuda:0+cuda:1; fix the list."
            )
        ranks.append(",".join(group))
    return ranks


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except RuntimeError:
        return False
    return True


def device_for_rank(config: DoctorConfig, ranks: Ranks) -> str:
    """The ``--device`` this rank loads the pair on: its ``--devices`` entry, else ``cuda`` made
    ``cuda:<local rank>`` (one GPU per process, torchrun's convention), else ``--device`` itself."""
    if config.devices:
        entries = parse_devices(config.devices)
        if len(entries) != ranks.world_size:
            raise UsageError(
                f"--devices lists {len(entries)} ranks but torchrun started {ranks.world_size}; "
                f"give --nproc-per-node {len(entries)} or drop --devices."
            )
        return entries[ranks.rank]
    if ranks.sharded and config.device == "cuda":
        return f"cuda:{ranks.local_rank}"
    return config.device


# ----------------------------------------------------------------------------------------------------
# The sharded replay and the merge


def replay_into(
    run_dir: Path,
    meta: dict[str, Any],
    requests: Sequence[Request],
    replay: Callable[[RunWriter, Sequence[Request]], Replay],
    work: Callable[[Request], float],
) -> tuple[RunWriter, Replay]:
    """Run ``replay`` over ``requests`` into the run directory and return the open writer and the replay.
    ``work``: a request's expected cost (:func:`expected_work`), by which the ranks share them.

    In one process that is ``replay(RunWriter(run_dir), requests)``. Under torchrun each rank replays its
    share into its part (:func:`~dflash_doctor.rundir.writer.part_dir`); rank 0 returns the merged replay and
    the writer :meth:`~dflash_doctor.rundir.writer.RunWriter.from_parts` fills with every part's rows in its
    order; any other rank leaves the command here (``SystemExit(0)``) once rank 0 has its replay. The run
    directory is handed to the writer twice per rank (its part, then rank 0's merge), once in one process.
    """
    ranks = current_ranks()
    if not ranks.sharded:
        writer = RunWriter(run_dir, meta)
        try:
            return writer, replay(writer, requests)
        except BaseException as exc:
            writer.close(interrupted=isinstance(exc, KeyboardInterrupt))
            raise
    mine = [requests[i] for i in shard_requests([work(r) for r in requests], ranks.world_size)[ranks.rank]]
    with RunWriter(part_dir(run_dir, ranks.rank), meta) as part:
        result = replay(part, mine)
    for turn in result.turns:
        turn.result.tokens = []  # the token rows are in the part's tokens table; do not send them twice
    replays = _gather(result, ranks)
    if not ranks.is_main:
        raise SystemExit(0)
    merged = merge_replays(replays, requests)
    return RunWriter.from_parts(run_dir, meta, ranks.world_size, turn_order(merged)), merged


def _gather(replay: Replay, ranks: Ranks) -> list[Replay]:
    """Every rank's replay on rank 0 (a gloo group: Python objects only, whatever the ranks' devices)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    gathered: list[Any] | None = (
        [None] * ranks.world_size if ranks.is_main else None
    )  # slots gather_object fills with replays
    dist.gather_object(replay, gathered, dst=0)
    dist.barrier()
    dist.destroy_process_group()
    return list(gathered or [])


def turn_order(replay: Replay) -> dict[str, int]:
    """Position of each turn's row id in the replay's (already canonical) turn order."""
    return {turn.key: position for position, turn in enumerate(replay.turns)}


def merge_replays(replays: Sequence[Replay], requests: Sequence[Request]) -> Replay:
    """One replay of ``requests`` from the ranks' replays, in the order one process makes them: request
    by request in input order, each request's turns in order."""
    position = {request.id: index for index, request in enumerate(requests)}
    turns = sorted(
        (turn for replay in replays for turn in replay.turns), key=lambda t: (position[t.request.id], t.index)
    )
    merged = Replay(
        turns=turns,
        estimate_by_k=dict(replays[0].estimate_by_k),
        interrupted=any(r.interrupted for r in replays),
        interrupt_signal=next((r.interrupt_signal for r in replays if r.interrupt_signal is not None), None),
        full_block_matches={key: matches for replay in replays for key, matches in replay.full_block_matches.items()},
    )
    order = turn_order(merged)

    def ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return sorted(rows, key=lambda row: order[row["request_id"]])

    merged.request_rows = ordered([row for replay in replays for row in replay.request_rows])
    merged.step_rows = ordered([row for replay in replays for row in replay.step_rows])
    merged.steps_by_k = {
        k: ordered([row for replay in replays for row in replay.steps_by_k.get(k, [])]) for k in replays[0].steps_by_k
    }
    return merged


# ----------------------------------------------------------------------------------------------------
# The --devices shortcut


def launch_ranks(config: DoctorConfig, command_name: str, argv: Sequence[str] | None = None) -> int | None:
    """With ``--devices`` outside torchrun: run this command line under torchrun, one rank per entry (the
    ranks read their entry from the same flag), and return torchrun's exit code; None when there is
    nothing to launch. Without ``--out`` the run directory is made here and handed to every rank, which
    must all write the same one."""
    if not config.devices or under_torchrun():
        return None
    entries = parse_devices(config.devices)
    ranks_argv = list(sys.argv[1:] if argv is None else argv)
    if not config.out:
        ranks_argv += ["--out", str(new_run_dir(command_name))]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(len(entries)),
        "-m",
        "dflash_doctor",
        *ranks_argv,
    ]
    # torchrun gives every rank one CPU thread unless told otherwise; the replay's CPU side (token rows,
    # schedules) then runs slower than in one process, so share the cores out instead
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // len(entries)))
    # its own process group, stopped as a whole (SIGTERM first: torchrun ends its ranks) however this command ends
    return run_in_group(command, env={**os.environ, "OMP_NUM_THREADS": threads})
