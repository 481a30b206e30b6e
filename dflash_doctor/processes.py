"""How the doctor ends, and how the processes it starts end with it.

Exit codes are a contract a supervisor (systemd, Kubernetes, CI) can act on; every command keeps it:

* 0: done (``watch``: no alert);
* 1: the command's own finding (a failed check, a regression, an alert fired);
* 2: bad input, one sentence naming the input and the fix (:class:`dflash_doctor.errors.UsageError`);
* 70 (:data:`EXIT_CRASH`, ``EX_SOFTWARE`` of sysexits.h): the doctor crashed, a bug; the traceback is on
  stderr, and a service should be restarted;
* 128 + N: ended by signal N (130 Ctrl-C / SIGINT, 143 SIGTERM, 129 SIGHUP), after its cleanup ran.

While a command runs, SIGINT (Ctrl-C), SIGTERM and SIGHUP raise :class:`Stopped` (a
:class:`KeyboardInterrupt`) in the main thread (:func:`stop_signals_raise`), so every ``finally`` and context
manager on the way out runs: a launched server is stopped, a run directory closed and marked interrupted, its
lock given back. The three are one path: what records an interruption records it whichever signal it was,
and :func:`signal_of` keeps which one for the exit code.

A child process the doctor starts to outlive a single call (a serving engine ``tune`` launches, the
torchrun of ``--devices``: :func:`run_in_group`) is started by :func:`start_group`: in a session of its own (its own
process group, so a terminal's Ctrl-C reaches the doctor, which then stops the group in order) under a small supervisor
(:func:`supervise`, this module run as a script) that leads the group and, on Linux, gets SIGTERM as its death signal:
should the doctor be killed outright with SIGKILL, the supervisor stops the whole group, also the processes a shell
command forked. :func:`stop_group` stops the whole group: SIGTERM,
then SIGKILL to what outlives the grace period, with the stop signals held back meanwhile, so a second
SIGTERM cannot cut the cleanup short.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

EXIT_CRASH = 70
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 20.0  # how long a launched server gets to end after SIGTERM before SIGKILL
PR_SET_PDEATHSIG = 1  # linux/prctl.h: the signal a process gets when its parent dies


class Stopped(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP asked the command to end; ``exit_code`` is 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


def signal_of(interrupt: BaseException) -> int:
    """The signal behind an interrupt: :class:`Stopped`'s own, SIGINT for a plain KeyboardInterrupt (Python's
    Ctrl-C handler outside :func:`stop_signals_raise`). A number, so it survives pickling (torchrun ranks)."""
    return int(getattr(interrupt, "signum", signal.SIGINT))


def exit_code_of(interrupt: KeyboardInterrupt) -> int:
    """The exit status for an interrupt: 128 + the signal (Ctrl-C: 130, SIGTERM: 143)."""
    return 128 + signal_of(interrupt)


def _raise_stopped(signum: int, _frame: Any) -> None:
    raise Stopped(signum)


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """For the block: SIGINT, SIGTERM and SIGHUP raise :class:`Stopped` in the main thread; the handlers
    before are put back after. Outside the main thread (where no handler can be set) the block runs as it is.

    SIGINT too, not left to Python's own handler: a command started in the background of a non-interactive
    shell (``cmd &`` in a CI script) inherits SIGINT ignored, and Python then installs no handler, so a
    ``kill -INT`` (a runner's cancel) went unnoticed and the run ended and was recorded as complete. A SIGINT
    sent to this process is a request to stop, whoever sends it: it is honoured like SIGTERM, with its own
    exit code (130)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_stopped) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold the stop signals back for the block (a cleanup that must finish); any that came meanwhile are
    delivered after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _in_child() -> None:
    """In the child, between fork and exec: the stop signals unblocked (the mask is inherited, and
    :func:`start_group` holds them while it forks), and on Linux SIGTERM when the doctor dies, even by
    SIGKILL."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_group(argv: list[str], grace_s: float = STOP_GRACE_S, **popen: Any) -> subprocess.Popen:
    """Start ``argv`` in a new session (its own process group) under :func:`supervise`, the group's leader, stop
    signals held while it starts so no interrupt falls between the start and the caller's ``try``. The returned
    process is the supervisor; it ends with ``argv``'s exit status."""
    supervisor = [sys.executable, "-m", "dflash_doctor.processes", str(os.getpid()), str(grace_s), "--", *argv]
    with signals_held():
        return subprocess.Popen(supervisor, start_new_session=True, preexec_fn=_in_child, **popen)


