"""The verifier as a pure function, on synthetic distributions with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specllama.decoding.sampling import Dist
from specllama.decoding.verify import greedy_verify, residual, speculative_verify

N_DRAWS = 100_000


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value of chi-square (Wilson-Hilferty); z=3.719 is alpha = 1e-4."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: np.ndarray, p: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom. Tokens expected fewer than min_expected
    times are pooled into one bin: below that the chi-square approximation does not hold, and a
    rare token drawn 5 times where 1 was expected alone would add 16 (a false alarm at 1e-4)."""
    expected = p * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens outside p's support: {np.flatnonzero(counts * ~support)}"
    rare = support & (expected < min_expected)
    observed = np.append(counts[support & ~rare], counts[rare].sum())
    expected = np.append(expected[support & ~rare], expected[rare].sum())
    if expected[-1] == 0:  # nothing rare
        observed, expected = observed[:-1], expected[:-1]
    stat = float(((observed - expected) ** 2 / expected).sum())
    return stat, len(expected) - 1


def first_token_counts(p: np.ndarray, q: np.ndarray, n_draws: int, seed: int) -> tuple[np.ndarray, int]:
    """Run the verifier on one drafted token per trial; count the first output token."""
    rng = np.random.default_rng(seed)
    p_dist, q_dist = Dist.from_dense(p), Dist.from_dense(q)
    drafts = rng.choice(len(q), size=n_draws, p=q)
    counts = np.zeros(len(p), dtype=np.int64)
    n_accepted_total = 0
    for x in drafts:
        n_accepted, token = speculative_verify([int(x)], [q_dist], [p_dist, p_dist], rng)
        counts[int(x) if n_accepted else token] += 1
        n_accepted_total += n_accepted
    return counts, n_accepted_total


