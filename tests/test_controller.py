"""The draft controller's math and decisions on synthetic costs and acceptance streams."""

from __future__ import annotations

import numpy as np
import pytest

from specllama.controller import (Acceptance, Controller, Costs, FixedDraft, OnlineCosts, draft_can_pay)
from specllama.decoding.proposals import DraftReport, Proposal, RoundOutcome

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


def simulate(policy, true: Costs, stream, n_rounds: int, seed: int = 0, clock: Clock | None = None,
             noise: float = 0.0, trace: list | None = None):
    """Run rounds against a synthetic target; return (tokens per second, draft lengths used).

    stream(rng) -> (the draft's confidence in its token, whether the target accepts it); or a
    list of (n_rounds, stream) spans: a text that changes as it goes.
    noise: each timed step takes its true cost times a log-normal factor of this sigma (a
    shared 2-core CPU measures the same pass 15% apart from one round to the next).
    The draft falls behind by the tokens of rounds it did not draft, and a draft round first
    decodes them in one batch (true_catch_up's time). trace: gets (tokens, seconds) per round.
    """
    rng = np.random.default_rng(seed)
    timing = np.random.default_rng(seed + 1)  # its own stream: the same tokens whatever the noise

    def jitter(seconds):
        return seconds * float(np.exp(noise * timing.standard_normal())) if noise else seconds

    n_tokens, elapsed, lengths, n_lag = 0, 0.0, [], 1
    spans = stream if isinstance(stream, list) else [(n_rounds, stream)]
    ends = np.cumsum([n for n, _ in spans])
    for i_round in range(n_rounds):
        stream = spans[min(int(np.searchsorted(ends, i_round, side="right")), len(spans) - 1)][1]
        source, k = policy.plan(16, 0, 0, lag=(n_lag, False))
        confidences, accepted, n_decodes, dropped = [], [], 0, None
        t_draft, catch_up = 0.0, (0, 0.0)
        if source == "draft" and n_lag >= 2:
            catch_up = (n_lag, jitter(true_catch_up(true, n_lag)))
            t_draft += catch_up[1]
            if clock is not None:
                clock.now += catch_up[1]
        if source == "draft":
            for _ in range(k):
                n_decodes += 1
                step = jitter(true.draft_token)
                t_draft += step
                if clock is not None:
                    clock.now += step
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
        t_verify = jitter(true.v(len(confidences) + 1))
        # the target's token after the accepted drafts: what a dropped draft would have been judged by
        new = [ACCEPTED] * n_acc + [ACCEPTED if dropped is not None and dropped[0] == ACCEPTED else REJECTED]
        proposal = Proposal([ACCEPTED] * len(confidences))
        policy.observe(RoundOutcome(source, proposal, new, t_verify, True, DraftReport(confidences, dropped, catch_up)))
        n_lag = 1 if source == "draft" else n_lag + n_acc + 1
        n_tokens += n_acc + 1
        elapsed += t_draft + t_verify
        if trace is not None:
            trace.append((n_acc + 1, t_draft + t_verify))
        lengths.append(len(confidences))
    return n_tokens / elapsed, lengths


ACCEPTED, REJECTED = 1, 2  # token ids in the simulation: the target's choice, and another


def true_catch_up(true: Costs, n: int) -> float:
    """The draft's time to decode n tokens at once: a batch curve of the target's shape."""
    return true.draft_token * true.v(n) / true.v(1)


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


# the F16 target on our 2-core CPU, as rounds time it: a pass over n tokens 195 ms + 12 ms per
# extra token, the draft 40 ms a token, each figure 15% apart from one round to the next
THIS_CPU_F16 = Costs(verify=tuple(0.195 + 0.012 * (n - 1) for n in range(1, 18)), draft_token=0.040)


def code_like(rng):
    """Mostly sure and right, now and then unsure and often wrong: about 0.8 accepted."""
    if rng.random() < 0.75:
        return float(rng.uniform(0.9, 1.0)), rng.random() < 0.95
    c = float(rng.uniform(0.3, 0.9))
    return c, rng.random() < c * 0.8


def test_verify_costs_are_one_smooth_curve_under_noise():
    """36 rounds' verify times, 15% apart from one another: the step from n to n + 1 tokens
    (12 ms), which decides how far to draft, must come out within a few ms, never negative.
    A median per size (5 rounds each) gets it wrong by tens of ms."""
    rng = np.random.default_rng(0)
    costs = OnlineCosts(THIS_CPU_F16)
    for _ in range(36):
        n = int(rng.integers(2, 9))
        costs.observe_verify(n, THIS_CPU_F16.v(n) * float(np.exp(0.15 * rng.standard_normal())))
    steps = np.diff(costs.table(8)[2:])
    assert np.all(np.abs(steps - 0.012) < 0.006), steps


def test_v1_follows_the_machines_load_between_plain_rounds():
    """Plain rounds, which measure v(1), are rare. When the machine's load changes, the batch
    rounds see it, and v(1) must move with them rather than keep its old figure."""
    costs = OnlineCosts(THIS_CPU_F16)
    for _ in range(3):
        costs.observe_verify(1, THIS_CPU_F16.v(1))
    for n in [2, 4, 6, 3, 5] * 2:
        costs.observe_verify(n, THIS_CPU_F16.v(n))
    assert costs.v(1) == pytest.approx(THIS_CPU_F16.v(1))
    for n in [2, 4, 6, 3, 5] * 8:  # another process starts: every pass takes 1.5x as long
        costs.observe_verify(n, 1.5 * THIS_CPU_F16.v(n))
    assert not costs.wants(1)
    assert costs.v(1) == pytest.approx(1.5 * THIS_CPU_F16.v(1), rel=0.02)
    assert costs.v(4) == pytest.approx(1.5 * THIS_CPU_F16.v(4), rel=0.02)


def test_one_token_decodes_timed_at_load_stand_for_the_first_plain_rounds():
    """A fresh process's first generation starts drafting: the decodes load just timed give
    v(1); timed at the curve's short context, they then follow the batch rounds' level (a long
    context raises v(1) with the batches) until a plain round measures it. A frozen curve
    ignores them."""
    live = [1.2 * THIS_CPU_F16.v(1)] * 3
    costs = OnlineCosts(THIS_CPU_F16, v1_live=live)
    assert not costs.wants(1)
    assert costs.v(1) == pytest.approx(1.2 * THIS_CPU_F16.v(1))
    assert Controller(costs, 8, has_draft=True, lookup=False).plan(8, 0, 0)[0] == "draft"
    assert OnlineCosts(THIS_CPU_F16).wants(1)
    assert Controller(OnlineCosts(THIS_CPU_F16), 8, has_draft=True, lookup=False).plan(8, 0, 0)[0] == "none"
    assert OnlineCosts(THIS_CPU_F16, frozen=True, v1_live=live).v(1) == pytest.approx(THIS_CPU_F16.v(1))
    for n in [2, 4, 6, 3, 5] * 2:  # a long context: every batch takes 1.5x the calibrated time
        costs.observe_verify(n, 1.5 * THIS_CPU_F16.v(n))
    assert costs.v(1) == pytest.approx(1.5 * THIS_CPU_F16.v(1))
    assert not costs.wants(1)
    for _ in range(3):  # plain rounds measure it: 1.8x, at the batches' 1.5x
        costs.observe_verify(1, 1.8 * THIS_CPU_F16.v(1))
    assert costs.v(1) == pytest.approx(1.8 * THIS_CPU_F16.v(1), rel=0.05)


