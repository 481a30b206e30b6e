"""`dflash-doctor dashboard [RUNS_DIR]`: serve the Streamlit dashboard over a folder of run directories.

The app reads run directories only (no model is loaded), so the command just validates its inputs,
prints the URL and runs ``python -m streamlit run <app/main.py>`` as its child until it is stopped.
The folder reaches the app through the :data:`dflash_doctor.app.RUNS_DIR_ENV` environment variable.

Stopping the command stops the server: a service manager or a CI step sends SIGTERM to the command
only, and a server left behind keeps the port. So the server runs in its own process group, the
command forwards SIGINT, SIGTERM and SIGHUP to that group and waits for it, and on Linux the server
is also told to stop when the command dies without a chance to forward (``kill -9``, out of memory).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

import dflash_doctor.app as dashboard_app
from dflash_doctor.app import RUNS_DIR_ENV
from dflash_doctor.cli.root import app
from dflash_doctor.errors import UsageError

DEFAULT_PORT = 8501
DEFAULT_HOST = "127.0.0.1"


def app_main_path() -> Path:
    """The Streamlit entry script, wherever the package is installed (``dflash_doctor/app/main.py``)."""
    return Path(dashboard_app.__file__).resolve().parent / "main.py"


def streamlit_command(host: str, port: int) -> list[str]:
    """The exact command the dashboard runs: headless (no browser opened), no usage statistics."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(app_main_path()),
        "--server.headless",
        "true",
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--browser.gatherUsageStats",
        "false",
        "--server.fileWatcherType",
        "none",
        "--client.toolbarMode",
        "viewer",  # no "Deploy" button: this is a local viewer
    ]


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on host:port (checked before starting, so the error is ours, not a traceback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


@app.command("dashboard", epilog="Example: dflash-doctor dashboard runs --port 8501")
def dashboard(
    runs_dir: Annotated[
        Optional[Path],
        typer.Argument(help="A folder of run directories, or one run directory (default: ./runs).", show_default=False),
    ] = None,
    port: Annotated[int, typer.Option("--port", help="Port to serve on.")] = DEFAULT_PORT,
    host: Annotated[
        str, typer.Option("--host", help="Address to bind; keep 127.0.0.1 unless you mean to share the run data.")
    ] = DEFAULT_HOST,
) -> None:
    """Launch the interactive dashboard: rejection by class, positions, tokens, sweep and run comparison."""
    folder = runs_dir if runs_dir is not None else Path("runs")
    if runs_dir is not None and not runs_dir.is_dir():
        raise UsageError(
            f"RUNS_DIR {runs_dir} is not a folder; pass a folder of run directories (e.g. runs/) or one run directory."
        )
    if not 1 <= port <= 65535:
        raise UsageError(f"--port {port} is outside 1-65535; pass a free port such as {DEFAULT_PORT}.")
    if not port_is_free(host, port):
        raise UsageError(
            f"--port {port} on {host} is already in use (or the address is not local); pass another --port."
        )
    env = {**os.environ, RUNS_DIR_ENV: str(folder.resolve())}
    typer.echo(f"dflash-doctor dashboard: http://{host}:{port}  (runs from {folder.resolve()}; Ctrl-C to stop)")
    returncode, stopped = serve(streamlit_command(host, port), env)
    if not stopped and returncode != 0:
        raise typer.Exit(returncode)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # linux/prctl.h: the signal a process gets when its parent dies


def _stop_when_parent_dies() -> None:
    """In the server, between fork and exec: SIGTERM when the command dies, even by SIGKILL (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def serve(command: list[str], env: dict[str, str]) -> tuple[int, bool]:
    """Run ``command`` in its own process group until it ends; a stop signal sent to this process is
    forwarded to the whole group, and then we wait for the group's leader to finish.

    Returns (the server's exit status, whether a stop signal asked for the end): a requested stop is not
    a failure, however the server reports it.
    """
    server = subprocess.Popen(
        command,
        env=env,
        process_group=0,
        preexec_fn=_stop_when_parent_dies if sys.platform.startswith("linux") else None,
    )
    stopped = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopped
        stopped = True
        try:
            os.killpg(server.pid, signum)
        except ProcessLookupError:
            pass  # the server already ended

    previous = {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS}
    try:
        returncode = server.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return returncode, stopped
