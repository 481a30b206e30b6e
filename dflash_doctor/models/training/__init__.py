"""Train or fine-tune a DFlash draft (the recipe of DFlash, arXiv 2602.06036, below) or an EAGLE-3 head
(:mod:`.eagle3`: the same loop, data, checkpoints and evaluation, with the head's own objective) against a
frozen target.

Why this recipe: a DFlash draft proposes a whole block in ONE non-causal pass conditioned on the target's
hidden states, so it is trained in exactly that layout. Every training sequence is a prompt plus the
target's OWN greedy continuation, the tokens the target will verify against at temperature 0, so the draft
imitates the target rather than a dataset.

Each step (:func:`.loop.train_dflash_draft`):

1. a batch of sequences and random anchors inside each RESPONSE: an anchor plays the last committed token
   of a live step, so the first usable one is the first response token;
2. blocks ``[token[a], mask x (B-1)]`` go through :func:`dflash_doctor.engine.blocks.draft_block_hidden`:
   context strictly before the anchor, bidirectional inside a block, blocks blind to each other (a test
   in tests/test_live.py proves this equals the live drafter);
3. logits = the target's lm_head on slots 1..B-1, labels ``token[a + j]`` (labels past the sequence end
   are ignored); cross-entropy weighted by ``w_j = exp(-(j - 1) / gamma)``, because a miss at slot j
   throws away every later slot, so early slots are worth more;
4. AdamW, linear warm-up then cosine decay, gradient clipping; bf16 autocast on CUDA.

The target is frozen: it supplies the embeddings (block tokens and the mask row), the lm_head and the
tapped hidden states ``hidden_states[l + 1]``, which are computed once per sequence (batched) before
training and kept on the training device.

Data preparation for the CLI (:func:`.data.prepare_sequences`) regenerates responses with batched greedy
decoding and caches the token sequences on disk, so that resumes and re-runs skip generation.

Stopping and resuming: a checkpoint (:func:`.checkpoints.save_checkpoint`) is a set of files under 16 MiB,
and a resume from it is bit-exact, so a run longer than one sitting is the same command run again
(``--time-limit`` stops it cleanly at a checkpoint). ``--init-from`` starts a new run from a finished draft
(fresh AdamW moments, its own warm-up and cosine); ``--cached-data-only`` refuses to regenerate the cached
answers.

The same loop trains an EAGLE-3 head (:mod:`.eagle3`, its docstring says why its objective is the chain it
drafts; :mod:`.eagle3_head` builds a new head and saves it in the speculators layout).

The package, by job: :mod:`.hyperparams` (TrainConfig, TrainingResult), :mod:`.new_draft` (a new draft's
config, initial weights and mask token), :mod:`.sequences` (the target's own answers, cached), :mod:`.loop` (the
objective and the loop), :mod:`.checkpoints` (resumable pieces), :mod:`.evaluation` (held-out tau).
Callers import the names below from here.
"""

from dflash_doctor.models.training.hyperparams import TrainConfig, TrainingResult
from dflash_doctor.models.training.new_draft import (
    DEFAULT_NUM_TAPS,
    chat_template_record,
    choose_mask_token_id,
    draft_config_for_target,
    init_draft_from_target,
    validate_mask_token_id,
)
from dflash_doctor.models.training.sequences import (
    EVAL_SEQUENCES_FILE,
    SAMPLED_SEQUENCES_FILE,
    SELF_WRITTEN_PROMPTS_FILE,
    SEQUENCES_FILE,
    SequenceRecord,
    data_cache_key,
    prepare_sequences,
    prepare_training_data,
    sampled_sequences,
    self_written_prompts,
)
from dflash_doctor.models.training.checkpoints import (
    CHECKPOINT_DIR_NAME,
    CHECKPOINT_PIECE_BYTES,
    TRAINING_STATE_FILE,
    load_checkpoint,
    remove_checkpoint,
    save_checkpoint,
)
from dflash_doctor.models.training.loop import (
    block_loss,
    extract_features,
    sample_anchors,
    slot_weights,
    train_dflash_draft,
    train_loop,
)
from dflash_doctor.models.training.eagle3_head import (
    DEFAULT_DRAFT_VOCAB_SIZE,
    DEFAULT_TTT_STEPS,
    draft_vocabulary,
    new_eagle3_head,
    save_eagle3_head,
    speculators_config,
    vocabulary_maps,
)
from dflash_doctor.models.training.eagle3 import chain_loss, chain_rows, draft_index, train_eagle3_head
from dflash_doctor.models.training.evaluation import held_out_steps, tau_by_class

__all__ = [
    "TrainConfig",
    "TrainingResult",
    "DEFAULT_NUM_TAPS",
    "chat_template_record",
    "choose_mask_token_id",
    "draft_config_for_target",
    "init_draft_from_target",
    "validate_mask_token_id",
    "EVAL_SEQUENCES_FILE",
    "SAMPLED_SEQUENCES_FILE",
    "SELF_WRITTEN_PROMPTS_FILE",
    "SEQUENCES_FILE",
    "SequenceRecord",
    "data_cache_key",
    "prepare_sequences",
    "prepare_training_data",
    "sampled_sequences",
    "self_written_prompts",
    "CHECKPOINT_DIR_NAME",
    "CHECKPOINT_PIECE_BYTES",
    "TRAINING_STATE_FILE",
    "load_checkpoint",
    "remove_checkpoint",
    "save_checkpoint",
    "block_loss",
    "extract_features",
    "sample_anchors",
    "slot_weights",
    "train_dflash_draft",
    "train_loop",
    "DEFAULT_DRAFT_VOCAB_SIZE",
    "DEFAULT_TTT_STEPS",
    "draft_vocabulary",
    "new_eagle3_head",
    "save_eagle3_head",
    "speculators_config",
    "vocabulary_maps",
    "chain_loss",
    "chain_rows",
    "draft_index",
    "train_eagle3_head",
    "held_out_steps",
    "tau_by_class",
]