@pytest.mark.parametrize("stream", [constant(0.8), code_like], ids=["constant", "code-like"])
def test_noisy_timings_keep_the_controller_near_the_best_fixed_length(stream):
    """Per-round times scatter 15% around the truth, draft steps too."""
    clock = Clock()
    rate, _ = simulate(controller(THIS_CPU_F16, clock), THIS_CPU_F16, stream, 600, clock=clock, noise=0.15)
    fixed = [simulate(FixedDraft(k), THIS_CPU_F16, stream, 600, noise=0.15)[0] for k in range(1, 17)]
    assert rate >= 0.97 * max(fixed), (rate, max(fixed), int(np.argmax(fixed)) + 1)


def test_a_run_of_sure_drafts_is_weighed_against_the_long_run_rate():
    """Five sure drafts in, the round's own E/T is far above what rounds achieve on average.
    A sixth draft, accepted at the text's mean 0.6, still buys tokens faster than that average:
    judged against the round's own E/T it would be refused, against the long-run rate it is
    drafted."""
    acc = Acceptance()
    for _ in range(100):
        acc.judge(0.99, True, proposed=False)  # sure drafts are right
    acc.mean_hits, acc.mean_seen = 60.0, 100.0
    policy = controller(THIS_CPU_F16, acceptance=acc)
    for _ in range(3):
        policy.costs.observe_verify(1, THIS_CPU_F16.v(1))  # v(1) measured: no plain round due
    assert policy.plan(16, 0, 0) == ("draft", 16)
    decisions = [policy.draft_more([0.99] * i) for i in range(1, 7)]
    assert decisions == ["more"] * 6
    # an unsure seventh (accepted 15% of the time) still pays for its 12 ms row, not for more
    assert policy.draft_more([0.99] * 6 + [0.2]) == "stop"


def test_picks_plain_decoding_when_nothing_pays():
    clock = Clock()
    policy = controller(COMPUTE_BOUND, clock)
    rate, lengths = simulate(policy, COMPUTE_BOUND, constant(0.3), 400, clock=clock)
    assert best_fixed(COMPUTE_BOUND, 0.3)[0] == 0
    assert sum(k == 0 for k in lengths[100:]) >= 0.9 * len(lengths[100:])
    assert rate >= 0.97 / COMPUTE_BOUND.v(1)
    n_lag = 1 + next((i for i, k in enumerate(reversed(lengths)) if k > 0), len(lengths))  # a token a round
    assert policy.plan(16, 0, 0, lag=(n_lag, False)) == ("none", 0)


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
    for _ in range(20):  # a pair with a record (an untried draft is tried first, a thin record hoped for)
        policy.draft_acceptance.observe([0.6] * 8, 5)
    choices = []
    offer = list(range(100, 112))  # an edit: lookup offers 12 tokens the output then copies
    for _ in range(30):
        source, k = policy.plan(16, 4, 12)
        choices.append(source)
        proposal = Proposal(offer[:k] if source == "lookup" else [])
        new = offer[:k] + [7] if source == "lookup" else offer[:1]
        policy.observe(RoundOutcome(source, proposal, new, MEMORY_BOUND.v(len(proposal.tokens) + 1), True,
                                    offer=offer))
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
        report = DraftReport([0.9, 0.9])
        good.observe(RoundOutcome("draft", Proposal([5, 6]), [5, 6, 7], 0.1, True, report, offer))
        poor.observe(RoundOutcome("draft", Proposal([5, 6]), [5, 6, 7], 0.1, True, report, [9, 9, 9, 9]))
    assert good.lookup_alpha(4) > 0.9 and poor.lookup_alpha(4) < 0.1


def test_a_dropped_draft_is_judged_when_its_position_is_reached():
    acc = Controller(OnlineCosts(MEMORY_BOUND), 16, has_draft=True, lookup=False).draft_acceptance
    policy = Controller(OnlineCosts(MEMORY_BOUND), 16, has_draft=True, lookup=False)
    for _ in range(30):  # the draft is unsure (0.4) of tokens the target then picks anyway
        policy.observe(RoundOutcome("draft", Proposal([3]), [3, 4], 0.1, True, DraftReport([0.97], dropped=(4, 0.4))))
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
    assert acc.predict(0.96) < 0.1
    assert acc.predict(0.5) <= acc.predict(0.96)  # and no surer where it is less confident
    assert acc.predict(0.99) == pytest.approx(0.99)  # the untouched top bin keeps its prior


def test_acceptance_never_ranks_a_surer_bin_below_a_less_sure_one():
    acc = Acceptance(decay=1.0)
    for _ in range(20):
        acc.observe([0.6], 1)  # drafted at 0.6: accepted
    for _ in range(3):
        acc.observe([0.75], 0)  # at 0.75: three unlucky rejections
    assert acc.predict(0.75) >= acc.predict(0.6) > 0.75
    predictions = [acc.predict(c) for c in np.linspace(0, 1, 41)]
    assert predictions == sorted(predictions)


def test_a_new_text_keeps_the_confidence_calibration_and_weakens_the_mean():
    acc = Acceptance()
    for _ in range(50):
        acc.age()
        acc.observe([0.99, 0.4, 0.99], 1)
    low, measured = acc.predict(0.4), acc.mean_hits / acc.mean_seen
    acc.new_text()
    assert acc.predict(0.4) == low < 0.2
    # the prior it shrinks to is the pair's long-run acceptance (here the same texts': 1 in 2)
    assert acc.long_run() == pytest.approx(0.5, abs=0.02)
    assert acc.mean_seen == acc.w and acc.mean() == pytest.approx((measured + acc.long_run()) / 2)
    assert Acceptance().mean() == 0.6  # a pair never judged


def test_a_rejection_at_the_start_of_a_text_does_not_turn_off_a_pair_that_drafts_it_well():
    """Code the pair drafts at 92%, generation after generation: a first draft rejected, or
    a stretch of plain rounds, leaves the mean near the pair's record, not at a fixed prior
    (0.6 is below what drafting needs on this CPU, so one rejection kept whole answers plain)."""
    acc = Acceptance()
    rng = np.random.default_rng(0)
    for _ in range(60):
        acc.age()
        acc.observe([0.9] * 5, int(np.argmin(rng.random(5) < 0.92)) if rng.random() < 0.34 else 5)
    acc.new_text()
    acc.observe([0.9], 0)  # the first draft of the next answer is rejected
    policy = Controller(OnlineCosts(F16_CPU, frozen=True), 8, has_draft=True, lookup=False, acceptance=acc)
    assert policy.plan(8, 0, 0)[0] == "draft"
    for _ in range(40):  # plain rounds judge nothing: the mean returns to the pair's record
        acc.age()
    assert acc.mean() == pytest.approx(acc.long_run(), abs=0.05) and acc.mean() > 0.85


