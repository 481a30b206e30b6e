"""`dflash-doctor train-draft`: train or fine-tune a DFlash draft (z-lab checkpoint layout) or, with
``--draft-kind eagle3``, an EAGLE-3 head (speculators layout, served by vLLM with ``"method": "eagle3"``)
against a target.

The flags become a :class:`~dflash_doctor.models.training.request.TrainDraftRequest` and the training
pipeline (:func:`dflash_doctor.models.training.pipeline.train_draft`) does the rest: the target's own
answers (cached in the out dir), the kind's draft, training, held-out tau, the model card. The out dir ends
up holding the draft (config.json + model.safetensors), a model card README.md, training_log.json, the
cached sequences and the resumable ``checkpoint/`` (files under 16 MiB:
:func:`dflash_doctor.models.training.checkpoints.save_checkpoint`); running the same command again resumes
bit for bit or, when finished, only rewrites the outputs. A longer run from a finished draft is a new run
started from it (``--init-from <out> --out <new>``): ``--steps`` lays out the cosine schedule, so a resume
with other steps is refused.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dflash_doctor.cli.options import Classes, MaxRequests, Seed, Target, Workload
from dflash_doctor.cli.root import app
from dflash_doctor.inputs.config import Dtype
from dflash_doctor.models.training import DEFAULT_DRAFT_VOCAB_SIZE, DEFAULT_NUM_TAPS, DEFAULT_TTT_STEPS
from dflash_doctor.models.training.pipeline import TrainingOutcome, train_draft as run_training
from dflash_doctor.models.training.request import DEFAULT_OUT, TrainDraftRequest


@app.command(
    "train-draft",
    epilog=(
        "Example: dflash-doctor train-draft --target ./target --workload prompts.jsonl --steps 2000 --out ./my-draft"
    ),
)
def train_draft(
    target: Target = None,
    workload: Workload = None,
    classes: Classes = None,
    max_requests: MaxRequests = None,
    draft_kind: Annotated[
        str,
        typer.Option(
            "--draft-kind",
            help=(
                "dflash: a DFlash draft (z-lab layout); eagle3: an "
                "EAGLE-3 head (speculators layout, vLLM method eagle3)."
            ),
        ),
    ] = "dflash",
    aux_layer_ids: Annotated[
        Optional[str],
        typer.Option(
            "--aux-layer-ids",
            help=(
                "eagle3: target layers the head reads, vLLM's meaning (id k = the "
                "state entering layer k), e.g. 8,16,24 (default vLLM's 2,L//2,L-3)."
            ),
        ),
    ] = None,
    draft_vocab_size: Annotated[
        Optional[int],
        typer.Option(
            "--draft-vocab-size",
            help=(
                "eagle3: draft vocabulary, the most frequent response tokens "
                f"(default min({DEFAULT_DRAFT_VOCAB_SIZE}, target vocabulary))."
            ),
        ),
    ] = None,
    ttt_steps: Annotated[
        Optional[int],
        typer.Option(
            "--ttt-steps",
            help=(
                "eagle3: chain slots trained (training-time test) and the "
                f"K written into config.json (default {DEFAULT_TTT_STEPS})."
            ),
        ),
    ] = None,
    block_size: Annotated[
        Optional[int],
        typer.Option("--block-size", help="Tokens per block: the anchor + up to B-1 drafts (default 16)."),
    ] = None,
    num_layers: Annotated[
        Optional[int], typer.Option("--num-layers", help="Draft transformer layers (default 2).")
    ] = None,
    target_layer_ids: Annotated[
        Optional[str],
        typer.Option(
            "--target-layer-ids",
            help=f"Target layers to tap, e.g. 1,9,17,25 (default: {DEFAULT_NUM_TAPS} spread from 1 to L-3).",
        ),
    ] = None,
    mask_token_id: Annotated[
        Optional[int],
        typer.Option(
            "--mask-token-id", help="Reserved token id used as mask (default: the highest free special token)."
        ),
    ] = None,
    init_from: Annotated[
        Optional[str],
        typer.Option(
            "--init-from",
            help=(
                "A draft of --draft-kind to start from (fine-tune after a target update, or continue "
                "a finished run with a fresh optimizer and schedule); keeps its architecture."
            ),
        ),
    ] = None,
    init_from_target: Annotated[
        bool,
        typer.Option(
            "--init-from-target",
            help="Start the draft's layers and final norm from the target's last layers (same width).",
        ),
    ] = False,
    steps: Annotated[
        int,
        typer.Option(
            "--steps", help="Optimizer steps: the length of the warm-up + cosine schedule, fixed for the run's resumes."
        ),
    ] = 2000,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW, warm-up then cosine).")] = 6e-4,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per step.")] = 16,
    anchors_per_sequence: Annotated[
        int, typer.Option("--anchors-per-sequence", help="Blocks trained per sequence per step.")
    ] = 16,
    loss_decay_gamma: Annotated[float, typer.Option("--loss-decay-gamma", help="Slot weight exp(-(j-1)/gamma).")] = 7.0,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", help="Response length the target regenerates per turn.")
    ] = 256,
    use_recorded_responses: Annotated[
        bool,
        typer.Option(
            "--use-recorded-responses", help="Train on the workload's recorded `response`s instead of regenerating."
        ),
    ] = False,
    chat_template: Annotated[
        Optional[str], typer.Option("--chat-template", help="A .jinja file overriding the target's chat template.")
    ] = None,
    eval_requests: Annotated[
        int,
        typer.Option(
            "--eval-requests",
            help="Held-out requests (eval split of a built-in workload) measured for the model card; 0 = none.",
        ),
    ] = 48,
    generation_batch_size: Annotated[
        int, typer.Option("--generation-batch-size", help="Prompts per batched generate.")
    ] = 32,
    extra_word_problems: Annotated[
        int,
        typer.Option(
            "--extra-word-problems",
            help="More generated GSM-style math prompts (train templates only) on top of the workload.",
        ),
    ] = 0,
    self_written_prompts: Annotated[
        int,
        typer.Option(
            "--self-written-prompts",
            help="Chat prompts the target writes itself (from an empty user turn), answered like the rest.",
        ),
    ] = 0,
    samples_per_prompt: Annotated[
        int,
        typer.Option(
            "--samples-per-prompt", help="Extra sampled answers per prompt (more data against memorising a small pool)."
        ),
    ] = 0,
    sample_temperature: Annotated[
        float, typer.Option("--sample-temperature", help="Temperature of the extra sampled answers.")
    ] = 0.8,
    cached_data_only: Annotated[
        bool,
        typer.Option(
            "--cached-data-only",
            help=(
                "Train on the answers already cached in --out (carried from "
                "the run that made them); refuse instead of generating any."
            ),
        ),
    ] = False,
    time_limit: Annotated[
        Optional[float],
        typer.Option(
            "--time-limit",
            help=(
                "Wall seconds from the start after which training stops at the next loss-log row "
                "(checkpoint written, held-out pass and outputs as usual); the same command goes on later."
            ),
        ),
    ] = None,
    checkpoint_every: Annotated[
        int, typer.Option("--checkpoint-every", help="Steps between resumable checkpoints.")
    ] = 500,
    device: Annotated[
        Optional[str], typer.Option("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available, else cpu).")
    ] = None,
    dtype: Annotated[
        Optional[Dtype], typer.Option("--dtype", help="Target dtype.", show_default="bfloat16 on CUDA, float32 on CPU")
    ] = None,
    seed: Seed = None,
    batch_seed: Annotated[
        Optional[int],
        typer.Option(
            "--batch-seed",
            help=(
                "Seed of the batches and anchors drawn each step (default: --seed, which also seeds the "
                "data). Give each --init-from continuation its own, or it redraws the earlier run's batches."
            ),
        ),
    ] = None,
    out: Annotated[
        str,
        typer.Option(
            "--out",
            help=(
                "Output folder: the draft, its model card, caches and checkpoint/ (an "
                "earlier train-draft there is resumed; every file of it under 16 MiB)."
            ),
        ),
    ] = DEFAULT_OUT,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help=(
                "Train afresh in --out: an earlier training's checkpoint there is removed (cached target "
                "responses are reused when they match) and a folder holding other files is written into. Without "
                "it an earlier train-draft in --out is resumed and a folder holding anything else is refused."
            ),
        ),
    ] = False,
) -> None:
    """Train or fine-tune a DFlash draft or an EAGLE-3 head against a target; writes the checkpoint and a model card.

    --out is this process's while it runs: a second train-draft (or any dflash-doctor command) on it
    exits 2; a folder left by a killed one is taken over.
    """
    from rich.console import Console

    console = Console(stderr=True)
    outcome = run_training(
        TrainDraftRequest(
            target=target,
            workload=workload,
            classes=classes,
            max_requests=max_requests,
            draft_kind=draft_kind,
            aux_layer_ids=aux_layer_ids,
            draft_vocab_size=draft_vocab_size,
            ttt_steps=ttt_steps,
            block_size=block_size,
            num_layers=num_layers,
            target_layer_ids=target_layer_ids,
            mask_token_id=mask_token_id,
            init_from=init_from,
            init_from_target=init_from_target,
            steps=steps,
            lr=lr,
            batch_size=batch_size,
            anchors_per_sequence=anchors_per_sequence,
            loss_decay_gamma=loss_decay_gamma,
            max_new_tokens=max_new_tokens,
            use_recorded_responses=use_recorded_responses,
            chat_template=chat_template,
            eval_requests=eval_requests,
            generation_batch_size=generation_batch_size,
            extra_word_problems=extra_word_problems,
            self_written_prompts=self_written_prompts,
            samples_per_prompt=samples_per_prompt,
            sample_temperature=sample_temperature,
            cached_data_only=cached_data_only,
            time_limit=time_limit,
            checkpoint_every=checkpoint_every,
            device=device,
            dtype=dtype,
            seed=seed,
            batch_seed=batch_seed,
            out=out,
            overwrite=overwrite,
        ),
        say=console.print,
    )
    _print_outcome(outcome, console)


def _print_outcome(outcome: TrainingOutcome, console) -> None:
    """The final loss, a --time-limit stop, and the held-out tau per class before and after training."""
    from rich.table import Table

    console.print(f"final loss {outcome.final_loss:.4f} after {outcome.final_step} of {outcome.steps} steps")
    if outcome.final_step < outcome.steps:
        console.print(
            f"--time-limit stopped training at step {outcome.final_step}; run the same command again to go "
            "on from its checkpoint."
        )
    evaluation = outcome.evaluation
    if evaluation:
        table = Table(title=f"draft written to {outcome.out_dir}")
        table.add_column("class")
        table.add_column("tau (trained)", justify="right")
        table.add_column("tau (before)", justify="right")
        for name, row in evaluation["trained"].items():
            table.add_row(name, f"{row['tau']:.2f}", f"{evaluation['initial'][name]['tau']:.2f}")
        console.print(table)
