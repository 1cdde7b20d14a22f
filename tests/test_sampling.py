"""Sampling transforms as pure functions of (logits, settings, rng)."""

from __future__ import annotations

import numpy as np
import pytest

from specllama import InvalidParameterError, SamplingSettings
from specllama.decoding.sampling import NEAR_TOP, Dist, distribution, greedy, sample, top_probability


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(size=5000).astype(np.float32) * 3


def dense(dist: Dist, n: int) -> np.ndarray:
    out = np.zeros(n)
    out[dist.ids] = dist.probs
    return out


def reference(logits, s: SamplingSettings) -> np.ndarray:
    """A slow, obviously-correct version of llama.cpp's order: top_k, top_p, min_p, temperature."""
    order = sorted(range(len(logits)), key=lambda i: (-float(logits[i]), i))
    if s.top_k:
        order = order[:s.top_k]
    x = np.array([logits[i] for i in order], dtype=np.float64)
    if s.top_p < 1:
        p = softmax(x) if s.top_k else np.exp(x - np.log(np.exp(logits.astype(np.float64) - x[0]).sum()) - x[0])
        cum, n = 0.0, 0
        while n < len(p):
            cum += p[n]
            n += 1
            if cum >= s.top_p:
                break
        order, x = order[:n], x[:n]
    if s.min_p > 0:
        keep = softmax(x) >= s.min_p * softmax(x).max()
        order, x = [o for o, k in zip(order, keep) if k], x[keep]
    out = np.zeros(len(logits))
    out[order] = softmax(x / s.temperature)
    return out


@pytest.mark.parametrize("settings", [
    SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    SamplingSettings(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05),
    SamplingSettings(temperature=1.3, top_k=0, top_p=0.9, min_p=0.0),
    SamplingSettings(temperature=0.5, top_k=0, top_p=1.0, min_p=0.1),
    SamplingSettings(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0),
    SamplingSettings(temperature=2.0, top_k=100, top_p=0.5, min_p=0.0),
])
def test_distribution_matches_reference(logits, settings):
    got = dense(distribution(logits, settings), len(logits))
    np.testing.assert_allclose(got, reference(logits, settings), atol=1e-9)


def test_distribution_does_not_modify_logits(logits):
    before = logits.copy()
    distribution(logits, SamplingSettings(temperature=0.8))
    np.testing.assert_array_equal(before, logits)


def test_ids_are_sorted_most_likely_first(logits):
    d = distribution(logits, SamplingSettings(temperature=1.0, top_k=50))
    assert np.all(np.diff(d.probs) <= 0)
    assert d.ids[0] == np.argmax(logits)


def test_ties_are_broken_by_lower_id():
    logits = np.zeros(10, dtype=np.float32)
    assert greedy(logits) == 0
    settings = SamplingSettings(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    assert distribution(logits, settings).ids.tolist() == [0, 1, 2]


def test_sample_follows_the_distribution():
    d = Dist(np.array([3, 8, 1]), np.array([0.5, 0.3, 0.2]))
    rng = np.random.default_rng(1)
    draws = np.array([sample(d, rng) for _ in range(20_000)])
    for token, prob in zip(d.ids, d.probs):
        assert abs((draws == token).mean() - prob) < 0.02


def test_same_seed_same_draws_other_seeds_other_draws(logits):
    d = distribution(logits, SamplingSettings(temperature=1.0))
    a = [sample(d, np.random.default_rng(7)) for _ in range(5)]
    b = [sample(d, np.random.default_rng(7)) for _ in range(5)]
    assert a == b
    # the draws come from the generator: a sampler that ignored it (argmax) passes the line above
    assert len({sample(d, np.random.default_rng(seed)) for seed in range(64)}) > 1


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
])
def test_invalid_settings_name_the_parameter(kwargs, name):
    with pytest.raises(InvalidParameterError, match=rf"^{name}=") as info:
        SamplingSettings(**kwargs)
    assert info.value.name == name
    assert isinstance(info.value, ValueError)


def test_top_probability_is_the_softmax_top_within_its_bound():
    rng = np.random.default_rng(3)
    for scale in (0.5, 3.0, 12.0):  # flat rows (every logit counts) to peaked ones (a few do)
        row = (rng.standard_normal(151_936) * scale).astype(np.float32)
        top = greedy(row)
        shifted = row.astype(np.float64) - row[top]
        exact = 1.0 / np.exp(shifted).sum()
        got = top_probability(row, top)
        assert exact * (1 - 1e-6) <= got <= exact * (1 + len(row) * np.exp(-NEAR_TOP)), (scale, exact, got)
    # a row whose far logits together outweigh the top: still counted, as they are within reach
    row = np.zeros(1000, dtype=np.float32)
    row[7] = 1.0
    assert top_probability(row, 7) == pytest.approx(np.e / (np.e + 999))
    # far below the top, left out: the bound says how much that can be
    row[:] = -30.0
    row[7] = 0.0
    assert top_probability(row, 7) == 1.0 and 1.0 / (1 + 999 * np.exp(-30.0)) > 1 - 1e-9


def test_the_round_s_reductions_leave_openblas_alone():
    """np.dot of two long vectors goes to OpenBLAS, whose threads (one a core) then spin beside
    llama.cpp's: the sampled grammar test took 18-21 s with np.dot in the draft's steps, 13-14 s
    with sampling.inner. The modules a round runs through reduce in numpy's own loops."""
    import inspect
    import re

    from specllama.decoding import decode, proposers, sampling, verify
    from specllama.controller import policy
    from specllama.decoding.sampling import inner

    rng = np.random.default_rng(5)
    a, b = rng.random(151_936), rng.random(151_936)
    assert inner(a, b) == pytest.approx(float(np.dot(a, b)), rel=1e-12)
    for module in (decode, proposers, sampling, verify, policy):
        found = re.findall(r"np\.(?:dot|matmul|inner|vdot|linalg\.\w+)\(|\w \@ \w", inspect.getsource(module))
        assert not found, (module.__name__, found)


def test_top_candidates_are_the_n_largest_lowest_ids_first_on_ties():
    """Against a full sort, on rows of a random model's spread and a trained one's flat spread,
    with ties (rounded logits), -inf entries (a constraint's), vocabularies with and without a
    partial last group, and n on both sides of the row's group count (n_vocab // sampling.BLOCK)."""
    from specllama.decoding.sampling import BLOCK, top_candidates

    rng = np.random.default_rng(11)
    for n_vocab in (151_936, 49_152, 1_000):
        for scale, rounded in ((12.0, False), (2.0, False), (2.0, True)):
            row = (rng.standard_normal(n_vocab) * scale).astype(np.float32)
            if rounded:  # many ties, at the top too
                row = np.round(row).astype(np.float32)
            row[rng.choice(n_vocab, n_vocab // 10, replace=False)] = -np.inf
            expected = np.lexsort((np.arange(n_vocab), -row))
            for n in (1, 2, 5, 40, 64, 200, n_vocab // BLOCK, n_vocab // BLOCK + 1, 4096):
                if n < n_vocab:
                    assert top_candidates(row, n).tolist() == expected[:n].tolist(), (n_vocab, scale, rounded, n)
