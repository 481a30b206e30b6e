"""Which requests a run replays (:func:`load_workload`): a built-in set or a file, narrowed to classes and a
split, then a stratified sample of ``--max-requests`` that keeps every class represented.

Its own module because it ties the sources together: the one entry every command calls.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Sequence

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.workloads.builtin import BUILTIN_NAMES, SPLITS, load_builtin
from dflash_doctor.inputs.workloads.files import FILE_SUFFIXES, read_workload_file
from dflash_doctor.inputs.workloads.request import Request, stratified_sample


def load_workload(
    spec: str, *, classes: Sequence[str] = (), max_requests: int | None = None, seed: int = 0, split: str = "eval"
) -> list[Request]:
    """The requests to replay: a built-in name or a .jsonl/.csv/.parquet file, filtered and sampled.

    ``split`` (train | eval | all) applies to built-in sets; a user file is always used whole (keep
    your own train and eval files apart). ``classes`` keeps requests whose class OR subclass is
    listed (``code``, or the MT-Bench category ``writing``). ``max_requests`` samples at most N,
    stratified: classes get equal shares (then subclasses within a class), seeded and deterministic,
    in the workload's own order. An empty selection is a UsageError naming the input.
    """
    if split not in SPLITS:
        raise UsageError(f"split {split!r} is not one of {', '.join(SPLITS)}; pick one.")
    if max_requests is not None and max_requests < 1:
        raise UsageError(f"--max-requests {max_requests} must be at least 1.")
    if spec in BUILTIN_NAMES:
        requests = load_builtin(spec, split)
    else:
        requests = read_workload_file(_workload_path(spec))
    if classes:
        requests = _select_classes(requests, classes, spec)
    if max_requests is not None:
        requests = stratified_sample(requests, max_requests, seed)
    return requests


def _workload_path(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() not in FILE_SUFFIXES:
            raise UsageError(
                f"workload file {path} has suffix {path.suffix or '(none)'}; use a {'/'.join(FILE_SUFFIXES)} file."
            )
        return path
    close = difflib.get_close_matches(spec, BUILTIN_NAMES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UsageError(
        f"workload {spec!r} is neither a built-in workload{hint} nor an existing {'/'.join(FILE_SUFFIXES)} file; "
        f"pass one of {', '.join(BUILTIN_NAMES)} or a file path."
    )


def _select_classes(requests: list[Request], classes: Sequence[str], spec: str) -> list[Request]:
    available = {r.request_class for r in requests} | {r.subclass for r in requests if r.subclass}
    unknown = [c for c in classes if c not in available]
    if unknown:
        raise UsageError(
            f"--classes {','.join(unknown)}: workload {spec} has no request of that class; "
            f"use some of {', '.join(sorted(available))}."
        )
    wanted = set(classes)
    return [r for r in requests if r.request_class in wanted or r.subclass in wanted]
