"""Prompt lookup on synthetic token sequences."""

from __future__ import annotations

import numpy as np

from specllama.decoding.proposers import PromptLookupProposer
from specllama.decoding.sampling import SamplingSettings

GREEDY = SamplingSettings()
RNG = np.random.default_rng(0)


def test_proposes_the_continuation_of_the_longest_latest_match():
    p = PromptLookupProposer(n_min=2, n_max=4)
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 6, 7, 8, 2, 3, 4]
    p.prefill(tokens[:5])
    n_match, offer = p.offer(tokens, 3)
    assert offer == [6, 7, 8]  # "2 3 4" last seen followed by 6 7 8
    assert n_match == 3


def test_no_match_proposes_nothing():
    p = PromptLookupProposer()
    p.prefill([1, 2, 3])
    assert p.offer([1, 2, 3, 4, 5], 4) == (0, [])


def test_index_follows_a_different_sequence():
    p = PromptLookupProposer(n_min=2, n_max=2)
    p.prefill([1, 2, 3, 1, 2])
    assert p.offer([1, 2, 3, 1, 2], 2)[1] == [3, 1]
    assert p.offer([5, 6, 7, 5, 6], 2)[1] == [7, 5]


def test_incremental_index_equals_a_fresh_one():
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 6, size=300).tolist()
    grown = PromptLookupProposer()
    grown.prefill(seq[:20])
    for end in range(21, 300, 7):
        fresh = PromptLookupProposer()
        fresh.prefill(seq[:end])
        assert grown.offer(seq[:end], 5) == fresh.offer(seq[:end], 5)


def test_sampled_siblings_are_drawn_without_replacement_and_say_so():
    """Each sibling's q is the draft's distribution without the tokens drawn before it: what
    the tree verifier needs to keep the target's distribution."""
    import numpy as np

    from specllama.decoding.proposers import _next_best
    from specllama.decoding.sampling import Dist

    q = Dist(np.array([3, 5, 7, 9]), np.array([0.4, 0.3, 0.2, 0.1]))
    for seed in range(20):
        drawn = list(_next_best(np.zeros(10), 5, q, 0.0, 3, np.random.default_rng(seed)))
        tokens = [5] + [t for t, _, _ in drawn]
        assert len(set(tokens)) == 4
        for j, (token, q_j, c) in enumerate(drawn):
            assert set(q_j.ids.tolist()) == set(q.ids.tolist()) - set(tokens[:j + 1])
            assert abs(q_j.probs.sum() - 1.0) < 1e-12 and c == q.prob(token)


def test_greedy_siblings_are_the_next_largest_logits():
    import numpy as np

    from specllama.decoding.proposers import _next_best

    row = np.array([0.0, 3.0, 1.0, 2.5, -1.0])
    top = float(np.exp(3.0) / np.exp(row).sum())
    drawn = list(_next_best(row, 1, None, top, 2, np.random.default_rng(0)))
    assert [t for t, _, _ in drawn] == [3, 2]
    assert abs(drawn[0][2] - np.exp(2.5) / np.exp(row).sum()) < 1e-9
