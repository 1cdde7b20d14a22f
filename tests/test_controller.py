"""The draft controller's math and decisions on synthetic costs and acceptance streams."""

from __future__ import annotations

import numpy as np
import pytest

from specllama.controller import (Acceptance, Controller, Costs, FixedDraft, OnlineCosts, draft_can_pay)
from specllama.proposers import Proposal

# memory-bound target (F16 on a Mac or an RTX card): a pass over k+1 tokens costs little more than one
MEMORY_BOUND = Costs(verify=tuple(0.100 + 0.004 * n for n in range(1, 18)), draft_token=0.010)
# compute-bound target (Q4_K_M on our 2-core CPU): each extra token costs 60% of a step
COMPUTE_BOUND = Costs(verify=tuple(0.030 + 0.019 * (n - 1) for n in range(1, 18)), draft_token=0.019)


class Clock:
    """Simulated time: each draft step the controller times takes the draft's true cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def simulate(policy, true: Costs, stream, n_rounds: int, seed: int = 0, clock: Clock | None = None):
    """Run rounds against a synthetic target; return (tokens per second, draft lengths used).

    stream(rng) -> (the draft's confidence in its token, whether the target accepts it).
    """
    rng = np.random.default_rng(seed)
    n_tokens, elapsed, lengths = 0, 0.0, []
    for _ in range(n_rounds):
        source, k = policy.plan(16, 0, 0)
        confidences, accepted, n_decodes, dropped = [], [], 0, None
        if source == "draft":
            for _ in range(k):
                n_decodes += 1
                if clock is not None:
                    clock.now += true.draft_token
                c, ok = stream(rng)
                confidences.append(c)
                accepted.append(ok)
                decision = policy.draft_more(confidences)
                if decision == "drop":
                    dropped = (ACCEPTED if accepted.pop() else REJECTED, confidences.pop())
                    break
                if decision == "stop":
                    break
        n_acc = next((i for i, ok in enumerate(accepted) if not ok), len(accepted))
        t_verify = true.v(len(confidences) + 1)
        # the target's token after the accepted drafts: what a dropped draft would have been judged by
        new = [ACCEPTED] * n_acc + [ACCEPTED if dropped is not None and dropped[0] == ACCEPTED else REJECTED]
        proposal = Proposal([ACCEPTED] * len(confidences), None, confidences, dropped)
        policy.observe(source, proposal, new, t_verify, [], True)
        n_tokens += n_acc + 1
        elapsed += n_decodes * true.draft_token + t_verify
        lengths.append(len(confidences))
    return n_tokens / elapsed, lengths


ACCEPTED, REJECTED = 1, 2  # token ids in the simulation: the target's choice, and another


def constant(alpha: float, confidence: float = 0.8):
    return lambda rng: (confidence, rng.random() < alpha)


def best_fixed(costs: Costs, alpha: float) -> tuple[int, float]:
    rates = [(1 + sum(alpha ** j for j in range(1, k + 1))) / (k * costs.draft_token + costs.v(k + 1))
             for k in range(0, 17)]
    return int(np.argmax(rates)), max(rates)


def controller(costs: Costs, clock=None, **kw) -> Controller:
    kw.setdefault("has_draft", True)
    kw.setdefault("lookup", False)
    return Controller(OnlineCosts(costs), 16, clock=clock or Clock(), **kw)


@pytest.mark.parametrize("alpha", [0.6, 0.8, 0.9, 0.95])
def test_converges_to_the_best_fixed_length_on_a_stationary_stream(alpha):
    clock = Clock()
    rate, lengths = simulate(controller(MEMORY_BOUND, clock), MEMORY_BOUND, constant(alpha), 600, clock=clock)
    k_best, best_rate = best_fixed(MEMORY_BOUND, alpha)
    settled = lengths[200:]
    assert rate >= 0.95 * best_rate, (rate, best_rate)
    assert abs(np.median(settled) - k_best) <= 2, (np.median(settled), k_best)


def test_picks_plain_decoding_when_nothing_pays():
    clock = Clock()
    policy = controller(COMPUTE_BOUND, clock)
    rate, lengths = simulate(policy, COMPUTE_BOUND, constant(0.3), 400, clock=clock)
    assert best_fixed(COMPUTE_BOUND, 0.3)[0] == 0
    assert sum(k == 0 for k in lengths[100:]) >= 0.9 * len(lengths[100:])
    assert rate >= 0.97 / COMPUTE_BOUND.v(1)
    assert policy.plan(16, 0, 0) == ("none", 0)


def test_a_draft_that_cannot_pay_even_when_always_right_is_not_used():
    assert not draft_can_pay(OnlineCosts(COMPUTE_BOUND), 2)
    assert draft_can_pay(OnlineCosts(MEMORY_BOUND), 2)
    free = Costs(COMPUTE_BOUND.verify, 0.0)  # prompt lookup: 2 tokens in 49 ms beat 1 in 30 ms
    assert draft_can_pay(OnlineCosts(free), 2)
    assert not draft_can_pay(OnlineCosts(COMPUTE_BOUND), 0)


def test_confidence_stopping_beats_every_fixed_length_when_confidence_predicts_acceptance():
    """Code-like text: the draft is sure of most tokens (and right), unsure of a few (and
    mostly wrong). Stopping at the unsure ones must beat any fixed length."""
    def stream(rng):
        if rng.random() < 0.8:
            return 0.97, rng.random() < 0.97
        return 0.35, rng.random() < 0.2

    clock = Clock()
    rate, _ = simulate(controller(MEMORY_BOUND, clock), MEMORY_BOUND, stream, 800, clock=clock)
    fixed = [simulate(FixedDraft(k), MEMORY_BOUND, stream, 800)[0] for k in range(1, 17)]
    assert rate > max(fixed), (rate, max(fixed))


def test_stale_calibration_is_corrected_by_what_rounds_measure():
    """Calibrated while the machine was busy: plain decoding looked 1.7x slower than it is,
    which made speculation look worth it. Measured rounds must turn it off again."""
    true = COMPUTE_BOUND
    stale = Costs(tuple(v * (1.7 if n == 0 else 1.0) for n, v in enumerate(true.verify)), true.draft_token * 0.5)
    clock = Clock()
    policy = controller(stale, clock)
    rate, lengths = simulate(policy, true, constant(0.55), 300, clock=clock)
    assert policy.costs.v(1) == pytest.approx(true.v(1), rel=0.05)
    assert sum(k == 0 for k in lengths[-100:]) >= 90
    assert rate >= 0.95 / true.v(1)


def test_the_draft_cost_is_learned_from_the_draft_steps():
    stale = Costs(MEMORY_BOUND.verify, MEMORY_BOUND.draft_token / 3)
    clock = Clock()
    policy = controller(stale, clock)
    simulate(policy, MEMORY_BOUND, constant(0.9), 100, clock=clock)
    assert policy.costs.draft_token == pytest.approx(MEMORY_BOUND.draft_token, rel=0.01)


def test_frozen_costs_ignore_measurements():
    costs = OnlineCosts(MEMORY_BOUND, frozen=True)
    costs.observe_verify(1, 5.0)
    costs.observe_draft_step(5.0)
    assert costs.v(1) == MEMORY_BOUND.v(1) and costs.draft_token == MEMORY_BOUND.draft_token


def test_online_costs_are_robust_to_one_slow_round():
    costs = OnlineCosts(MEMORY_BOUND)
    for _ in range(6):
        costs.observe_verify(3, MEMORY_BOUND.v(3))
    costs.observe_verify(3, 10 * MEMORY_BOUND.v(3))  # a page fault, another process
    assert costs.v(3) == pytest.approx(MEMORY_BOUND.v(3))
    assert costs.v(9) == pytest.approx(MEMORY_BOUND.v(9))  # unseen sizes follow the overall ratio


def test_lookup_is_chosen_when_it_is_predicted_to_yield_more():
    policy = controller(MEMORY_BOUND, lookup=True)
    choices = []
    offer = list(range(100, 112))  # an edit: lookup offers 12 tokens the output then copies
    for _ in range(30):
        source, k = policy.plan(16, 4, 12)
        choices.append(source)
        proposal = Proposal(offer[:k] if source == "lookup" else [])
        new = offer[:k] + [7] if source == "lookup" else offer[:1]
        policy.observe(source, proposal, new, MEMORY_BOUND.v(len(proposal.tokens) + 1), offer, True)
    assert choices[:3] == ["none"] * 3  # plain rounds measure v(1), and judge the offers meanwhile
    assert choices[3:].count("lookup") >= 25
    assert policy.plan(16, 4, 12) == ("lookup", 12)
    assert policy.plan(16, 0, 0)[0] == "draft"  # no match: the draft model


def test_lookup_is_judged_in_rounds_it_was_not_chosen():
    """Its offers are compared with what the rounds produced, so a good lookup gets chosen
    even while the draft model holds the rounds, and a poor one is dropped."""
    good, poor = controller(MEMORY_BOUND, lookup=True), controller(MEMORY_BOUND, lookup=True)
    offer = [5, 6, 7, 8]
    for _ in range(20):
        good.plan(16, 4, len(offer))  # plan sees the offer first, as in the loop
        poor.plan(16, 4, len(offer))
        good.observe("draft", Proposal([5, 6], None, [0.9, 0.9]), [5, 6, 7], 0.1, offer, True)
        poor.observe("draft", Proposal([5, 6], None, [0.9, 0.9]), [5, 6, 7], 0.1, [9, 9, 9, 9], True)
    assert good.lookup_alpha(4) > 0.9 and poor.lookup_alpha(4) < 0.1


def test_a_dropped_draft_is_judged_when_its_position_is_reached():
    acc = Controller(OnlineCosts(MEMORY_BOUND), 16, has_draft=True, lookup=False).draft_acceptance
    policy = Controller(OnlineCosts(MEMORY_BOUND), 16, has_draft=True, lookup=False)
    for _ in range(30):  # the draft is unsure (0.4) of tokens the target then picks anyway
        policy.observe("draft", Proposal([3], None, [0.97], dropped=(4, 0.4)), [3, 4], 0.1, [], True)
    assert policy.draft_acceptance.predict(0.4) > 0.9 > acc.predict(0.4)
    assert policy.draft_acceptance.mean_seen < 30  # only proposed tokens count toward the mean


def test_acceptance_counts_only_judged_positions():
    acc = Acceptance(decay=1.0)
    acc.observe([0.99, 0.99, 0.99, 0.99], 1)  # x1 accepted, x2 rejected, x3 and x4 never judged
    assert acc.mean_seen == 2 and acc.mean_hits == 1
    assert acc.seen.sum() == 2


def test_acceptance_learns_the_confidence_calibration():
    acc = Acceptance(decay=1.0)
    for _ in range(100):
        acc.observe([0.96], 0)  # a draft that is confident and always wrong
    assert acc.predict(0.96) < 0.05
    assert acc.predict(0.5) == pytest.approx(0.6)  # untouched bins keep their prior


def test_fixed_draft_respects_caps_and_sources():
    assert FixedDraft(8).plan(3, 0, 0) == ("draft", 3)
    assert FixedDraft(2).plan(10, 0, 0) == ("draft", 2)
    assert FixedDraft(4, has_draft=False).plan(10, 2, 3) == ("lookup", 3)
    assert FixedDraft(4, lookup=True).plan(10, 3, 9) == ("lookup", 4)
    assert FixedDraft(4, lookup=True).plan(10, 2, 9) == ("draft", 4)  # short match: the draft model
    assert FixedDraft(0).plan(10, 0, 0) == ("none", 0)


def test_costs_extrapolate_linearly():
    c = Costs((10.0, 12.0, 14.0), 1.0)
    assert c.v(5) == 18.0
