"""Python overhead per round outside llama_decode, independent of model speed.

Times the per-round work the loop does besides decoding, on logit rows of Qwen's real
vocabulary size: reading k+1 rows, verifying (argmax at temperature 0; the sampling transform
and speculative rule at temperature > 0), prompt-lookup bookkeeping and stats.
"""

from __future__ import annotations

import numpy as np
import pytest

from specllama.decoding.proposers import PromptLookupProposer
from specllama.decoding.sampling import SamplingSettings, distribution, greedy
from specllama.decoding.stats import Stats
from specllama.decoding.verify import greedy_verify, speculative_verify

N_VOCAB = 151_936
K = 5


def one_round(rows, drafts, q, sampling, rng, lookup, tokens, stats):
    if sampling.greedy:
        n, t = greedy_verify(drafts, (greedy(r) for r in rows))
    else:
        n, t = speculative_verify(drafts, q, (distribution(r, sampling) for r in rows), rng)
    lookup.propose(tokens, K, sampling, rng)
    stats.record_round(len(drafts), n)
    return n, t


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_overhead_per_round(benchmark, temperature):
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=N_VOCAB).astype(np.float32) * 4 for _ in range(K + 1)]
    sampling = SamplingSettings(temperature=temperature)
    drafts = [int(np.argmax(r)) for r in rows[:K]]  # all accepted: the most rows are read
    q = [distribution(r, sampling) for r in rows[:K]] if temperature else [None] * K
    tokens = rng.integers(0, 1000, size=2000).tolist()
    lookup = PromptLookupProposer()
    lookup.prefill(tokens)
    stats = Stats()
    benchmark.pedantic(one_round, args=(rows, drafts, q, sampling, rng, lookup, tokens, stats),
                       rounds=200, iterations=1, warmup_rounds=5)
    per_round_ms = benchmark.stats.stats.median * 1000
    benchmark.extra_info["per_round_ms"] = per_round_ms
    print(f"\noverhead per round at temperature {temperature}: {per_round_ms:.3f} ms (median)")


def controller_round(controller, confidences, n_accepted, t_verify):
    from specllama.decoding.proposals import DraftReport, Proposal, RoundOutcome

    source, k = controller.plan(16, 2, 8)
    drafted = []
    for c in confidences[:k]:
        drafted.append(c)
        if controller.draft_more(drafted) != "more":
            break
    n = min(n_accepted, len(drafted))
    offer = list(range(8))
    controller.observe(RoundOutcome(source, Proposal(list(range(len(drafted)))), list(range(n + 1)), t_verify,
                                    True, DraftReport(drafted), offer))


def test_controller_overhead_per_round(benchmark):
    """The auto controller's own work in a round of up to 16 drafts: under 0.5 ms."""
    from specllama.controller import Controller, Costs, OnlineCosts

    costs = Costs(tuple(0.074 + 0.017 * (n - 1) for n in range(1, 18)), 0.021)
    controller = Controller(OnlineCosts(costs), 16, has_draft=True, lookup=True)
    confidences = [0.97] * 16
    for _ in range(5):  # past the plain rounds that measure v(1)
        controller_round(controller, confidences, 16, 0.074)
    benchmark.pedantic(controller_round, args=(controller, confidences, 12, 0.2), rounds=200, iterations=1,
                       warmup_rounds=5)
    per_round_ms = benchmark.stats.stats.median * 1000
    benchmark.extra_info["per_round_ms"] = per_round_ms
    print(f"\ncontroller overhead per round (up to 16 drafts): {per_round_ms:.3f} ms (median)")
    assert per_round_ms < 0.5
