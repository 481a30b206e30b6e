"""What ``train-draft`` was asked: one typed object from the CLI's flags to the training pipeline.

The fields are the command's flags under their parameter names, with the same defaults, as given: the
pipeline (:func:`dflash_doctor.models.training.pipeline.train_draft`) checks them and fills the ones left
to it (device, dtype, seed, workload), so a caller other than the CLI meets the same refusals. Flags that
shape one draft kind only are named by that kind's :class:`~dflash_doctor.models.training.recipes.TrainingRecipe`.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_OUT = "dflash-draft"


@dataclass(frozen=True)
class TrainDraftRequest:
    """``dflash-doctor train-draft``'s flags (``--flag-name`` is ``flag_name``; docs/training.md describes them)."""

    target: str | None = None
    workload: str | None = None
    classes: str | None = None
    max_requests: int | None = None
    draft_kind: str = "dflash"
    aux_layer_ids: str | None = None  # eagle3; comma-separated, parsed by the pipeline
    draft_vocab_size: int | None = None  # eagle3
    ttt_steps: int | None = None  # eagle3
    block_size: int | None = None  # dflash
    num_layers: int | None = None  # dflash
    target_layer_ids: str | None = None  # dflash; comma-separated, parsed by the pipeline
    mask_token_id: int | None = None  # dflash
    init_from: str | None = None
    init_from_target: bool = False  # dflash
    steps: int = 2000
    lr: float = 6e-4
    batch_size: int = 16
    anchors_per_sequence: int = 16
    loss_decay_gamma: float = 7.0
    max_new_tokens: int = 256
    use_recorded_responses: bool = False
    chat_template: str | None = None
    eval_requests: int = 48
    generation_batch_size: int = 32
    extra_word_problems: int = 0
    self_written_prompts: int = 0
    samples_per_prompt: int = 0
    sample_temperature: float = 0.8
    cached_data_only: bool = False
    time_limit: float | None = None
    checkpoint_every: int = 500
    device: str | None = None
    dtype: str | None = None
    seed: int | None = None
    batch_seed: int | None = None
    out: str = DEFAULT_OUT
    overwrite: bool = False