def supervise(doctor: int, grace_s: float, argv: list[str]) -> int:
    """Run ``argv`` in this process's group and return its exit status; on SIGTERM, SIGINT or SIGHUP stop the
    whole group: SIGTERM to every member, SIGKILL to what outlives ``grace_s``.

    Why a process of its own: the death signal :func:`_in_child` sets reaches one process only, and a launch
    command such as ``source venv/bin/activate; vllm serve ...`` is a shell that forks the real server, which
    the shell's death does not end. This supervisor gets the death signal when the doctor dies, even by
    SIGKILL, and then stops every process of the group, however the command started them. ``doctor``: the
    pid that started it; a doctor already gone when the death signal was set (the signal would never come)
    stops the group at once."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stopped)
    try:
        if os.getppid() != doctor:
            raise Stopped(signal.SIGTERM)
        status = subprocess.Popen(argv).wait()  # not subprocess.call: on an interrupt it SIGKILLs the child at once
        return status if status >= 0 else 128 - status
    except Stopped as stop:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        pgid, me = os.getpgid(0), os.getpid()
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _group_alive(pgid, besides=me) and time.monotonic() < deadline:
            _reap()
            time.sleep(0.05)
        if _group_alive(pgid, besides=me):
            os.killpg(pgid, signal.SIGKILL)  # this process included
        return stop.exit_code


def _reap() -> None:
    """Collect this process's ended children (a zombie member is not alive, but it is tidier gone)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _group_alive(pgid: int, besides: int | None = None) -> bool:
    """Whether a process of group ``pgid`` (other than ``besides``) still runs. On Linux from /proc, where a
    zombie (ended, waiting for its new parent to reap it; in a container init may never do so) does not count;
    elsewhere whether the group can be signalled."""
    proc = "/proc"
    if os.path.isdir(proc):
        for entry in os.listdir(proc):
            if not entry.isdigit() or entry == str(besides):
                continue
            try:
                with open(f"{proc}/{entry}/stat", encoding="ascii", errors="replace") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group ``process`` leads, SIGKILL what outlives ``grace_s`` (engine workers
    included), and wait until the group is gone; the stop signals are held back meanwhile."""
    with signals_held():
        pgid = process.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        while _group_alive(pgid) and time.monotonic() < deadline:  # the leader's children may take longer
            time.sleep(0.05)
        if _group_alive(pgid) or process.poll() is None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait()
        settle = time.monotonic() + 5.0  # SIGKILL is not instant: wait briefly for the group to go
        while _group_alive(pgid) and time.monotonic() < settle:
            time.sleep(0.05)


def run_in_group(argv: list[str], grace_s: float = STOP_GRACE_S, **popen: Any) -> int:
    """Run ``argv`` to its end as a process group of its own and return its exit status; however the doctor
    ends meanwhile (Ctrl-C, SIGTERM, SIGHUP, an exception), the whole group is stopped before it goes on."""
    process = start_group(argv, grace_s, **popen)
    try:
        return process.wait()
    except BaseException:
        stop_group(process, grace_s)
        raise


def port_served(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections on ``host:port`` now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


if __name__ == "__main__":  # the supervisor start_group runs: DOCTOR_PID GRACE_S -- ARGV...
    sys.exit(supervise(int(sys.argv[1]), float(sys.argv[2]), sys.argv[4:]))