def test_a_shared_acceptance_carries_over_to_the_next_generation():
    """The engine hands one Acceptance to every unseeded generation of a model pair: the
    second generation starts from what the first learned, not from the prior."""
    acc = Acceptance()
    first = controller(MEMORY_BOUND, acceptance=acc)
    simulate(first, MEMORY_BOUND, lambda rng: (0.35, rng.random() < 0.95), 100)
    second = controller(MEMORY_BOUND, acceptance=acc)
    assert second.draft_acceptance.predict(0.35) > 0.9 > Acceptance().predict(0.35)


def test_generations_at_once_share_the_calibration_but_each_keeps_its_text_s_mean():
    """Two requests side by side on one pair: prose whose drafts the target rejects beside
    code it accepts. Each plans from its own text's acceptance; the pair's confidence
    calibration and record learn from both; the next generation starts from the last text's."""
    acc = Acceptance()
    code = controller(MEMORY_BOUND, acceptance=acc)
    prose = controller(MEMORY_BOUND, acceptance=acc)
    for _ in range(30):  # interleaved rounds, as lanes' rounds are
        code.draft_acceptance.age()
        code.draft_acceptance.observe([0.6] * 4, 4)
        prose.draft_acceptance.age()
        prose.draft_acceptance.observe([0.6] * 4, 0)
    assert code.draft_acceptance.mean() > 0.85 and prose.draft_acceptance.mean() < 0.35
    assert code.draft_acceptance.predict(0.6) == prose.draft_acceptance.predict(0.6) == acc.predict(0.6)
    assert acc.n_judged == 30 * (4 + 1) and 0.7 < acc.long_run() < 0.9  # 4 of 5 judged proposals accepted
    after = controller(MEMORY_BOUND, acceptance=acc)  # prose's rounds came last: its mean, worth w tokens
    assert after.draft_acceptance.mean_seen == pytest.approx(acc.w)
    assert after.draft_acceptance.mean() < code.draft_acceptance.mean()


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


# F16 on our 2-core AMD: one token 70 ms, two 110 ms, then ~8 ms a row; the 0.5B draft 19 ms a token
F16_CPU = Costs(verify=(0.070, *(0.110 + 0.008 * (n - 2) for n in range(2, 18))), draft_token=0.019)


def test_an_untried_draft_is_tried_and_a_poor_one_then_left_idle():
    """At a pessimistic prior the draft would never run, and never be learned. It is tried
    until N_EXPLORE drafts are judged, whatever the first of them did."""
    policy = Controller(OnlineCosts(F16_CPU, frozen=True), 8, has_draft=True, lookup=False)
    assert policy.plan(8, 0, 0)[0] == "draft"
    for _ in range(3):
        policy.draft_acceptance.observe([0.4] * 4, 0)  # each round: its first draft rejected
    assert policy.plan(8, 0, 0)[0] == "draft"  # 3 judged: still trying
    for _ in range(2):
        policy.draft_acceptance.observe([0.4] * 8, 2)
    assert policy.plan(8, 0, 0)[0] == "none"


def test_catching_the_draft_up_after_lookup_is_paid_once_as_one_batch():
    """An edit: lookup proposed the last 40 tokens, so drafting now means the draft decodes
    them first. That is one batch (far cheaper than 40 steps), paid once: spread over the
    tokens the draft will then serve it does not stop a good draft, but with the generation's
    end in sight nothing repays it."""
    def policy(n_tokens):
        p = Controller(OnlineCosts(F16_CPU, frozen=True), 8, has_draft=True, lookup=True, n_tokens=n_tokens)
        for _ in range(2):
            p.draft_acceptance.observe([0.9] * 8, 7)
        return p

    assert policy(256).costs.catch_up(40) < 40 * policy(256).costs.catch_up(1) / 3
    assert policy(256).plan(8, 0, 0, lag=(1, False))[0] == "draft"
    assert policy(256).plan(8, 0, 0, lag=(40, False))[0] == "draft"
    assert policy(2).plan(8, 0, 0, lag=(1, False))[0] == "draft"
    assert policy(2).plan(8, 0, 0, lag=(40, False))[0] == "none"
    # a prefill is spread over all the tokens still to come, a catch-up over a few dozen
    assert policy(256).lag_cost(400, True) < policy(256).lag_cost(400, False)


def test_the_draft_s_prefill_is_priced_from_its_own_timed_batch():
    """A compute-bound draft beside a memory-bound target (the Q4_K_M 0.5B beside the F16
    1.5B here): scaled by the target's curve, 80 tokens at once priced at 3x one step, where
    the calibration's timed 64-token batch says 17x; without a timed batch, as before."""
    timed = Costs(F16_CPU.verify, 0.020, draft_batch=(64, 0.350))
    costs = OnlineCosts(timed, frozen=True)
    per_token = (0.350 - 0.020) / 63
    assert costs.catch_up(64) == pytest.approx(0.350)
    assert costs.catch_up(80) == pytest.approx(0.020 + 79 * per_token)
    assert costs.catch_up(3) - costs.catch_up(1) == pytest.approx(2 * per_token)
    untimed = OnlineCosts(Costs(F16_CPU.verify, 0.020), frozen=True)
    assert untimed.catch_up(80) == pytest.approx(0.020 * F16_CPU.v(80) / F16_CPU.v(1))
    # beside two other lanes, 256 tokens from its end, a 160-token prefill priced as timed does
    # not repay (where it was priced at a fifth of that, it was started)
    policies = [Controller(OnlineCosts(c, frozen=True), 8, has_draft=True, lookup=False, n_tokens=256)
                for c in (timed, Costs(F16_CPU.verify, 0.020))]
    for p in policies:
        for _ in range(20):
            p.draft_acceptance.observe([0.9] * 8, 6)
        p.load(2, 3, None)
    assert [p.plan(8, 0, 0, lag=(160, True))[0] for p in policies] == ["none", "draft"]


def test_a_record_s_draft_batch_is_read_where_valid():
    from specllama.measuring import records

    assert records.draft_batch({"draft_batch": [64, 0.35]}) == (64, 0.35)
    for bad in (None, [64], [1, 0.3], [64, -1.0], [64, float("nan")], ["x", 0.3], 7):
        assert records.draft_batch({"draft_batch": bad}) is None
    assert records.draft_batch({}) is None  # written before the batch was timed


def test_siblings_pay_for_their_rows_only_where_picked_often_enough():
    policy = Controller(OnlineCosts(F16_CPU, frozen=True), 8, has_draft=True, lookup=False, width=3)
    for _ in range(2):
        policy.draft_acceptance.observe([0.5] * 8, 4)
    assert policy.plan(8, 0, 0)[0] == "draft"
    assert policy.draft_more([0.6]) != "drop"  # the draft keeps a token it gave 60%
    assert policy.sibling(0.3)  # its second choice: a row of 8 ms against a 30% chance
    assert not policy.sibling(0.01)


