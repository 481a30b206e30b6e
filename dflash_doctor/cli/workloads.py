"""`dflash-doctor workloads [show NAME]`: the built-in prompt sets, and a look at a few requests.

`show` accepts a user file too, so it doubles as a validator: a malformed line gives the same one
sentence (file and line, exit 2) that `check` would give, before any model is loaded.
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from dflash_doctor.cli.root import app
from dflash_doctor.cli.options import Classes, MaxRequests, Seed
from dflash_doctor.inputs.workloads import (
    SPLITS,
    Request,
    conversation_turns,
    list_workloads,
    load_workload,
    save_workload,
    stratified_sample,
)

PREVIEW_CHARS = 160  # of each message shown by `show`

workloads_app = typer.Typer(
    help="List the built-in prompt sets with counts per class; `show NAME` prints a few requests.",
    invoke_without_command=True,
    no_args_is_help=False,
    epilog="Examples: dflash-doctor workloads; dflash-doctor workloads show demo --count 5",
)
app.add_typer(workloads_app, name="workloads")


@workloads_app.callback()
def workloads(ctx: typer.Context) -> None:
    """List the built-in prompt sets with counts per class, split sizes, sources and licences."""
    if ctx.invoked_subcommand is not None:
        return
    table = Table(title="Built-in workloads (--workload NAME)")
    for column in ("name", "requests per class", "train / eval", "source", "licence"):
        table.add_column(column, overflow="fold")
    for info in list_workloads():
        classes = ", ".join(f"{name} {count}" for name, count in info.class_counts.items())
        table.add_row(
            f"[bold]{info.name}[/bold]\n{info.description}",
            classes,
            f"{info.split_counts['train']} / {info.split_counts['eval']}",
            info.source,
            info.licence,
        )
    Console().print(table)
    Console().print(
        "A .jsonl, .csv or .parquet file also works as --workload (see `dflash-doctor workloads show FILE`)."
    )


def _preview(text: str | None) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"


def _print_request(console: Console, request: Request) -> None:
    label = request.request_class + (f"/{request.subclass}" if request.subclass else "")
    extras = [f"{request.num_turns} turn(s)"]
    if request.max_new_tokens is not None:
        extras.append(f"max_new_tokens {request.max_new_tokens}")
    if request.chat_template_kwargs:
        extras.append(f"chat_template_kwargs {request.chat_template_kwargs}")
    if request.response is not None:
        extras.append("recorded response")
    console.print(f"[bold]{request.id}[/bold]  [cyan]{label}[/cyan]  ({', '.join(extras)})", highlight=False)
    if request.messages is None:
        console.print(f"  prompt: {_preview(request.prompt)}", highlight=False, markup=False)
        return
    last_turn = conversation_turns(request)[-1]
    for message in last_turn:
        content = "<the target's own answer>" if message["content"] is None else message["content"]
        console.print(f"  {message['role']}: {_preview(content)}", highlight=False, markup=False)


@workloads_app.command(
    "show", epilog="Example: dflash-doctor workloads show demo --classes math --count 5 --save math.jsonl"
)
def show(
    name: Annotated[str, typer.Argument(help="Built-in workload name or a .jsonl/.csv/.parquet file.")],
    count: Annotated[int, typer.Option("--count", "-n", min=1, help="How many requests to print.")] = 3,
    split: Annotated[str, typer.Option("--split", help=f"Built-in sets: {' | '.join(SPLITS)}.")] = "eval",
    classes: Classes = None,
    max_requests: MaxRequests = None,
    seed: Seed = None,
    save: Annotated[
        Optional[str],
        typer.Option("--save", help="Also write the selected requests to this .jsonl/.csv/.parquet file."),
    ] = None,
) -> None:
    """Print a few requests of a workload (stratified over classes), after the same validation as `check`."""
    requests = load_workload(
        name,
        classes=tuple(c.strip() for c in (classes or "").split(",") if c.strip()),
        max_requests=max_requests,
        seed=seed or 0,
        split=split,
    )
    console = Console()
    per_class = ", ".join(f"{c} {n}" for c, n in sorted(Counter(r.request_class for r in requests).items()))
    console.print(f"{name}: {len(requests)} requests ({per_class})", highlight=False)
    for request in stratified_sample(requests, count, seed or 0):  # every class shows when count allows
        _print_request(console, request)
    if save:
        console.print(f"wrote {len(requests)} requests to {save_workload(requests, save)}", highlight=False)
