"""The worked examples in the n-gram and suffix proposers' and the end-of-request schedule's docstrings run,
and give what they say.

Only these modules' doctests are collected (the suite's collection is otherwise unchanged): each example
states one rule of its module (earliest occurrence, longest match, the context ending the draft, the
global tree of responses; each convention's draft budget, block length and count of a step cut by a stop
token), so an example that no longer holds is a rule that changed.
"""

from __future__ import annotations

import doctest

import pytest

from dflash_doctor.engine import schedule
from dflash_doctor.engine.proposers import ngram, suffix


@pytest.mark.parametrize("module, examples", [(ngram, 5), (suffix, 9), (schedule, 7)])
def test_the_worked_examples_hold(module, examples):
    result = doctest.testmod(module, verbose=False)
    assert result.failed == 0
    assert result.attempted == examples  # every example ran, its import line included