def a_good_record() -> Acceptance:
    """A pair's record from earlier generations: a few hundred drafts, nearly all accepted."""
    acc = Acceptance()
    for _ in range(60):
        acc.observe([0.97] * 5, 5)
    acc.new_text()
    return acc


@pytest.mark.parametrize("true, record", [(F16_CPU, a_good_record), (MEMORY_BOUND, Acceptance)],
                         ids=["f16-cpu-good-record", "memory-bound-no-record"])
def test_a_draft_turned_off_by_a_bad_stretch_drafts_again_when_the_text_turns(true, record):
    """Prose the draft gets wrong, then code it gets right, in one generation. The stretch
    turns the draft off; plain rounds judge no drafts, and the draft falls a token further
    behind with each. Its catch-up, one batch spread over the tokens it will serve, must not
    keep it off: a pair that drafts well comes back as the text's mean returns to the pair's
    record (its catch-up in full, charged to one round, kept it off for good on this CPU);
    where catching up is cheap (a memory-bound target) a pair with no record is tried again
    from the exploration credit."""
    clock = Clock()
    policy = Controller(OnlineCosts(true), 8, has_draft=True, lookup=False, clock=clock, n_tokens=4096,
                        acceptance=record())
    bad, good, trace = constant(0.1, confidence=0.6), constant(0.95, confidence=0.97), []
    _, lengths = simulate(policy, true, [(80, bad), (300, good)], 380, clock=clock, trace=trace)
    assert sum(k == 0 for k in lengths[50:80]) >= 25  # the bad stretch turned it off (tries aside)
    assert sum(k > 0 for k in lengths[180:]) >= 0.9 * len(lengths[180:]), lengths[80:180]
    n_tokens, seconds = np.sum(trace[180:], axis=0)
    assert n_tokens / seconds >= 0.9 * best_fixed(true, 0.95)[1], (n_tokens / seconds, best_fixed(true, 0.95))


@pytest.mark.parametrize("true", [F16_CPU, MEMORY_BOUND], ids=["f16-cpu", "memory-bound"])
def test_trying_a_losing_draft_again_costs_at_most_the_exploration_share(true):
    """Tries pay from the credit, their catch-up included: where the draft's batch of the
    tokens it missed costs more than the share earns meanwhile (a CPU), tries stop."""
    from specllama.controller.policy import EXPLORE_SHARE

    clock = Clock()
    policy = Controller(OnlineCosts(true), 8, has_draft=True, lookup=False, clock=clock, n_tokens=10**6)
    rate, lengths = simulate(policy, true, constant(0.05, confidence=0.9), 3000, clock=clock)
    if true is MEMORY_BOUND:
        assert sum(k > 0 for k in lengths) >= 10  # it does try again, now and then
    assert rate >= (1 - EXPLORE_SHARE - 0.01) / true.v(1), rate * true.v(1)


def test_trying_again_never_starts_the_drafts_prefill_and_follows_the_cost_model():
    """Credit comes from modelled times, so frozen costs decide the same rounds every time."""
    policy = Controller(OnlineCosts(F16_CPU, frozen=True), 8, has_draft=True, lookup=False)
    for _ in range(10):  # a pair with a poor record
        policy.draft_acceptance.observe([0.5] * 4, 0)
    assert policy.plan(8, 0, 0)[0] == "none"
    tried = []
    for i in range(200):
        source, _ = policy.plan(8, 0, 0, lag=(2, i % 2 == 1))
        tried.append((i, source))
        policy.observe(RoundOutcome(source, Proposal([]), [ACCEPTED], 5.0, True))  # the clock says nothing
    assert all(i % 2 == 0 for i, source in tried if source == "draft")
    assert any(source == "draft" for _, source in tried)


def test_an_untried_draft_keeps_its_sure_tokens_where_the_second_row_is_dear():
    """F16 on this CPU: the second row of a pass costs 40 ms, the third 8. Optimism picks an
    untried draft; its drafts are then weighed against what plain decoding achieves, not
    against the optimistic rate (which dropped every token, so the draft was judged on dropped
    tokens alone and never proposed one), and a row is weighed with the rows after it."""
    policy = Controller(OnlineCosts(F16_CPU, frozen=True), 8, has_draft=True, lookup=False)
    assert policy.plan(8, 0, 0) == ("draft", 8)
    assert policy.draft_more([0.97]) == "more"
    assert policy.draft_more([0.97, 0.97]) == "more"


def test_a_pairs_record_round_trips_and_a_new_process_still_tries_the_draft_first():
    import json

    acc = Acceptance()
    for _ in range(30):
        acc.observe([0.95, 0.6, 0.3], 2)
    acc.siblings.judge(0.2, True, proposed=False)
    again = Acceptance.from_record(json.loads(json.dumps(acc.record())))
    assert [again.predict(c) for c in (0.2, 0.6, 0.95)] == [acc.predict(c) for c in (0.2, 0.6, 0.95)]
    assert again.long_run() == acc.long_run() and again.siblings.predict(0.2) == acc.siblings.predict(0.2)
    assert again.n_judged == 0 and again.mean() == pytest.approx(acc.long_run())  # optimism first, then the record


@pytest.mark.parametrize("record", [None, {}, {"hits": [1.0], "seen": [1.0], "long": [1, 1]},
                                    {"hits": [2.0] * 8, "seen": [1.0] * 8, "long": [1, 2]},
                                    {"hits": [0.0] * 8, "seen": [1.0] * 8, "long": ["x", 2]},
                                    {"hits": [0.0] * 8, "seen": [float("nan")] * 8, "long": [1, 2]}])
def test_a_malformed_record_is_a_fresh_start(record):
    acc = Acceptance.from_record(record)
    assert acc.seen.sum() == 0 and acc.long_run() == 0.6


def test_a_lane_drafts_exactly_where_drafting_raises_all_lanes_rate():
    """shared_pass_costs: a lane comparing its own rates under v' (plain vs k drafts, each
    accepted with probability a) decides as all lanes' tokens per second would: its drafts
    pay where what they add (expected tokens over their steps and the rows they add to the
    pass as it is) beats plain batching's rate, n_lanes / v(n_lanes), whatever the other
    lanes' drafts put in the pass; alone (one lane) v' is the pass curve itself."""
    from specllama.controller.costs import shared_pass_costs

    rng = np.random.default_rng(3)
    v = np.concatenate(([0.0], 0.1 + np.cumsum(rng.uniform(0.002, 0.05, 40))))
    assert np.array_equal(shared_pass_costs(v, 0, 1, 8), v[:9])
    n_agree = 0
    for _ in range(300):
        n_lanes = int(rng.integers(2, 6))
        n_other = n_lanes - 1 + int(rng.integers(0, 8))  # the others' rows, drafts included
        k, a, c_d = int(rng.integers(1, 6)), float(rng.uniform(0.2, 0.95)), float(rng.uniform(0.005, 0.06))
        w = shared_pass_costs(v, n_other, n_lanes, 8)
        gain = sum(a ** m for m in range(1, k + 1))
        own = (1 + gain) / (k * c_d + w[k + 1]) > 1 / w[1]
        # all lanes: what this lane's k drafts add (tokens, and seconds of the pass as it is)
        # against plain batching's rate, one row a lane
        added = k * c_d + v[n_other + 1 + k] - v[n_other + 1]
        together = gain / added > n_lanes / v[n_lanes]
        assert own == together
        n_agree += own
    assert 0 < n_agree < 300  # both answers occur


