"""The replay progress bar: requests done, generated tokens/s and the running tau (bonus included); a
spinner line for each long step without a count (model loading, GGUF conversion, pricing the sweep).

The pipeline knows nothing of the terminal; the CLI hands it :func:`progress_bar` as its progress factory,
through :func:`run_with_progress`, which also gives check, sweep and replay one way to end on Ctrl-C.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager
from typing import Callable, Iterator, TypeVar

import typer

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from dflash_doctor.engine.live import GenerationResult
from dflash_doctor.cli.log_setup import progress_shown
from dflash_doctor.pipeline import ProgressFactory, no_progress
from dflash_doctor.processes import exit_code_of
from dflash_doctor.stages import StageListener, on_stage


def progress_bar(console: Console) -> Callable[[int], AbstractContextManager[Callable[[GenerationResult], None]]]:
    """A progress factory for :mod:`dflash_doctor.pipeline`: ``factory(total_turns)`` opens the bar and
    yields the per-turn callback."""

    @contextmanager
    def factory(total_turns: int) -> Iterator[Callable[[GenerationResult], None]]:
        bar = Progress(
            TextColumn("[bold]replay"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
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


def stage_indicator(console: Console) -> StageListener:
    """A stage listener (dflash_doctor.stages): a spinner line per stage with its elapsed time, kept
    (ticked) when the stage ends, so the terminal shows where the minutes before the replay went.
    Nested stages share the outermost one's display (Rich allows one live display at a time)."""
    shown: list[Progress] = []  # the display of the outermost stage running, if any

    @contextmanager
    def indicator(description: str) -> Iterator[None]:
        outermost = not shown
        if outermost:
            shown.append(
                Progress(
                    SpinnerColumn(finished_text="[green]✓"),
                    TextColumn("{task.description}"),
                    TimeElapsedColumn(),
                    console=console,
                )
            )
            shown[0].start()
        task = shown[0].add_task(description, total=1)
        try:
            yield
        finally:
            shown[0].update(task, completed=1)
            if outermost:
                shown.pop().stop()

    return indicator


Outcome = TypeVar("Outcome")


def run_with_progress(command: Callable[[ProgressFactory], Outcome]) -> Outcome:
    """Run one pipeline command with the progress bar on stderr (none with -q). Ctrl-C: the pipeline has closed the run
    directory with every finished request (run.json says ``interrupted``), so say so and exit 128 + the signal
    (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP; no traceback)."""
    console = Console(stderr=True)
    try:
        if not progress_shown():
            return command(no_progress)
        with on_stage(stage_indicator(console)):
            return command(progress_bar(console))
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP (dflash_doctor.processes): 128 + the signal
        console.print("[yellow]interrupted[/]: finished requests are kept in the run directory")
        raise typer.Exit(exit_code_of(exc))
