"""The real demo pair (SmolLM2-135M-Instruct + the shipped DFlash draft) against the official loop.

For the shipped draft and its sliding, scaled, causal (JetSpec) and DFlash 2 variants (tests/official_dflash.py), our
live loop under the ``official`` end-of-request convention must give the official ``dflash_generate``'s
outputs and per-step acceptance lengths on real prompts at K = 15, and under vLLM's convention the same
outputs and the same lengths on every step whose block was full. benchmarks/official_parity.py runs
the same comparison over a whole workload.
"""

from __future__ import annotations

import pytest
import torch

from official_dflash import REAL_VARIANTS, official, official_generate, real_variant

from dflash_doctor.engine.schedule import CONVENTIONS
from dflash_doctor.engine.live import speculative_generate
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.models.loading import DEMO_DRAFT_DIR, load_dflash_draft
from dflash_doctor.models.pair import stop_ids_of
from dflash_doctor.inputs.workloads import encode_turn
from tiny_models import torch_threads

pytestmark = pytest.mark.integration

QUESTIONS = ("What is 12 times 7? Explain.", "Write a Python function that reverses a string.")
MAX_NEW_TOKENS = 32
K = 15


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    from dflash_doctor.models.loading import demo_target_path, load_causal_lm, resolve_model_dir

    with torch_threads(2):
        model_dir = resolve_model_dir(str(demo_target_path()))
        model = load_causal_lm(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = [encode_turn(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
        yield model, prompts, stop_ids_of(model, tokenizer)


@pytest.mark.parametrize("variant", REAL_VARIANTS)
def test_demo_pair_variants_equal_the_official_loop(variant, smollm2, tmp_path):
    model, prompts, stop_ids = smollm2
    path = real_variant(DEMO_DRAFT_DIR, variant, tmp_path)
    cls = official.DFlash2DraftModel if variant == "dflash2" else official.DFlashDraftModel
    official_draft = cls.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_dflash_draft(path)
    target = TargetModel(model, ours.hidden_state_indices)
    proposer = DFlashProposer(ours, target)
    full_block_steps = 0
    for prompt in prompts:
        official_out, official_lengths = official_generate(
            official_draft, model, prompt, max_new_tokens=MAX_NEW_TOKENS, stop_ids=sorted(stop_ids), block_size=K + 1
        )
        for convention in ("official", "vllm"):
            result = speculative_generate(
                target,
                proposer,
                torch.tensor(prompt),
                k=K,
                max_new_tokens=MAX_NEW_TOKENS,
                stop_ids=stop_ids,
                convention=CONVENTIONS[convention],
                record_tokens=False,
            )
            lengths = [step.num_accepted + 1 for step in result.steps]
            assert result.output_ids == official_out
            if convention == "official":
                assert lengths == official_lengths
            else:
                full = [
                    (a, b)
                    for step, a, b in zip(result.steps, lengths, official_lengths)
                    if MAX_NEW_TOKENS - step.position >= K
                ]
                assert all(a == b for a, b in full)
                full_block_steps += len(full)
    assert full_block_steps > 0