def test_a_lane_whose_pass_ran_alone_still_plans_for_the_lanes_generating():
    """planning_load: a lane whose last pass held its rows alone (the three others were still
    drafting) plans for a pass with a row of each of them; with v' of that load, drafting 4
    at 0.9 no longer pays where alone it would (the F16 curve of a lane test on our CPU)."""
    from specllama.controller.costs import planning_load, shared_pass_costs

    assert planning_load(0, 1, 4) == (3, 4)
    assert planning_load(9, 3, 2) == (9, 3)  # what the pass held, where it held more
    assert planning_load(0, 1, 1) == (0, 1)
    v = np.array([0.0, 0.080, 0.130, 0.143, 0.146, 0.166, 0.190, 0.210, 0.230, 0.252, 0.275, 0.298])
    gain, c_d = sum(0.9 ** m for m in range(1, 5)), 0.030

    def drafting_pays(n_other, n_lanes):
        w = shared_pass_costs(v, n_other, n_lanes, 6)
        return (1 + gain) / (4 * c_d + w[5]) > 1 / w[1]

    assert drafting_pays(0, 1) and not drafting_pays(*planning_load(0, 1, 4))


def test_a_lanes_first_round_plans_for_the_lanes_generating_as_it_starts():
    """Controller.load before any round: a request joining seven others plans its first round
    for their pass, so it decodes plainly where, alone, it drafts (and starts the draft's
    prefill). Without load() its first round planned as if alone (the F16 lane curve)."""
    v = [0.080, 0.130, 0.143, 0.146, 0.166, 0.190, 0.210, 0.230, 0.252, 0.275, 0.298, 0.320,
         0.340, 0.360, 0.380, 0.400, 0.420, 0.440, 0.460, 0.480, 0.500, 0.520, 0.540, 0.560]
    costs = Costs(tuple(v), 0.030)
    alone, joining = (Controller(OnlineCosts(costs, v1_live=[0.080] * 3), 16, has_draft=True, lookup=False,
                                 clock=Clock()) for _ in range(2))
    joining.load(7, 8, None)
    assert alone.plan(4, 0, 0)[0] == "draft"
    assert joining.plan(4, 0, 0) == ("none", 0)


def test_draft_steps_timed_beside_other_lanes_do_not_price_a_lone_requests_steps():
    """A step timed while other lanes generate holds their rows and turns: it prices steps at that
    load, and a request alone afterwards still prices its own at what alone measured (one window
    for both left a lone request after a burst pricing its steps at 2-3x)."""
    costs = OnlineCosts(MEMORY_BOUND)
    for _ in range(9):
        costs.observe_draft_step(0.012)
        costs.observe_draft_step(0.040, shared=True)
    assert costs.draft_cost(False) == costs.draft_token == pytest.approx(0.012)
    assert costs.draft_cost(True) == pytest.approx(0.040)
    lane = Controller(costs, 16, has_draft=True, lookup=False, clock=Clock())
    lane.load(3, 4, None)
    assert lane._c_d == pytest.approx(0.040)
    lane.load(0, 1, None)
    assert lane._c_d == pytest.approx(0.012)
    fresh = OnlineCosts(MEMORY_BOUND)
    fresh.observe_draft_step(0.040, shared=True)  # fewer than three beside others: the step alone
    assert fresh.draft_cost(True) == MEMORY_BOUND.draft_token


def test_rows_past_the_pass_room_are_priced_as_a_pass_of_their_own():
    """shared_pass_costs with n_cap: rows that do not fit beside the others' are decoded in a
    pass of their own, and a lane's rate under v' still decides as the aggregate rate of all
    lanes would (the others then pay their pass without it)."""
    from specllama.controller.costs import shared_pass_costs

    rng = np.random.default_rng(5)
    v = np.concatenate(([0.0], 0.1 + np.cumsum(rng.uniform(0.002, 0.05, 40))))
    n_apart = 0
    for _ in range(300):
        n_lanes = int(rng.integers(2, 6))
        n_other = n_lanes - 1 + int(rng.integers(0, 8))
        n_cap = n_other + 1 + int(rng.integers(0, 6))  # the lane's plain row always fits
        k, a, c_d = int(rng.integers(1, 8)), float(rng.uniform(0.2, 0.95)), float(rng.uniform(0.005, 0.06))
        w = shared_pass_costs(v, n_other, n_lanes, 8, n_cap)
        gain = sum(a ** m for m in range(1, k + 1))
        own = (1 + gain) / (k * c_d + w[k + 1]) > 1 / w[1]
        if n_other + k + 1 <= n_cap:
            t_drafted = v[n_other + 1 + k]
        else:  # the others' pass, then the lane's own
            t_drafted, n_apart = v[n_other] + v[k + 1], n_apart + 1
        together = gain / (k * c_d + t_drafted - v[n_other + 1]) > n_lanes / v[n_lanes]
        assert own == together
    assert n_apart > 50


def test_a_lane_s_chain_stops_where_the_pass_has_room():
    """Two lanes, the other's 8 rows in the pass, a cap of 17 rows (F16 at the default level on
    our CPU): a lane whose confident draft is accepted keeps drafting to 16 tokens where the
    cap is not priced, so the two lanes' passes are decoded apart; priced, it stops at the 9
    rows that still ride with the other lane's."""
    v = (0.080, 0.130, 0.143, 0.146, 0.166, 0.190, 0.210, 0.230, *(0.230 + 0.019 * (n - 8) for n in range(9, 30)))
    costs = Costs(verify=v, draft_token=0.025)
    n_chain = {}
    for n_cap in (None, 17):
        clock = Clock()
        policy = Controller(OnlineCosts(costs, frozen=True), 16, has_draft=True, lookup=False, clock=clock,
                            n_tokens=4096)
        for _ in range(40):
            policy.observe(RoundOutcome("draft", Proposal([1] * 4), [1] * 5, 0.2, True, DraftReport([0.97] * 4),
                                        n_verify=13, n_other=8, n_lanes=2, n_cap=n_cap))
        assert policy.plan(16, 0, 0) == ("draft", 16)
        confidences = [0.97]
        while policy.draft_more(confidences) == "more" and len(confidences) < 16:
            clock.now += 0.025
            confidences.append(0.97)
        n_chain[n_cap] = len(confidences)
    assert n_chain == {None: 16, 17: 8}


