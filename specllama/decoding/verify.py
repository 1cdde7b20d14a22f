"""Pure verification rules, in the notation of Leviathan et al. (2023) and Chen et al. (2023).

x_1..x_k are the drafted tokens, q_i the draft's distribution x_i was drawn from, p_i the
target's distribution at the same position (p has k+1 entries: the last one yields the bonus
token). Both functions return (n_accepted, next_token): the first n_accepted drafts are kept,
then next_token (the correction at the first rejection, or the bonus token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Optional

import numpy as np

from .sampling import Dist, sample
from .tree import Tree


def greedy_verify(draft_tokens: Sequence[int], target_argmax: Iterable[int]) -> tuple[int, int]:
    """Accept the longest prefix where argmax(p_i) == x_i, then argmax(p) at the first mismatch.

    Args:
        draft_tokens: x_1..x_k.
        target_argmax: argmax of p_1..p_{k+1}; consumed lazily, so rows past the first
            mismatch are never computed.
    """
    for i, best in enumerate(target_argmax):
        if i == len(draft_tokens) or best != draft_tokens[i]:
            return i, best
    raise ValueError("target_argmax must have one more entry than draft_tokens")


def residual(p: Dist, q: Dist) -> Dist:
    """normalize(max(0, p - q)): the distribution to resample from after a rejection.

    Dense over the ids up to the largest one (ids are unique within a Dist): with top_k=0 and
    top_p=1 both cover the whole vocabulary, where merging the sorted id lists took 110 ms a
    rejection (more than a target decode) and this takes 1.5 ms; the result is the same, ids
    ascending."""
    diff = np.zeros(int(max(p.ids.max(), q.ids.max())) + 1)
    diff[p.ids] += p.probs
    diff[q.ids] -= q.probs
    ids = np.flatnonzero(diff > 0)
    total = diff[ids].sum()
    if total <= 0.0:
        # p == q up to rounding: a rejection had probability ~0, and p is the right answer.
        return p
    return Dist(ids, diff[ids] / total)


def speculative_verify(
    draft_tokens: Sequence[int],
    q: Sequence[Optional[Dist]],
    p: Iterable[Dist],
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Speculative sampling: keep x_i with probability min(1, p_i(x_i) / q_i(x_i)).

    On the first rejection the next token is drawn from normalize(max(0, p_i - q_i)); after k
    acceptances the bonus token is drawn from p_{k+1}. The output is distributed exactly as
    sampling from p alone. A q_i of None means the proposal was deterministic (prompt lookup):
    q_i is then one-hot on x_i, which is the "sample from p and compare" rule.

    Args:
        draft_tokens: x_1..x_k.
        q: q_1..q_k, or None entries for deterministic proposals.
        p: p_1..p_{k+1}; consumed lazily.
        rng: the generator every random draw comes from.
    """
    for i, p_i in enumerate(p):
        if i == len(draft_tokens):
            return i, sample(p_i, rng)
        x_i = draft_tokens[i]
        q_i = q[i]
        if q_i is None:
            q_i = Dist.one_hot(x_i)
        p_x, q_x = p_i.prob(x_i), q_i.prob(x_i)
        if rng.random() * q_x < p_x:  # r < p/q, without dividing by a q that may be 0
            continue
        return i, sample(residual(p_i, q_i), rng)
    raise ValueError("p must have one more entry than draft_tokens")


# --- trees ------------------------------------------------------------------------------------
# A tree proposal lists nodes x_1..x_n in a Tree (tree.py: each node's parent, -1 being the
# round's newest token, the root). The target's pass gives one row per node (p_root, then
# p_1..p_n): the row of a node is the target's distribution for its children.


def tree_greedy_verify(tokens: Sequence[int], tree: Tree,
                       target_argmax: Callable[[int], int]) -> tuple[list[int], int]:
    """Walk the tree from the root, following the child whose token is the argmax of its
    parent's row: (the accepted nodes, root to deepest, then the target's token after them).

    Args:
        tokens, tree: the tree's tokens and shape.
        target_argmax: argmax of a node's row (-1: the root's); asked only for nodes on the path.
    """
    children = tree.children
    path: list[int] = []
    node = -1
    while True:
        best = target_argmax(node)
        follow = next((c for c in children.get(node, ()) if tokens[c] == best), None)
        if follow is None:
            return path, best
        path.append(follow)
        node = follow


def tree_speculative_verify(
    tokens: Sequence[int],
    tree: Tree,
    q: Sequence[Optional[Dist]],
    p: Callable[[int], Dist],
    rng: np.random.Generator,
) -> tuple[list[int], int]:
    """Recursive rejection sampling over a tree (SpecInfer's multi-candidate scheme, for
    candidates drawn without replacement as in Jeon et al. 2024): the output is distributed
    exactly as sampling from the target alone.

    At a node, its children are tried in order. Child j, drawn from q_j (the draft's
    distribution with the earlier siblings' tokens removed), is kept with probability
    min(1, p(x_j) / q_j(x_j)), where p starts as the target's row and after each rejection
    becomes the residual normalize(max(0, p - q_j)). A kept child becomes the node; when every
    child is rejected the next token is drawn from the last residual. A q_j of None means a
    deterministic candidate (prompt lookup): one-hot on its token.

    Args:
        tokens, tree: the tree's tokens and shape.
        q: per node, the distribution its token was drawn from, given its earlier siblings.
        p: the target's distribution at a node's row (-1: the root's).
        rng: the generator every random draw comes from.
    """
    children = tree.children
    path: list[int] = []
    node = -1
    while True:
        p_node = p(node)
        for child in children.get(node, ()):
            x = tokens[child]
            q_x_dist = q[child]
            if q_x_dist is None:
                q_x_dist = Dist.one_hot(x)
            p_x, q_x = p_node.prob(x), q_x_dist.prob(x)
            if rng.random() * q_x < p_x:
                path.append(child)
                node = child
                break
            p_node = residual(p_node, q_x_dist)
        else:
            return path, sample(p_node, rng)
