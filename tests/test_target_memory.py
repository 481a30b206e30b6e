"""The target pass keeps only what is used: taps recorded by hooks equal HF's hidden states, the
logits of the positions asked for equal the full pass's, and a sequence prefilled in chunks gives the
same logits, taps and teacher-forced table as one forward, on every target family (hybrids included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_doctor.engine import target as target_module
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table
from target_families import CONFIGS, tiny_family_target
from tiny_models import tiny_dflash


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_hooked_taps_and_kept_logits_equal_the_full_pass_also_in_chunks(family, monkeypatch):
    model = tiny_family_target(family)
    layers = model.config.get_text_config().num_hidden_layers
    ids = torch.randint(3, 90, (40,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = model(input_ids=ids[None], output_hidden_states=True)
    taps = (0, 1, layers - 1, layers)
    expected = torch.cat([full.hidden_states[i][0] for i in taps], dim=-1)
    target = TargetModel(model)
    whole = target.forward(ids, taps=taps, logits_from=30)
    assert torch.equal(whole.features, expected)  # the same tensors HF would return, nothing recomputed
    assert whole.logits.shape[0] == 10
    torch.testing.assert_close(whole.logits, full.logits[0, 30:].float())
    monkeypatch.setattr(target_module, "PREFILL_CHUNK", 16)  # three chunks, the logits only in the last
    target.reset()
    chunked = target.forward(ids, taps=taps, logits_from=30)
    assert target.cache_length == len(ids)
    torch.testing.assert_close(chunked.features, expected, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(chunked.logits, whole.logits, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_teacher_table_is_the_same_with_a_chunked_prefill(family, monkeypatch):
    model = tiny_family_target(family)
    draft = tiny_dflash(model, layer_ids=(0, 2))
    target = TargetModel(model)
    proposer = DFlashProposer(draft, target)
    ids = torch.randint(3, 90, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    sequence = TeacherSequence(ids[:44], ids[44:])
    whole, (logits, _) = slot_table(target, proposer, sequence, 5)
    assert logits.shape[0] == len(sequence.output_ids)  # no logits for the prompt's positions
    monkeypatch.setattr(target_module, "PREFILL_CHUNK", 16)
    chunked, _ = slot_table(target, proposer, sequence, 5)
    assert np.array_equal(whole.guesses, chunked.guesses) and np.array_equal(whole.matches, chunked.matches)
    np.testing.assert_allclose(whole.divergence, chunked.divergence, rtol=1e-3, atol=1e-5)
