"""Prompt lookup on synthetic token sequences."""

from __future__ import annotations

import numpy as np

from specllama.proposers import PromptLookupProposer
from specllama.sampling import SamplingSettings

GREEDY = SamplingSettings()
RNG = np.random.default_rng(0)


def test_proposes_the_continuation_of_the_longest_latest_match():
    p = PromptLookupProposer(n_min=2, n_max=4)
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 6, 7, 8, 2, 3, 4]
    p.prefill(tokens[:5])
    proposal = p.propose(tokens, 3, GREEDY, RNG)
    assert proposal.tokens == [6, 7, 8]  # "2 3 4" last seen followed by 6 7 8
    assert proposal.q is None and p.last_match == 3


def test_no_match_proposes_nothing():
    p = PromptLookupProposer()
    p.prefill([1, 2, 3])
    assert p.propose([1, 2, 3, 4, 5], 4, GREEDY, RNG).tokens == []


def test_index_follows_a_different_sequence():
    p = PromptLookupProposer(n_min=2, n_max=2)
    p.prefill([1, 2, 3, 1, 2])
    assert p.propose([1, 2, 3, 1, 2], 2, GREEDY, RNG).tokens == [3, 1]
    assert p.propose([5, 6, 7, 5, 6], 2, GREEDY, RNG).tokens == [7, 5]


def test_incremental_index_equals_a_fresh_one():
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 6, size=300).tolist()
    grown = PromptLookupProposer()
    grown.prefill(seq[:20])
    for end in range(21, 300, 7):
        fresh = PromptLookupProposer()
        fresh.prefill(seq[:end])
        assert grown.propose(seq[:end], 5, GREEDY, RNG) == fresh.propose(seq[:end], 5, GREEDY, RNG)
