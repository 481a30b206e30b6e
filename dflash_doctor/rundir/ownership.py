"""Who may write a run directory: one process at a time, and never over an earlier run unasked.

Two commands writing one ``--out`` at once lose both runs (one clears the journal the other is
writing), and a reused ``--out`` would replace an earlier run without a word. :func:`claim_run_dir`
runs first thing in every command that writes a run directory, before any model is loaded:

* the folder's lock file (:data:`LOCK_FILE`, created with ``O_EXCL``, holding the owner's pid) is
  taken for this process; a lock whose process is gone (killed, crashed) is stale and taken over, a
  live owner's lock refuses the command in one sentence;
* a folder that already holds files (an earlier run, or anything else) is refused unless the user
  passed ``--overwrite``; the writer then replaces the run's tables (the folder is never deleted);
* a command whose output grows across processes names what it goes on with (``continuable``): a
  ``watch`` continues the earlier watch in its folder (a service restarted on the same ``--out``), a
  ``train-draft`` resumes its checkpoint; ``--overwrite`` then starts afresh instead, and a folder
  holding anything else is refused as above.

The lock goes when the writer closes (:func:`release_run_dir`) or when the process exits. A command
given no ``--out`` writes a folder of its own (:func:`new_run_dir`), which no other process shares.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import errno
import os
from collections.abc import Callable
from pathlib import Path

from dflash_doctor.errors import UsageError

LOCK_FILE = ".dflash-doctor.lock"


def _owner(lock: Path) -> int | None:
    """The pid written in a lock file; None when it cannot be read (being written, or garbage)."""
    try:
        return int(lock.read_text(encoding="ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _take(lock: Path) -> bool:
    """Create the lock file with our pid if nobody has it (atomic: O_EXCL); False when it exists."""
    try:
        descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except OSError as exc:
        if exc.errno == errno.EEXIST:
            return False
        raise
    with os.fdopen(descriptor, "w", encoding="ascii") as handle:
        handle.write(f"{os.getpid()}\n")
    return True


def _lock(run_dir: Path) -> None:
    """Hold the folder's lock for this process: free, ours already, or stale (its owner is gone)."""
    lock = run_dir / LOCK_FILE
    for _ in range(2):  # a stale lock is removed once and taken again; a racer that wins refuses us
        if _take(lock):
            atexit.register(release_run_dir, run_dir)
            return
        owner = _owner(lock)
        if owner == os.getpid():
            return
        if owner is not None and _alive(owner):
            raise UsageError(
                f"--out {run_dir} is being written by another dflash-doctor process (pid {owner}); "
                f"wait for it to finish or pass another --out."
            )
        lock.unlink(missing_ok=True)  # stale: its process is gone
    raise UsageError(
        f"--out {run_dir} was claimed by another dflash-doctor process at the same moment; pass another --out."
    )


def claim_run_dir(
    run_dir: Path | str, *, overwrite: bool = False, continuable: Callable[[Path], bool] | None = None
) -> bool:
    """Take ``run_dir`` for this process before any work, or refuse in one sentence (see the module doc).

    Returns whether the command goes on with what the folder holds: ``continuable`` (the command's own
    earlier output, recognised by it) said so and ``--overwrite`` was not given."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--out {run_dir} is a file, not a folder; pass a folder for the run directory.")
    if run_dir.is_symlink() and not run_dir.exists():
        raise UsageError(
            f"--out {run_dir} is a link to {os.readlink(run_dir)}, which does not exist; "
            f"create that folder or pass another --out."
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        _lock(run_dir)
    except OSError as exc:  # a folder the user cannot write (/proc/x, read-only, another user's): bad input
        raise UsageError(
            f"--out {run_dir} cannot be written ({exc.strerror}); pass a folder you can write to."
        ) from None
    if overwrite or not any(entry.name != LOCK_FILE for entry in run_dir.iterdir()):
        return False
    if continuable is not None and continuable(run_dir):
        return True
    release_run_dir(run_dir)
    raise UsageError(
        f"--out {run_dir} already holds files (an earlier run?); pass a new folder, "
        f"or --overwrite to replace the run in it."
    )


def new_run_dir(command: str, parent: Path = Path("runs")) -> Path:
    """A fresh folder for a run given no ``--out``: ``runs/<command>-<YYYYmmdd-HHMMSS>`` in local time, made
    here. ``mkdir`` fails on a folder that exists, so two commands started in the same second (a script
    running checks in parallel) get two folders, the later one suffixed ``-2``, ``-3``, ..., instead of
    one refusing the other or both writing one."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    number = 1
    try:
        parent.mkdir(parents=True, exist_ok=True)
        while True:
            candidate = parent / (f"{command}-{stamp}" if number == 1 else f"{command}-{stamp}-{number}")
            try:
                candidate.mkdir()
                return candidate
            except FileExistsError:
                number += 1
    except OSError as exc:  # a working directory the user cannot write in (or `runs` is a file)
        raise UsageError(
            f"no run directory can be made in {parent} ({exc.strerror}); pass --out a folder you can write to."
        ) from None


def release_run_dir(run_dir: Path | str) -> None:
    """Give the lock back if this process holds it (a lock of another process is left alone); a folder
    left empty (the command was refused before it wrote anything) goes with it."""
    lock = Path(run_dir) / LOCK_FILE
    if _owner(lock) == os.getpid():
        lock.unlink(missing_ok=True)
        if not any(Path(run_dir).iterdir()):
            Path(run_dir).rmdir()
