"""Sampling through real models: reproducible with a seed, distributed as the target alone."""

from __future__ import annotations

import numpy as np
import pytest

from specllama.decoding.sampling import SamplingSettings, distribution
from test_verify import chi2_critical, chi2_stat

from conftest import own_target
from prompts import PROSE


def test_same_seed_same_text(pair):
    a = pair.generate(PROSE, max_tokens=32, temperature=0.9, seed=11)
    b = pair.generate(PROSE, max_tokens=32, temperature=0.9, seed=11)
    c = pair.generate(PROSE, max_tokens=32, temperature=0.9, seed=12)
    assert a.tokens == b.tokens and a.text == b.text
    assert c.tokens != a.tokens
    assert a.stats.n_drafted > 0


def second_tokens(llm, prompt: list[int], n_seeds: int, settings: dict) -> tuple[int, list[int], int]:
    """Two tokens per seed, speculating with n_draft=2: (the most frequent first token, the
    second tokens that followed it, drafts rejected in all)."""
    pairs, n_rejections = [], 0
    for seed in range(n_seeds):
        r = llm.generate(prompt, max_tokens=2, seed=seed, n_draft=2, **settings)
        pairs.append(tuple(r.tokens))
        n_rejections += r.stats.n_drafted - r.stats.n_accepted
    first = [t[0] for t in pairs]
    mode = max(set(first), key=first.count)
    return mode, [t[1] for t in pairs if t[0] == mode], n_rejections


@pytest.mark.slow  # the same chi-square on tiny models, attention target included, is test_hybrid's
def test_first_speculated_token_has_the_target_distribution(pair, plain):
    """The token after the prefill token is the first one a speculative round produces.

    Over many seeds, conditioned on the usual first token (":"), its empirical distribution
    must match p computed from the target alone with the same sampling transform. High
    temperature makes the draft disagree often, so the residual path is exercised.
    """
    settings = dict(temperature=1.5, top_k=8, top_p=1.0, min_p=0.0)
    prompt = plain.tokenize("Q: Name a random fruit.\nA")
    mode, second, n_rejections = second_tokens(pair, prompt, 250, settings)
    # p for the second token, computed as the target alone computes it: prefill, then one token
    with own_target(plain) as target:
        target.truncate(0)
        target.sync(prompt)
        target.decode([mode])
        p = distribution(target.logits(0), SamplingSettings(**settings))
    outside = set(second) - set(p.ids.tolist())
    assert not outside, f"tokens outside the target's top-k were produced: {outside}"
    observed = np.array([second.count(int(t)) for t in p.ids])
    stat, df = chi2_stat(observed, p.probs)
    assert stat < chi2_critical(df), (stat, df, observed, p.probs)
    assert len(second) > 120 and n_rejections > 20, (len(second), n_rejections)


def test_lookup_sampling_is_reproducible_and_uses_the_match_rule(model_paths):
    import specllama
    from conftest import SETTINGS

    with specllama.load(model_paths["target"], "ngram", **SETTINGS) as llm:
        prompt = "a b c d e f a b c d e f a b c d e f a b"
        a = llm.generate(prompt, max_tokens=24, temperature=0.7, seed=5, n_draft=3)
        b = llm.generate(prompt, max_tokens=24, temperature=0.7, seed=5, n_draft=3)
        assert a.tokens == b.tokens
        assert a.stats.n_drafted > 0 and a.stats.n_accepted > 0


def test_same_seed_same_text_whatever_ran_before(pair):
    """Found by the property test: the draft reused its cache across calls, so q depended on
    call history and a seed did not fix the text."""
    prompt = '"name": def def lighthouse 1.'
    pair.generate("def", max_tokens=1, n_draft=0)
    a = pair.generate(prompt, max_tokens=10, n_draft=2, temperature=0.9, seed=10)
    b = pair.generate(prompt, max_tokens=10, n_draft=2, temperature=0.9, seed=10)
    pair.generate("The lighthouse keeper", max_tokens=8, n_draft=2)
    c = pair.generate(prompt, max_tokens=10, n_draft=2, temperature=0.9, seed=10)
    assert a.tokens == b.tokens == c.tokens


def test_only_unseeded_generations_share_what_the_controller_learned(pair):
    """What the draft's confidence means is learned across a pair's unseeded generations, one
    calibration for greedy drafts (top probability) and one for sampled drafts (q of the
    token drawn); a seeded generation starts fresh and frozen, so history cannot steer it."""
    from specllama.options import GenerateOptions
    from specllama.request import Defaults, resolve

    # the auto controller needs the decode costs (run alone, no earlier test measured them); not how
    # prefills go in pieces beside other requests, which no test of this module has
    pair.warm_up(alone=True)

    def policy(seeded, greedy):
        options = GenerateOptions(temperature=0.0 if greedy else 0.7, seed=1 if seeded else None, n_draft="auto")
        request = resolve(pair.tokenize("hi"), options, pair.target, Defaults(pair.n_draft, pair.level, pair.tree))
        return pair.planner._policy(request)

    greedy, greedy_again, sampled = policy(False, True), policy(False, True), policy(False, False)
    assert greedy.draft_acceptance.pair is greedy_again.draft_acceptance.pair and greedy.costs is sampled.costs
    assert greedy.draft_acceptance is not greedy_again.draft_acceptance  # each text's mean its own
    assert sampled.draft_acceptance.pair is not greedy.draft_acceptance.pair
    seeded = policy(True, False)
    assert seeded.draft_acceptance.pair not in (greedy.draft_acceptance.pair, sampled.draft_acceptance.pair)
    assert seeded.costs.frozen and not greedy.costs.frozen
