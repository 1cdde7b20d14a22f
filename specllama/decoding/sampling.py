"""Sampling settings and the pure transforms that turn one logit row into a distribution.

The target (p) and the draft (q) go through the same transform, so speculative sampling
reproduces exactly the distribution of target-only sampling with these settings. Filters run
in llama.cpp's order, on the untempered logits: top_k, top_p, min_p, then temperature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..errors import InvalidParameterError


@dataclass(frozen=True)
class SamplingSettings:
    """How to pick the next token. temperature 0 means greedy (argmax).

    Defaults match llama.cpp and llama-cpp-python for temperature > 0.
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidParameterError("temperature", t, "a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidParameterError("top_k", self.top_k, "an integer >= 0 (0 = off)")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError("top_p", self.top_p, "in (0, 1] (1 = off)")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameterError("min_p", self.min_p, "in [0, 1] (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_real(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


class Dist(NamedTuple):
    """A sparse distribution: token ids (most likely first) and their probabilities (sum 1)."""

    ids: np.ndarray  # int64
    probs: np.ndarray  # float64

    @classmethod
    def from_dense(cls, probs: np.ndarray) -> "Dist":
        probs = np.asarray(probs, dtype=np.float64)
        ids = np.flatnonzero(probs > 0)
        return cls(ids, probs[ids] / probs[ids].sum())

    @classmethod
    def one_hot(cls, token: int) -> "Dist":
        return cls(np.array([token], dtype=np.int64), np.ones(1))

    def prob(self, token: int) -> float:
        hit = self.probs[self.ids == token]
        return float(hit[0]) if hit.size else 0.0


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[0])  # x is sorted descending, so x[0] is the max
    return e / e.sum()


# top_candidates splits a row into groups of this many logits: the n-th largest of their maxima
# is a floor for the n-th largest logit (n groups each hold one at least that large)
BLOCK = 128


def _near_top(logits: np.ndarray, n: int) -> np.ndarray:
    """Ids of the logits at least the n-th largest group maximum: the n largest among them, and
    every logit tied with the n-th. Group j holds every (n_vocab // BLOCK)-th logit from j (one
    vectorised max over a reshaped view, 11 us on 152k logits; contiguous blocks took 92 us),
    the last partial group its own; then one compare over the row."""
    n_groups = logits.shape[0] // BLOCK
    maxima = logits[:n_groups * BLOCK].reshape(BLOCK, n_groups).max(axis=0)
    if n_groups * BLOCK < logits.shape[0]:
        maxima = np.append(maxima, logits[n_groups * BLOCK:].max())
    floor = np.partition(maxima, maxima.shape[0] - n)[maxima.shape[0] - n]
    return np.flatnonzero(logits >= floor)


def _within_margin(logits: np.ndarray, n: int) -> np.ndarray:
    """Ids of the logits within a margin of the largest, the margin doubled until n are (for n
    past the row's group count, where _near_top cannot bound the n-th)."""
    top, margin = logits.max(), 8.0
    while True:
        pool = np.flatnonzero(logits >= top - margin)
        if pool.shape[0] >= n or margin > 1e4:
            return pool if pool.shape[0] >= n else np.arange(logits.shape[0])
        margin *= 2


def top_candidates(logits: np.ndarray, n: int) -> np.ndarray:
    """Ids of the n largest logits, largest first (ties broken by lower id)."""
    n_vocab = logits.shape[0]
    if n < n_vocab:
        # narrow to a superset of the top n (and of every logit tied with the n-th) before
        # partitioning: a compare pass costs about a thirtieth of an argpartition of 150k logits
        pool = _near_top(logits, n) if n <= n_vocab // BLOCK else _within_margin(logits, n)
        # everything tied with the n-th largest value, so the lowest ids win ties below
        kth = logits[pool[np.argpartition(logits[pool], pool.shape[0] - n)[pool.shape[0] - n]]]
        ids = pool[logits[pool] >= kth]
    else:
        ids = np.arange(n_vocab)
    order = np.lexsort((ids, -logits[ids]))
    return ids[order[:n]]


def distribution(logits: np.ndarray, settings: SamplingSettings) -> Dist:
    """Apply top_k, top_p, min_p and temperature to one row of logits (temperature > 0).

    Args:
        logits: one row of raw logits, shape (n_vocab,); not modified.
        settings: sampling settings with temperature > 0.
    Returns:
        The sparse distribution over the surviving tokens.
    """
    n_vocab = logits.shape[0]
    n_keep = settings.top_k if 0 < settings.top_k < n_vocab else n_vocab
    if n_keep == n_vocab and settings.top_p < 1.0:
        # top_p alone: grow a partitioned candidate set until it holds top_p of the mass,
        # instead of sorting the whole vocabulary.
        log_z = _logsumexp(logits)
        n_try = 64
        while n_try < n_vocab:
            ids = top_candidates(logits, n_try)
            if np.exp(logits[ids].astype(np.float64) - log_z).sum() >= settings.top_p:
                break
            n_try *= 4
        else:
            ids = top_candidates(logits, n_vocab)
    elif n_keep == n_vocab and settings.min_p > 0.0:
        # min_p alone: its threshold is known up front, so only the survivors are sorted.
        survivors = np.flatnonzero(logits >= logits.max() + math.log(settings.min_p))
        ids = survivors[np.lexsort((survivors, -logits[survivors]))]
    else:
        ids = top_candidates(logits, n_keep)
    x = logits[ids].astype(np.float64)
    if settings.top_p < 1.0:
        probs = np.exp(x - _logsumexp(logits)) if n_keep == n_vocab else _softmax(x)
        n_top_p = int(np.searchsorted(np.cumsum(probs), settings.top_p)) + 1
        ids, x = ids[:n_top_p], x[:n_top_p]
    if settings.min_p > 0.0:
        n_min_p = int(np.count_nonzero(x >= x[0] + math.log(settings.min_p)))
        ids, x = ids[:n_min_p], x[:n_min_p]
    return Dist(ids.astype(np.int64), _softmax(x / settings.temperature))


def _logsumexp(logits: np.ndarray) -> float:
    m = float(logits.max())
    return m + math.log(float(np.exp(logits - m, dtype=np.float64).sum()))


def sample(dist: Dist, rng: np.random.Generator) -> int:
    """Draw one token id from dist."""
    cdf = np.cumsum(dist.probs)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(dist.ids[min(i, len(dist.ids) - 1)])


def inner(a: np.ndarray, b: np.ndarray) -> float:
    """sum(a * b), in numpy's own loop: np.dot of two long vectors goes to OpenBLAS, which splits
    it over a thread per core, and those threads spin on after it beside llama.cpp's own (the
    sampled grammar test took 18-21 s with np.dot here, 14.5 s with OpenBLAS held to one thread,
    12.5-13.9 s with this)."""
    return float(np.einsum("i,i->", a, b))


def greedy(logits: np.ndarray) -> int:
    """The argmax token (lowest id on ties)."""
    return int(np.argmax(logits))


# logits this far below the largest may be left out of top_probability's sum: each weighs at most
# e^-20 of the top's, so a 152k-token row's left-out mass is under 3.2e-4 of it
NEAR_TOP = 20.0
# ... where at most this fraction of the row is that near: picking entries out of a row costs per
# entry kept, and on a trained model's prose rows (a median 36% of Qwen 0.5B's 152k logits within
# 20 of the top) it took 0.63 ms, against 0.11 ms for an exp of every entry
# (benchmarks/test_engine_overhead.py::test_the_draft_s_confidence_on_a_trained_model_s_rows)
FEW_NEAR = 1 / 16


def top_probability(logits: np.ndarray, top: int) -> float:
    """softmax(logits)[top] for top the argmax (a draft's confidence, every drafted token): from
    the logits within NEAR_TOP of it where they are few, erring high by less than
    (n_vocab * e^-NEAR_TOP) relative; else from an exp of every entry, in place."""
    m = logits[top]
    near = logits > m - NEAR_TOP
    if np.count_nonzero(near) <= FEW_NEAR * logits.shape[0]:
        return float(1.0 / np.exp(logits[near] - m).sum())
    shifted = logits - m
    np.exp(shifted, out=shifted)
    return float(1.0 / shifted.sum())