def test_two_lanes_that_both_want_long_chains_plan_within_one_pass():
    """Two lanes at once, each sure of its drafts, the other's last batch one row (it decoded
    plainly, or its pass went alone): planning for all of the 17-row pass beside that row (F16
    at the default level on our CPU), each lane drafts 16 tokens and the two batches overflow
    the pass (two passes, traced); planning for its share (fair_room, as decode.py prices a
    lane), each lane's chain leaves the other its share and both ride in one pass."""
    from specllama.runtime.shared import fair_room

    v = (0.080, 0.130, 0.143, 0.146, 0.166, 0.190, 0.210, 0.230, *(0.230 + 0.019 * (n - 8) for n in range(9, 30)))
    n_rows = {}
    for n_room in (17 - 1, fair_room(17, 2)):  # the cap less the other's row (before), its share
        clock = Clock()
        policy = Controller(OnlineCosts(Costs(verify=v, draft_token=0.018), frozen=True), 16, has_draft=True,
                            lookup=False, clock=clock, n_tokens=4096)
        for _ in range(40):
            policy.observe(RoundOutcome("draft", Proposal([1] * 4), [1] * 5, 0.2, True, DraftReport([0.97] * 4),
                                        n_verify=6, n_other=1, n_lanes=2, n_cap=1 + n_room))
        assert policy.plan(16, 0, 0) == ("draft", 16)
        confidences = [0.97]
        while policy.draft_more(confidences) == "more" and len(confidences) < 16:
            clock.now += 0.018
            confidences.append(0.97)
        n_rows[n_room] = 1 + len(confidences)
    assert 2 * n_rows[16] > 17  # both lanes alike: two passes
    assert 2 * n_rows[fair_room(17, 2)] <= 17


def test_a_lane_s_share_of_a_pass():
    """Pure: fair_room gives a lane alone the whole cap and each of n lanes cap // n rows (at
    least one), and the drafting lanes split what lanes whose last batch was one row (decoding
    plainly) leave of theirs: the lanes' rooms fit one pass as long as no plain lane starts
    drafting, and drafting lanes' last batches, short or long, lend nothing (two lanes lent each
    other's and overflowed)."""
    from specllama.runtime.shared import fair_room

    assert fair_room(17, 1) == 17 and fair_room(17, 2) == 8 and fair_room(4, 8) == 1
    assert fair_room(17, 2, [2]) == fair_room(17, 2, [16]) == 8  # a drafting lane's share is its own
    assert fair_room(17, 2, [1]) == 15 and fair_room(17, 4, [1, 1, 5]) == 4 + 2 * 3 // 2
    assert fair_room(17, 4, [1, 1, 1, 1, 1]) == 4 + 3 * 3  # lanes no longer generating lend nothing
    rng = np.random.default_rng(3)
    for _ in range(2000):
        cap, n_active = int(rng.integers(2, 40)), int(rng.integers(2, 9))
        if n_active > cap:
            continue
        plain = rng.random(n_active) < 0.5  # the lanes whose last batch was one row
        rows = [1 if p else int(rng.integers(2, cap + 1)) for p in plain]
        rooms = [fair_room(cap, n_active, rows[:i] + rows[i + 1:]) for i in range(n_active)]
        planned = [1 if p else room for p, room in zip(plain, rooms)]  # the plain lanes stay plain
        assert sum(planned) <= cap


# F16 at 3,000 tokens of KV on our 2-core AMD (a traced chat): one token 120 ms, 2: 196, 3: 217,
# then ~22 ms a row; the 0.5B draft 40 ms a token. Drafting breaks even at about 0.81.
LONG_F16_CPU = Costs(verify=(0.120, 0.196, 0.217, *(0.241 + 0.022 * (n - 4) for n in range(4, 18))),
                     draft_token=0.040)


def test_an_unlucky_start_does_not_keep_a_paying_draft_off():
    """A fresh pair drafts this text at 0.9, where drafting breaks even at about 0.81 and the
    best fixed length is 1.16x plain decoding. Greedy on its estimate, the controller went
    plain for good in half the runs: a start of, say, 6 accepted of 8 reads below break-even,
    plain rounds judge no drafts, and catching up costs a CPU more than the exploration credit
    earns. Hoping for 1.5 standard errors above the estimate (counted over the pair's judged
    drafts), it drafts on until the evidence can say; a draft that loses stops (the
    exploration-share test above)."""
    n_on = 0
    for seed in range(10):
        clock = Clock()
        policy = Controller(OnlineCosts(LONG_F16_CPU, frozen=True), 8, has_draft=True, lookup=False, clock=clock,
                            n_tokens=4096)
        _, lengths = simulate(policy, LONG_F16_CPU, constant(0.9, confidence=0.9), 300, seed=seed, clock=clock)
        n_on += sum(k > 0 for k in lengths[100:]) >= 0.9 * len(lengths[100:])
    assert n_on >= 8, n_on


def test_hoping_for_a_draft_that_loses_costs_a_few_percent():
    """The hope's price: at 0.75, just below break-even on that machine, a fresh pair's 300
    rounds stay within 5% of plain decoding in every run (the hope shrinks as drafts are
    judged; hoping 5 standard errors instead of 1.5 lost 12%)."""
    for seed in range(10):
        clock = Clock()
        policy = Controller(OnlineCosts(LONG_F16_CPU, frozen=True), 8, has_draft=True, lookup=False, clock=clock,
                            n_tokens=4096)
        rate, _ = simulate(policy, LONG_F16_CPU, constant(0.75, confidence=0.9), 300, seed=seed, clock=clock)
        assert rate * LONG_F16_CPU.v(1) >= 0.95, (seed, rate * LONG_F16_CPU.v(1))


def test_a_new_process_explores_the_draft_alone_but_beside_other_lanes_plans_on_the_record():
    """A record of 30% (prose) read by a new process: a request alone tries the draft anyway
    (optimism before N_EXPLORE judged drafts); a request beside three others plans on the
    record, since the draft's prefill an explorer starts stalls every lane's pass."""
    acc = Acceptance()
    for i in range(300):
        acc.observe([0.6] * 3, 1 if i % 5 < 2 else 0)  # 2 of 7 judged drafts accepted
    record = Acceptance.from_record(acc.record())
    assert record.n_judged == 0 and record.long_run() < 0.5
    alone = Controller(OnlineCosts(F16_CPU, frozen=True), 8, has_draft=True, lookup=False, acceptance=record)
    assert alone.plan(8, 0, 0, lag=(40, True))[0] == "draft"
    beside = Controller(OnlineCosts(F16_CPU, frozen=True), 8, has_draft=True, lookup=False, acceptance=record)
    beside.load(3, 4, None)  # the pass holds a row of each of 3 other lanes
    assert beside.plan(8, 0, 0, lag=(40, True))[0] == "none"


