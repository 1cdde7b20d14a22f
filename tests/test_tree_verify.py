"""Tree verification as pure functions: the greedy walk and recursive rejection sampling."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest

from specllama.decoding.sampling import Dist
from specllama.decoding.tree import Tree
from specllama.decoding.verify import residual, tree_greedy_verify, tree_speculative_verify
from test_verify import chi2_critical, chi2_stat

V = 5
P_ROOT = np.array([0.35, 0.25, 0.2, 0.15, 0.05])
# the target's next-token distribution after each first token
P_AFTER = np.array([[0.5, 0.1, 0.1, 0.2, 0.1], [0.05, 0.05, 0.6, 0.2, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2],
                    [0.0, 0.7, 0.0, 0.3, 0.0], [0.1, 0.0, 0.0, 0.0, 0.9]])
Q_ROOT = np.array([0.1, 0.5, 0.05, 0.3, 0.05])
Q_AFTER = np.array([0.3, 0.3, 0.1, 0.2, 0.1])


def without(q: np.ndarray, tokens: list[int]) -> np.ndarray:
    out = q.copy()
    out[tokens] = 0.0
    return out / out.sum()


def draw_tree(rng: np.random.Generator, lookup: bool) -> tuple[list[int], list[int], list]:
    """Root children: (lookup's token 3, deterministic,) then two draft tokens drawn without
    replacement; the first draft child has two children of its own, drawn the same way."""
    tokens: list[int] = []
    parents: list[int] = []
    q: list[Optional[Dist]] = []
    taken: list[int] = []
    if lookup:
        tokens.append(3)
        parents.append(-1)
        q.append(None)
        taken.append(3)
    for _ in range(2):
        q_j = without(Q_ROOT, taken)
        x = int(rng.choice(V, p=q_j))
        tokens.append(x)
        parents.append(-1)
        q.append(Dist.from_dense(q_j))
        taken.append(x)
    first_draft = len(tokens) - 2
    taken = []
    for _ in range(2):
        q_j = without(Q_AFTER, taken)
        x = int(rng.choice(V, p=q_j))
        tokens.append(x)
        parents.append(first_draft)
        q.append(Dist.from_dense(q_j))
        taken.append(x)
    return tokens, parents, q




@pytest.mark.parametrize("lookup", [False, True])
def test_tree_output_is_distributed_as_the_target(lookup):
    """The first two output tokens of a tree round are distributed as p_root x p_after."""
    rng = np.random.default_rng(11 + lookup)
    counts = np.zeros((V, V), dtype=np.int64)
    n_deep = 0
    for _ in range(40_000):
        tokens, parents, q = draw_tree(rng, lookup)

        def p(node: int) -> Dist:
            if node == -1:
                return Dist.from_dense(P_ROOT)
            if parents[node] == -1:
                return Dist.from_dense(P_AFTER[tokens[node]])
            return Dist.from_dense(np.full(V, 1.0 / V))  # below depth 2: not counted

        path, t = tree_speculative_verify(tokens, Tree(parents), q, p, rng)
        out = [tokens[i] for i in path] + [t]
        n_deep += len(path) >= 2
        if len(out) < 2:  # the next round draws the second token from the target
            out.append(int(rng.choice(V, p=P_AFTER[out[0]])))
        counts[out[0], out[1]] += 1
    stat, df = chi2_stat(counts.ravel(), np.outer(P_ROOT, np.ones(V)).ravel() * P_AFTER.ravel())
    assert stat < chi2_critical(df), stat
    assert n_deep > 1000  # the depth-2 children were reached and judged


def test_the_check_rejects_siblings_judged_without_the_residual(monkeypatch):
    """The check can fail: judging later siblings against the target's row itself, not the
    residual left by the earlier ones, keeps their tokens too often."""
    monkeypatch.setattr("specllama.decoding.verify.residual", lambda p, q: p)
    rng = np.random.default_rng(5)
    counts = np.zeros(V, dtype=np.int64)
    for _ in range(40_000):
        tokens, parents, q = draw_tree(rng, lookup=False)
        path, t = tree_speculative_verify(tokens[:2], Tree(parents[:2]), q[:2], lambda node: Dist.from_dense(P_ROOT),
                                          rng)
        counts[tokens[path[0]] if path else t] += 1
    stat, df = chi2_stat(counts, P_ROOT)
    assert stat > chi2_critical(df)


def test_more_siblings_accept_more():
    """Two draft candidates keep the first token more often than one (sum min(p, q) for one)."""
    rng = np.random.default_rng(7)
    kept = {1: 0, 2: 0}
    for width in (1, 2):
        for _ in range(20_000):
            tokens, q, taken = [], [], []
            for _ in range(width):
                q_j = without(Q_ROOT, taken)
                x = int(rng.choice(V, p=q_j))
                tokens.append(x), q.append(Dist.from_dense(q_j)), taken.append(x)
            path, _ = tree_speculative_verify(tokens, Tree([-1] * width), q, lambda node: Dist.from_dense(P_ROOT), rng)
            kept[width] += bool(path)
    alpha = np.minimum(P_ROOT, Q_ROOT).sum()
    assert abs(kept[1] / 20_000 - alpha) < 0.015
    assert kept[2] > kept[1] + 2_000


def test_greedy_walk_follows_the_argmax():
    # root -> 5 (node 0) -> 6 (node 1); root -> 7 (node 2) -> 8 (node 3); node 0 -> 9 (node 4)
    tokens, parents = [5, 6, 7, 8, 9], [-1, 0, -1, 2, 0]
    argmax = {-1: 7, 2: 8, 3: 1}
    assert tree_greedy_verify(tokens, Tree(parents), argmax.__getitem__) == ([2, 3], 1)
    assert tree_greedy_verify(tokens, Tree(parents), {-1: 5, 0: 9, 4: 3}.__getitem__) == ([0, 4], 3)
    assert tree_greedy_verify(tokens, Tree(parents), {-1: 4}.__getitem__) == ([], 4)
    assert tree_greedy_verify([], Tree([]), {-1: 4}.__getitem__) == ([], 4)


def test_greedy_walk_reads_only_the_path():
    read = []

    def argmax(node):
        read.append(node)
        return {-1: 7, 2: 0}[node]

    tree_greedy_verify([5, 6, 7, 8], Tree([-1, 0, -1, 2]), argmax)
    assert read == [-1, 2]


def test_a_chain_is_a_tree():
    """A chain (each node the child of the one before) verifies as the chain verifier does."""
    p = Dist.from_dense(np.array([0.0, 1.0]))
    path, t = tree_speculative_verify([1, 1], Tree([-1, 0]), [p, p], lambda node: p, np.random.default_rng(0))
    assert (path, t) == ([0, 1], 1)
    assert residual(p, p) is p


def test_parents_must_come_first():
    with pytest.raises(ValueError):
        Tree([-1, 2, 0])
    with pytest.raises(ValueError):
        Tree([-2])