CASES = {
    "random": (np.array([0.1, 0.2, 0.3, 0.15, 0.25]), np.array([0.3, 0.1, 0.1, 0.4, 0.1])),
    "q_zero_where_p_positive": (np.array([0.2, 0.3, 0.5, 0.0]), np.array([0.5, 0.5, 0.0, 0.0])),
    "p_zero_where_q_positive": (np.array([0.5, 0.5, 0.0, 0.0]), np.array([0.1, 0.2, 0.3, 0.4])),
    "p_one_hot": (np.array([0.0, 1.0, 0.0]), np.array([0.4, 0.3, 0.3])),
    "q_one_hot": (np.array([0.2, 0.5, 0.3]), np.array([0.0, 0.0, 1.0])),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_output_distribution_is_p(name):
    p, q = CASES[name]
    counts, _ = first_token_counts(p, q, N_DRAWS, seed=sum(map(ord, name)))
    stat, df = chi2_stat(counts, p)
    if df == 0:
        assert counts[np.argmax(p)] == N_DRAWS
    else:
        assert stat < chi2_critical(df), f"chi2={stat:.1f} (df={df}), counts={counts}, p={p}"


def test_chi2_check_detects_a_wrong_rule():
    """The statistical check can fail: accepting every draft yields q, which it must reject."""
    p, q = CASES["random"]
    rng = np.random.default_rng(0)
    counts = np.bincount(rng.choice(len(q), size=N_DRAWS, p=q), minlength=len(p))
    stat, df = chi2_stat(counts, p)
    assert stat > chi2_critical(df)


def test_p_equal_q_always_accepts():
    p = np.array([0.1, 0.4, 0.2, 0.3])
    _, n_accepted = first_token_counts(p, p, 5_000, seed=1)
    assert n_accepted == 5_000


def test_acceptance_rate_matches_theory():
    """E[accept] = sum_x min(p(x), q(x)) (Leviathan et al., section 3.3)."""
    p, q = CASES["random"]
    _, n_accepted = first_token_counts(p, q, N_DRAWS, seed=2)
    alpha = np.minimum(p, q).sum()
    assert abs(n_accepted / N_DRAWS - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / N_DRAWS)


def test_multi_token_draft_joint_distribution():
    """Two drafted positions: the first two output tokens are distributed as p_1 x p_2."""
    p1, q1 = CASES["random"]
    p2, q2 = CASES["q_zero_where_p_positive"][0][[0, 1, 2]], np.array([0.6, 0.2, 0.2])
    p2 = np.append(p2, 0.0) / p2.sum()
    q2 = np.append(q2, 0.0)
    rng = np.random.default_rng(3)
    P = [Dist.from_dense(p1), Dist.from_dense(p2), Dist.from_dense(np.array([0.5, 0.5, 0, 0, 0]))]
    Q = [Dist.from_dense(q1), Dist.from_dense(q2)]
    counts = np.zeros((5, 5), dtype=np.int64)
    n = 40_000
    for _ in range(n):
        x1 = int(rng.choice(5, p=q1))
        x2 = int(rng.choice(4, p=q2))
        n_acc, t = speculative_verify([x1, x2], Q, P, rng)
        out = [x1, x2][:n_acc] + [t]
        if len(out) < 2:  # rejected at position 1: the second token comes from p2 in the next round
            out.append(int(rng.choice(4, p=p2)))
        counts[out[0], out[1]] += 1
    joint = np.outer(p1, np.append(p2, 0.0)).ravel()
    stat, df = chi2_stat(counts.ravel(), joint)
    assert stat < chi2_critical(df)


def test_bonus_token_after_full_acceptance_comes_from_last_p():
    rng = np.random.default_rng(4)
    p_last = Dist(np.array([7]), np.array([1.0]))
    same = Dist.from_dense(np.array([0.0, 1.0]))
    assert speculative_verify([1, 1], [same, same], [same, same, p_last], rng) == (2, 7)


def test_deterministic_proposal_uses_sample_and_match():
    """q=None (prompt lookup): accepted with probability p(x), else drawn from p without x."""
    p = np.array([0.5, 0.3, 0.2])
    rng = np.random.default_rng(5)
    counts = np.zeros(3, dtype=np.int64)
    for _ in range(N_DRAWS // 2):
        n_acc, t = speculative_verify([0], [None], [Dist.from_dense(p)] * 2, rng)
        counts[0 if n_acc else t] += 1
    stat, df = chi2_stat(counts, p)
    assert stat < chi2_critical(df)


def test_residual_is_normalized_positive_part():
    p = Dist.from_dense(np.array([0.5, 0.3, 0.2, 0.0]))
    q = Dist.from_dense(np.array([0.1, 0.5, 0.2, 0.2]))
    r = residual(p, q)
    assert r.ids.tolist() == [0]
    assert r.probs.tolist() == [1.0]
    assert residual(p, p) is p


def test_residual_of_sparse_supports_in_any_order_over_a_whole_vocabulary():
    """Supports as samplers give them (most likely first, partly overlapping, a whole
    vocabulary's ids): the positive part of p - q over their union, ids ascending."""
    rng = np.random.default_rng(7)
    n_vocab = 151_936
    dists, dense = [], []
    for n in (n_vocab, 3_000):
        ids = rng.permutation(n_vocab)[:n]
        probs = rng.random(n)
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        dists.append(Dist(ids[order].astype(np.int64), probs[order]))
        dense.append(np.bincount(ids, probs, minlength=n_vocab))
    p, q = dists
    expected = np.maximum(dense[0] - dense[1], 0.0)
    r = residual(p, q)
    assert r.ids.tolist() == np.flatnonzero(expected > 0).tolist()
    np.testing.assert_allclose(r.probs, expected[r.ids] / expected.sum(), rtol=1e-12)
    assert abs(r.probs.sum() - 1.0) < 1e-12


def test_greedy_verify():
    assert greedy_verify([5, 6, 7], [5, 6, 7, 8]) == (3, 8)
    assert greedy_verify([5, 6, 7], [5, 9, 7, 8]) == (1, 9)
    assert greedy_verify([5, 6, 7], [4, 6, 7, 8]) == (0, 4)
    assert greedy_verify([], [3]) == (0, 3)


def test_greedy_verify_reads_rows_lazily():
    read = []

    def rows():
        for value in [5, 9, 7, 8]:
            read.append(value)
            yield value

    greedy_verify([5, 6, 7], rows())
    assert read == [5, 9]


def test_verifiers_need_k_plus_one_rows():
    with pytest.raises(ValueError):
        greedy_verify([1, 2], [1, 2])
    with pytest.raises(ValueError):
        d = Dist.from_dense(np.array([0.0, 1.0]))
        speculative_verify([1], [d], [d], np.random.default_rng(0))
