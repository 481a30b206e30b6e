"""The replay progress bar: requests done, generated tokens/s and the running tau (bonus included).

The pipeline knows nothing of the terminal; the CLI hands it :func:`progress_bar` as its progress factory.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflash_doctor.engine.live import GenerationResult


def progress_bar(console: Console) -> Callable[[int], AbstractContextManager[Callable[[GenerationResult], None]]]:
    """A progress factory for :mod:`dflash_doctor.pipeline`: ``factory(total_turns)`` opens the bar and
    yields the per-turn callback."""

    @contextmanager
    def factory(total_turns: int) -> Iterator[Callable[[GenerationResult], None]]:
        bar = Progress(
            TextColumn("[bold]replay"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(), console=console, transient=False,
        )
        task = bar.add_task("replay", total=total_turns, stats="")
        totals = {"tokens": 0, "drafts": 0, "accepted": 0}
        started = time.perf_counter()

        def on_turn(result: GenerationResult) -> None:
            drafts = [s for s in result.steps if s.num_drafted > 0]
            totals["tokens"] += len(result.output_ids)
            totals["drafts"] += len(drafts)
            totals["accepted"] += sum(s.num_accepted for s in drafts)
            rate = totals["tokens"] / max(time.perf_counter() - started, 1e-9)
            tau = 1 + totals["accepted"] / totals["drafts"] if totals["drafts"] else float("nan")
            bar.update(task, advance=1, stats=f"{rate:6.1f} tok/s  tau {tau:.2f}")

        with bar:
            yield on_turn

    return factory
