"""The draft controller's math on synthetic costs and acceptance."""

from __future__ import annotations

import numpy as np
import pytest

from specllama.controller import AdaptiveDraft, Costs, FixedDraft

# memory-bound target: a pass over k+1 tokens costs about one token
MEMORY_BOUND = Costs(verify=tuple(100 + 2 * n for n in range(1, 17)), draft_token=10)
# compute-bound target (our CPU with Q4_K_M): each extra token costs 60% of a step
COMPUTE_BOUND = Costs(verify=tuple(30 + 19 * (n - 1) for n in range(1, 17)), draft_token=19)


def feed(ctrl: AdaptiveDraft, alpha: float, n_rounds: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(n_rounds):
        k = ctrl.choose(16) or 1
        n_acc = 0
        while n_acc < k and rng.random() < alpha:
            n_acc += 1
        ctrl.observe(k, n_acc)


def test_expected_rates_match_the_formula():
    ctrl = AdaptiveDraft(MEMORY_BOUND, 4, prior=0.5, prior_weight=1e9)
    rates = ctrl.expected_rates(4)
    expected = [(1 + sum(0.5 ** j for j in range(1, k + 1))) / (k * 10 + 100 + 2 * (k + 1)) for k in range(5)]
    np.testing.assert_allclose(rates, expected)


def test_high_acceptance_on_a_memory_bound_target_drafts_long():
    ctrl = AdaptiveDraft(MEMORY_BOUND, 16)
    feed(ctrl, 0.95, 60)
    assert ctrl.choose(16) >= 8


def test_low_acceptance_turns_speculation_off_and_probes():
    ctrl = AdaptiveDraft(MEMORY_BOUND, 16, probe_every=4)
    feed(ctrl, 0.05, 80)
    choices = [ctrl.choose(16) for _ in range(8)]
    assert choices.count(0) == 6 and all(k >= 1 for k in choices if k), choices


def test_recovers_when_text_becomes_predictable():
    ctrl = AdaptiveDraft(MEMORY_BOUND, 16, probe_every=4)
    feed(ctrl, 0.05, 80)
    feed(ctrl, 0.97, 80, seed=1)
    assert ctrl.choose(16) >= 4


def test_compute_bound_target_is_hopeless_for_a_costly_draft_but_not_for_free_lookup():
    assert AdaptiveDraft(COMPUTE_BOUND, 2).hopeless
    assert AdaptiveDraft(COMPUTE_BOUND, 2).choose(2) == 0
    free = Costs(COMPUTE_BOUND.verify, 0.0)
    assert not AdaptiveDraft(free, 2).hopeless


def test_alpha_prior_chains_from_the_position_before():
    ctrl = AdaptiveDraft(MEMORY_BOUND, 3, prior=0.5, decay=1.0, prior_weight=2)
    for _ in range(50):
        ctrl.observe(1, 1)  # position 1 always accepted, deeper positions never drafted
    alpha = ctrl.alpha()
    assert alpha[0] > 0.95 and alpha[1] == pytest.approx(alpha[0]) and alpha[2] == pytest.approx(alpha[0])


def test_observe_counts_only_judged_positions():
    ctrl = AdaptiveDraft(MEMORY_BOUND, 4, decay=1.0)
    ctrl.observe(4, 1)  # x1 accepted, x2 rejected, x3 and x4 never judged
    assert ctrl.reached.tolist() == [1, 1, 0, 0]
    assert ctrl.accepted.tolist() == [1, 0, 0, 0]


def test_fixed_draft_respects_caps():
    assert FixedDraft(8).choose(3) == 3 and FixedDraft(2).choose(10) == 2


def test_costs_extrapolate_linearly():
    c = Costs((10.0, 12.0, 14.0), 1.0)
    assert c.v(5) == 18.0