def test_beside_other_lanes_a_draft_is_planned_on_its_mean_not_on_hope():
    """Alone, a plan hopes for RECORD_HOPE standard errors above the mean (only drafting renews
    it); beside other lanes a draft that loses costs every lane's pass while what it teaches
    serves one, so a lane drafts only where its mean pays."""
    def lane(n_hits: int) -> Controller:
        acc = Acceptance()
        for _ in range(2):
            acc.observe([0.9] * 12, n_hits)
        p = Controller(OnlineCosts(F16_CPU, frozen=True), 8, has_draft=True, lookup=False,
                       acceptance=Acceptance.from_record(acc.record()))
        for _ in range(4):
            p.draft_acceptance.observe([0.9] * 12, n_hits)
        p.load(3, 4, None)  # a row of each of 3 other lanes in the pass
        return p

    near, above = lane(6), lane(7)
    assert near.draft_acceptance.mean() < above.draft_acceptance.mean() < near.draft_acceptance.hoped_mean()
    assert above.plan(8, 0, 0)[0] == "draft"
    assert near.plan(8, 0, 0)[0] == "none"  # its hope would have drafted: above's mean pays
    near.load(0, 1, None)
    assert near.plan(8, 0, 0)[0] == "draft"  # alone


def test_a_generation_without_a_limit_prices_the_draft_s_prefill_over_its_expected_length():
    """A client that sends no max_tokens leaves the context's thousands of tokens: priced over
    them, a 2,880-token prefill of the draft (15 s here) looked free, and the first turn of a
    chat over a long file waited for it to draft a short answer. At its start a generation is
    expected to run EXPECTED_LENGTH tokens; one that has run g tokens about g more."""
    from specllama.controller.policy import EXPECTED_LENGTH

    timed = Costs(F16_CPU.verify, 0.020, draft_batch=(64, 0.350))

    def policy(n_tokens: int) -> Controller:
        p = Controller(OnlineCosts(timed, frozen=True), 8, has_draft=True, lookup=False, n_tokens=n_tokens)
        for _ in range(20):
            p.draft_acceptance.observe([0.9] * 8, 4)  # 80% accepted
        return p

    unlimited, limited = policy(30000), policy(EXPECTED_LENGTH)
    assert unlimited.expected_left() == EXPECTED_LENGTH
    assert unlimited.lag_cost(2880, True) == pytest.approx(limited.lag_cost(2880, True))
    assert policy(100).expected_left() == 100  # within the limit
    assert unlimited.plan(8, 0, 0, lag=(2880, True))[0] == "none"
    assert unlimited.plan(8, 0, 0, lag=(60, True))[0] == "draft"  # a short prompt's prefill pays
    unlimited.n_left -= 3000  # it has run 3,000 tokens: about as many more are expected
    assert unlimited.expected_left() == 3000
    assert unlimited.plan(8, 0, 0, lag=(2880, True))[0] == "draft"


def test_the_draft_s_prefill_is_started_exactly_where_it_repays_itself_over_the_generation():
    """Paying the draft's prefill once, then drafting the expected rest of the generation at the
    text's mean, must take less time than decoding it plainly: the plan starts the prefill on
    exactly those prompts. Spread per round at a one-draft round's 1 + alpha tokens, a round of
    six drafts carried a third of its share, and prefills three times too long to repay
    themselves were started (the F16 pair at 2,900 tokens: 17 s of prefill, the turn 1.25x
    plain decoding)."""
    timed = Costs(F16_CPU.verify, 0.020, draft_batch=(64, 0.350))
    p = Controller(OnlineCosts(timed, frozen=True), 8, has_draft=True, lookup=False)
    for _ in range(40):
        p.draft_acceptance.observe([0.95] * 8, 8)
    alpha, horizon, v = p.draft_acceptance.mean(), p.expected_left(), p.costs.table(9)
    per_token = min((k * 0.020 + v[k + 1]) / (1 + sum(alpha ** j for j in range(1, k + 1))) for k in range(1, 9))
    decisions = {}
    for n_lag in range(400, 6000, 50):
        prefill = p.costs.catch_up(n_lag) - p.costs.catch_up(1)
        drafted, plain = prefill + horizon * per_token, horizon * v[1]
        if prefill > p.explore_allowance() and abs(drafted / plain - 1) > 0.02:
            decisions[n_lag] = (p.plan(8, 0, 0, lag=(n_lag, True))[0], "draft" if drafted < plain else "none")
    assert {want for _, want in decisions.values()} == {"draft", "none"}  # the sweep crosses the line
    assert all(got == want for got, want in decisions.values()), decisions


def test_a_fresh_pair_explores_on_a_short_prompt_but_a_long_prompt_s_prefill_needs_its_record():
    """Before N_EXPLORE drafts are judged a plan hopes the draft is always right, so a new pair
    is tried. A short prompt's prefill is a few rounds' risk; a long one's is paid in full on
    the request's path (and idle time catches the draft up for the next turn for free), so
    above explore_allowance() it is judged on the record: at the 0.6 prior, not started."""
    timed = Costs(F16_CPU.verify, 0.020, draft_batch=(64, 0.350))
    p = Controller(OnlineCosts(timed, frozen=True), 8, has_draft=True, lookup=False)
    short, long = p.costs.catch_up(60) - p.costs.catch_up(1), p.costs.catch_up(600) - p.costs.catch_up(1)
    assert short < p.explore_allowance() < long
    assert p.plan(8, 0, 0, lag=(60, True))[0] == "draft"
    assert p.plan(8, 0, 0, lag=(600, True))[0] == "none"


def test_a_draft_step_is_priced_at_the_length_of_the_context_it_attends_over():
    """Each draft step attends over every cached token: on this CPU the 0.5B draft's step took
    38 ms at the calibration's 64 tokens and 89 ms after 2,900. Priced at 38 ms, a turn over a
    2,870-token prompt expected to gain from paying the draft's 17 s prefill and drafting at a
    90% record; at the step's price there it cannot, and the turn decodes plainly. Once the
    draft has caught up (idle), drafting at that length still pays and is chosen."""
    short = Costs((0.165, 0.182, 0.198, 0.215, 0.230, 0.246, *(0.246 + 0.016 * n for n in range(1, 12))),
                  0.038, draft_batch=(64, 0.340))
    long = Costs(short.verify, 0.038, short.draft_batch, draft_kv=(2900, 0.089))
    costs = OnlineCosts(long)
    assert costs.draft_cost(False, 64) == pytest.approx(0.038)
    assert costs.draft_cost(False, 2900) == pytest.approx(0.089)
    assert 0.038 < costs.draft_cost(False, 1500) < 0.089
    for _ in range(3):  # live steps are taken back to the short context, and priced at each length
        costs.observe_draft_step(0.178, n_kv=2900)
    assert costs.draft_token == pytest.approx(0.076) and costs.draft_cost(False, 2900) == pytest.approx(0.178)

    def first_plan(seed: Costs, lag: tuple[int, bool]) -> str:
        p = Controller(OnlineCosts(seed, frozen=True), 8, has_draft=True, lookup=False)
        for _ in range(40):
            p.draft_acceptance.observe([0.95] * 8, 8)
        assert p.draft_acceptance.mean() > 0.88
        return p.plan(8, 0, 0, lag=lag, n_kv=2870)[0]

    assert first_plan(short, (2870, True)) == "draft"  # the short step's price: the prefill looks repaid
    assert first_plan(long, (2870, True)) == "none"
    assert first_plan(long, (0, False)) == "draft"


