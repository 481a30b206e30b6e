"""The server each K of the grid is measured on: launched by the doctor, or run by the user.

``--launch 'COMMAND ... {k} ...'`` is a shell command line; ``{k}`` is replaced by K (plain text
replacement, so the braces of a JSON ``--speculative-config`` need no escaping). K = 0 is the same
server without speculation, which no substitution can express for every engine (vLLM drops a whole
``--speculative-config``, llama.cpp its ``-md``), so it is its own command: ``--launch-baseline``. The
doctor starts each command in a new session (its own process group), waits until ``GET /v1/models``
answers at ``--engine URL``, measures, then stops the group: SIGTERM, SIGKILL after a grace period. The
group is stopped however tune ends: done, an error, Ctrl-C, SIGTERM or SIGHUP
(:mod:`dflash_doctor.processes`). A port that answers before the launch is refused: whatever serves it
(another server, or one left over from a tune killed with SIGKILL) would be measured instead of the
launched one. The server's output goes to ``server-k<K>.log`` in the run directory, redacted as it is copied
(:mod:`dflash_doctor.tune.secrets`).

Without ``--launch``, ``--engine`` lists one running server per K: ``0=http://h:8000,8=http://h:8001``.
"""

from __future__ import annotations

import subprocess
import time
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dflash_doctor.errors import UsageError
from dflash_doctor.processes import port_served, start_group, stop_group
from dflash_doctor.serving.client import ServerEndpoint, auth_fix
from dflash_doctor.serving.http import AUTH_STATUSES, Unreachable
from dflash_doctor.tune.secrets import copy_redacted, known_secrets
from dflash_doctor.urls import shown

K_PLACEHOLDER = "{k}"
#: How long the stopped server's last output may take to reach its log
COPY_DRAIN_S = 10.0


@dataclass(frozen=True)
class ServerPlan:
    """How to reach the server for one K: a command to launch (None: the user runs it) and its URL."""

    k: int
    url: str
    command: str | None = None


def plan_servers(
    grid: tuple[int, ...], engine: str | None, launch: str | None, launch_baseline: str | None
) -> list[ServerPlan]:
    """One plan per K of the grid from the flags; every inconsistency is one UsageError sentence."""
    if launch is not None:
        if K_PLACEHOLDER not in launch:
            raise UsageError(
                f"--launch {launch!r} has no {K_PLACEHOLDER} placeholder; "
                "put it where the command sets the number of draft tokens."
            )
        if not engine or "=" in engine:
            raise UsageError(
                "--launch needs --engine URL: the one address the "
                "launched server listens on, e.g. http://127.0.0.1:8000."
            )
        if 0 in grid and not launch_baseline:
            raise UsageError(
                "the K grid holds 0 (speculation off) but --launch-baseline is "
                "missing; give the same command without the draft, or drop 0 from --k."
            )
        return [
            ServerPlan(k, engine, launch_baseline if k == 0 else launch.replace(K_PLACEHOLDER, str(k))) for k in grid
        ]
    if launch_baseline is not None:
        raise UsageError(
            "--launch-baseline is only used with --launch; give "
            "both, or list running servers with --engine 0=URL,8=URL."
        )
    if not engine:
        raise UsageError(
            "tune needs servers: --launch 'COMMAND {k}' with --launch-baseline "
            "and --engine URL, or --engine 0=URL,8=URL for servers you run."
        )
    urls: dict[int, str] = {}
    for item in engine.split(","):
        k_text, sep, url = item.partition("=")
        try:
            k = int(k_text)
        except ValueError:
            k = -1
        if not sep or k < 0 or not url.strip():
            raise UsageError(
                f"--engine {engine!r}: without --launch it lists one running server "
                "per K as K=URL, e.g. 0=http://127.0.0.1:8000,8=http://127.0.0.1:8001."
            )
        urls[k] = url.strip()
    missing = [k for k in grid if k not in urls]
    if missing:
        raise UsageError(
            f"--engine names no server for K {missing}; add K=URL for each K of --k ({', '.join(map(str, grid))})."
        )
    return [ServerPlan(k, urls[k]) for k in grid]


def wait_healthy(
    url: str, process: subprocess.Popen | None, timeout_s: float, log_path: Path | None, api_key: str | None = None
) -> None:
    """Poll ``GET /v1/models`` (with the API key, if any) until it answers 200; the process dying, the time
    running out or the server refusing the key (401/403: waiting would not change that) is a UsageError."""
    deadline = time.monotonic() + timeout_s
    endpoint = ServerEndpoint(
        base_url=url.rstrip("/"), api_key=api_key, timeout_s=5.0, retries=0
    )  # the loop is the retry
    while True:
        try:
            answer = endpoint.client.get(endpoint.base_url + "/v1/models")
            if answer.ok:
                return
            if answer.status in AUTH_STATUSES:
                raise UsageError(f"{shown(url)} answered HTTP {answer.status} to GET /v1/models: {auth_fix(endpoint)}.")
        except Unreachable:
            pass
        where = f"; its output is in {log_path}" if log_path else ""
        if process is not None and process.poll() is not None:
            raise UsageError(
                f"the launched server exited with code {process.returncode} "
                f"before {shown(url)} answered{where}; fix the --launch command."
            )
        if time.monotonic() > deadline:
            raise UsageError(
                f"{shown(url)} did not answer GET /v1/models within "
                f"{timeout_s:.0f} s{where}; fix the URL or raise --start-timeout."
            )
        time.sleep(1.0)


def refuse_served_port(url: str) -> None:
    """A launch must not find its port served already: that server, not the launched one, would answer."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)
    if port_served(host, port):
        raise UsageError(
            f"--engine {shown(url)}: port {port} is already served before tune launched its server (another server, "
            "or one left behind by an earlier run); stop what listens on port "
            f"{port} or pass a free port in --engine and the --launch commands."
        )


@contextmanager
def serving(plan: ServerPlan, log_path: Path, start_timeout_s: float, api_key: str | None = None) -> Iterator[str]:
    """The server of one K, healthy, for the time of the block; a launched one is stopped after it."""
    if plan.command is None:
        wait_healthy(plan.url, None, start_timeout_s, None, api_key)
        yield plan.url
        return
    refuse_served_port(plan.url)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    process = start_group(["bash", "-c", plan.command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert process.stdout is not None
    copier = copy_redacted(process.stdout, log_path, known_secrets(plan.command, api_key))
    try:
        wait_healthy(plan.url, process, start_timeout_s, log_path, api_key)
        yield plan.url
    finally:
        stop_group(process)
        # the output ends with the group; a child that left the group may hold the pipe open: give up on it
        copier.join(timeout=COPY_DRAIN_S)
