"""Tiny models built from configs in-process (no downloads): a Llama-style target and drafts for it, the
ChatML word-level tokenizer that goes with them and a workload file of their words."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_doctor.engine.dflash_model import DFlashConfig, DFlashDraftModel
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel

VOCAB = 97
PROMPT = [1, 17, 42, 8, 9, 30, 31, 44]
TEACHER_PROMPTS = [[5, 17, 42, 8, 9], [11, 12], [60, 61, 62, 63, 64, 65, 66, 67]]  # the teacher-forcing tests' prompts
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] "
    "+ '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ids 0, 1, 2 are the tiny target's pad, bos and eos; 3 is the DFlash draft's mask token
SPECIAL_TOKENS = ["<pad>", "<s>", "<|im_end|>", "<mask>", "<|im_start|>", "<unk>"]
ROLE_WORDS = ["system", "user", "assistant"]
CLASSES = ("math", "code", "chat")


def tiny_tokenizer(vocab_size: int = VOCAB):
    """A WordLevel tokenizer over ``vocab_size`` ids with ChatML specials and a ChatML chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS) - len(ROLE_WORDS))]
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + ROLE_WORDS + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHATML,
    )


def write_workload(path: Path, per_class: int) -> Path:
    lines = [
        json.dumps(
            {"id": f"{cls}-{i}", "class": cls, "messages": [{"role": "user", "content": f"w{i} w{i + 7} w{i + 3} w9"}]}
        )
        for cls in CLASSES
        for i in range(per_class)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside the block, the caller's setting restored after it. Tiny
    models want 1 (on a busy 2-core machine thread hand-offs cost more than their matmuls); a test module
    sets it for its own fixtures and tests only."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def tiny_target(seed: int = 0, *, vocab: int = VOCAB, hidden: int = 32, layers: int = 4) -> LlamaForCausalLM:
    """A random 4-layer target whose logits are peaked enough that argmax ties never happen."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def tiny_dflash(
    target: LlamaForCausalLM,
    seed: int = 1,
    *,
    block_size: int = 6,
    layer_ids=(0, 2),
    num_layers: int = 2,
    mask_token_id: int = 3,
    layer_types=None,
    sliding_window=None,
) -> DFlashDraftModel:
    torch.manual_seed(seed)
    tc = target.config
    cfg = DFlashConfig(
        hidden_size=tc.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=2 * tc.hidden_size,
        vocab_size=tc.vocab_size,
        block_size=block_size,
        target_layer_ids=list(layer_ids),
        mask_token_id=mask_token_id,
        num_target_layers=tc.num_hidden_layers,
        rope_theta=10000.0,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    model = DFlashDraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.eval()


@torch.no_grad()
def first_block_logits(draft: DFlashDraftModel, target: LlamaForCausalLM) -> torch.Tensor:
    """The scores of the first block the DFlash proposer drafts after :data:`PROMPT` (K = 5): what a
    checkpoint in another dialect must reproduce exactly."""
    wrapped = TargetModel(target, draft.hidden_state_indices)
    hidden = target(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    proposer = DFlashProposer(draft, wrapped)
    proposer.start(torch.tensor(PROMPT), torch.cat([hidden[i][0] for i in draft.hidden_state_indices], dim=-1))
    return proposer.propose(PROMPT[-1], 5, 5).logits


def draft_that_agrees_often(target_model):
    """An autoregressive draft close to the target (perturbed copy): long accepted runs AND rejections."""
    draft = copy.deepcopy(target_model)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.004)
    return draft


def markov_target():
    """tiny_target with its residual branches zeroed: the greedy continuation depends on the last token only.

    A random deep target's greedy map is a hash of its whole context, which no small draft learns in
    seconds; this one is a first-order chain (like the local regularity of real text), learnable in a
    few hundred steps, and still a real transformers model feeding real hidden states.
    """
    model = tiny_target()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model
