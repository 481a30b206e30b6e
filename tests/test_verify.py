"""Acceptance rules on hand-written tensors, and the lossless property under sampling."""

import pytest
import torch

from dflash_doctor.engine.live import speculative_generate
from dflash_doctor.engine.proposers.autoregressive import AutoregressiveProposer
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.verify import greedy_accept, rejection_sample
from tiny_models import tiny_dflash, tiny_target

# Chi-square critical values at p = 0.001 (df -> value); a correct sampler fails 1 run in 1000.
CHI2_CRITICAL_0001 = {3: 16.27, 7: 24.32}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_greedy_accept_counts_the_matching_prefix_and_takes_the_bonus():
    # target argmax per row: 4, 7, 1, 9
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([4, 7, 1, 9]):
        logits[row, token] = 5.0
    assert greedy_accept(torch.tensor([4, 7, 1]), logits) == (3, 9)
    assert greedy_accept(torch.tensor([4, 2, 1]), logits) == (1, 7)  # a later match after a miss does not count
    assert greedy_accept(torch.tensor([0, 7, 1]), logits) == (0, 4)
    assert greedy_accept(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 4)


@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_rejection_sampling_reproduces_the_target_distribution(one_hot_draft):
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.7, 0.1, 0.1, 0.1]])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    draws = 20000
    for _ in range(draws):
        draft = torch.tensor([0]) if one_hot_draft else torch.multinomial(q[0], 1, generator=generator)
        n, token = rejection_sample(draft, p, None if one_hot_draft else q, generator)
        first = int(draft[0]) if n == 1 else token
        counts[first] += 1
    assert chi_square(counts, p[0]) < CHI2_CRITICAL_0001[3]
    # sanity: the statistic does detect the draft's own distribution
    assert chi_square(counts, q[0]) > CHI2_CRITICAL_0001[3]


def test_identical_distributions_accept_everything():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.3, 0.7]])
    n, _ = rejection_sample(torch.tensor([1, 0]), p, p[:2].clone(), torch.Generator().manual_seed(1))
    assert n == 2


def _exact_pair_distribution(model, prompt, temperature):
    """P(t1, t2) of the target's own sampling, computed from its logits."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        table = torch.zeros(vocab, vocab)
        for t1 in range(vocab):
            second = torch.softmax(model(torch.tensor([prompt + [t1]])).logits[0, -1] / temperature, -1)
            table[t1] = first[t1] * second
    return table.flatten()


@pytest.mark.parametrize("draft_kind", ["sampled-autoregressive", "greedy-dflash"])
def test_live_loop_under_sampling_matches_target_sampling(draft_kind):
    vocab, temperature, prompt = 8, 1.0, [1, 5, 2]
    target_model = tiny_target(vocab=vocab)
    target = TargetModel(target_model)
    generator = torch.Generator().manual_seed(123)
    if draft_kind == "greedy-dflash":
        draft = tiny_dflash(target_model, mask_token_id=7)
        target.hidden_state_indices = draft.hidden_state_indices
        proposer = DFlashProposer(draft, target)
    else:
        proposer = AutoregressiveProposer(
            tiny_target(seed=9, vocab=vocab), temperature=temperature, generator=generator
        )
    counts = torch.zeros(vocab)
    for _ in range(1000):
        out = speculative_generate(
            target,
            proposer,
            torch.tensor(prompt),
            k=3,
            max_new_tokens=3,
            temperature=temperature,
            generator=generator,
            record_tokens=False,
        ).output_ids
        counts[out[1]] += 1  # the first token comes from prefill; the second from a verified step
    exact = _exact_pair_distribution(target_model, prompt, temperature).view(vocab, vocab).sum(dim=0)
    assert chi_square(counts, exact) < CHI2_CRITICAL_0001[7]