def test_verify_passes_are_priced_at_the_length_of_the_context_a_probe_timed():
    """Rounds at 2,900 cached tokens (F16 1.5B, this CPU) took 205 / 251 / 317 / 395 ms for 1 / 2
    / 4 / 6 rows against 165 / 182 / 215 / 246 at the calibration's short context: each further
    row cost about twice the short curve's, and a long turn's rounds drafted on the short price.
    The fidelity probe at that length times such passes (one each, scattered); the costs price
    the length's passes from them, in a line between lengths, and a round there then measures
    the machine (the short context's prices stay), not the context."""
    from types import SimpleNamespace

    short = Costs((0.165, 0.182, 0.198, 0.215, 0.230, 0.246, *(0.246 + 0.016 * n for n in range(1, 12))), 0.018)
    true = [0.205 + 0.038 * n for n in range(17)]
    scatter = [1.0, 1.12, 0.9, 1.0, 1.1, 0.93, 1.0, 1.08, 0.95, 1.0, 1.1, 0.9, 1.0, 1.05, 0.97, 1.0, 1.0]
    groups: dict = {}
    costs = OnlineCosts(short, v1_live=[0.165] * 3, verify_kv=groups)

    def plan_at(n_kv: int) -> int:
        ticks = iter(np.arange(0.0, 10.0, 0.018))  # each draft step takes its calibrated 18 ms
        p = Controller(costs, 16, has_draft=True, lookup=False, clock=lambda: float(next(ticks)))
        for _ in range(40):
            p.draft_acceptance.observe([0.9] * 8, 7)
        assert p.plan(16, 0, 0, n_kv=n_kv)[0] == "draft"
        n = 1
        while p.draft_more([0.9] * n) == "more":  # how far the draft goes at a steady 90%
            n += 1
        return n

    k_short_price = plan_at(2900)
    assert costs.table(6, 2900)[1:].tolist() == pytest.approx(short.verify[:6])  # nothing timed there yet
    groups[11] = SimpleNamespace(n_kv=3072, verify_seconds=tuple(t * s for t, s in zip(true, scatter)))
    v = costs.table(6, 2900)  # the probe's cells (3,072): its passes, the scatter smoothed away
    assert v[1] == pytest.approx(0.205) and v[2] == pytest.approx(0.243, rel=0.03)
    assert v[6] == pytest.approx(0.395, rel=0.03)
    assert costs.table(6, 100)[1:].tolist() == pytest.approx(short.verify[:6])
    assert short.verify[0] < costs.table(1, 1500)[1] < 0.205  # in a line between
    assert costs.table(1, 6000)[1] > 0.205  # and on beyond the longest length timed
    assert plan_at(2900) < k_short_price  # each row dearer: shorter drafts
    for _ in range(9):  # rounds at that length measure the machine, not the context
        costs.observe_verify(4, 0.317, n_kv=2900)
    assert costs.table(4, 100)[4] == pytest.approx(0.215, rel=0.05)
    frozen = OnlineCosts(short, frozen=True, verify_kv=groups)  # seeded: the calibration alone
    assert frozen.table(2, 2900)[1:].tolist() == pytest.approx(short.verify[:2])


def test_a_long_conversation_s_rounds_do_not_rewrite_the_short_curve():
    """Priced from the short curve, rounds at 2,900 tokens (F16 pair, exact=1.0, this CPU) read
    as a machine 1.5x slower: drift() replaced the cached curve, 73 / 91 / 101 / 109 ms for 1-4
    rows becoming 82 / 119 / 135 / 150 on disk, which every later short conversation then used.
    Priced at the length the probe timed, the same rounds agree with the curve."""
    from types import SimpleNamespace

    short = Costs((0.073, 0.091, 0.101, 0.109, 0.117, 0.125, *(0.125 + 0.008 * n for n in range(1, 12))), 0.016)
    probe = SimpleNamespace(n_kv=3072, verify_seconds=(0.102, 0.138, 0.156, 0.172, 0.189, 0.203, 0.220))
    drifted = []
    for verify_kv in (None, {4: probe}):
        costs = OnlineCosts(short, v1_live=[0.073] * 3, verify_kv=verify_kv)
        for i in range(40):  # what rounds there took: the probe's passes, within their scatter
            n = 2 + i % 5
            costs.observe_verify(n, probe.verify_seconds[n - 1] * (1.05 if i % 2 else 0.95), n_kv=2900)
            if i % 8 == 0:
                costs.observe_verify(1, 0.100, n_kv=2900)
        drifted.append(costs.drift())
    assert drifted[0] is not None and drifted[0].v(4) > 1.3 * short.v(4)
    assert drifted[1] is None


def test_rounds_of_several_rows_alone_never_rewrite_the_one_token_cost():
    """Lanes under load pass several rows at a time: their rounds set the batches' level, which
    load's one-token timings follow as stand-ins, and drift() wrote a curve with one token at
    52 ms where every round of one row had taken 92-108 ms (F16 pair, 8 lanes, this CPU). Only
    rounds of one row measure v(1), and the curve written keeps it inside what they measured."""
    short = Costs((0.073, 0.091, 0.101, 0.109, 0.117, 0.125, *(0.125 + 0.008 * n for n in range(1, 12))), 0.016)
    costs = OnlineCosts(short, v1_live=[0.075] * 3)
    for i in range(40):  # passes of 4-10 rows, faster than the probe measured them
        n = 4 + i % 7
        costs.observe_verify(n, 0.62 * short.v(n))
    assert costs.drift() is None
    for seconds in (0.092, 0.108, 0.099):  # then rounds of one row
        costs.observe_verify(1, seconds)
    drifted = costs.drift()
    assert drifted is not None
    assert 0.092 <= drifted.v(1) <= 0.108
    assert all(b >= a for a, b in zip(drifted.verify, drifted.verify[1:]))


def test_other_lanes_drafts_do_not_lower_the_bar_a_lanes_drafts_must_clear():
    """A burst of 8 requests: the first planned alone and drafted a long chain, so the pass
    held 14 rows of others beside a lane. Priced from that pass (a plain row's share 48 ms
    where plain batching's is 27), the lane drafted too, every lane followed and prefilled the
    draft, and the burst ran at 0.76x plain batching (F16, our CPU). Its drafts must beat
    plain batching's rate however many rows the others put in the pass."""
    v = [0.118, 0.136, 0.139, 0.184, 0.189, 0.193, 0.207, 0.220, 0.251, 0.281, 0.311, 0.342, 0.356, 0.370,
         0.384, 0.398, *(0.398 + 0.014 * (n - 16) for n in range(17, 40))]
    costs = Costs(tuple(v), 0.023)

    def lane(n_other: int, n_lanes: int) -> Controller:
        c = Controller(OnlineCosts(costs, v1_live=[0.118] * 3), 16, has_draft=True, lookup=False,
                       acceptance=a_good_record(), clock=Clock())
        c.load(n_other, n_lanes, None)
        return c

    assert lane(7, 8).plan(4, 0, 0) == ("none", 0)  # one row a lane: plain
    assert lane(14, 8).plan(4, 0, 0) == ("none", 0)  # others drafting: still plain
    assert lane(0, 1).plan(4, 0, 0)[0] == "draft"  # alone it drafts
