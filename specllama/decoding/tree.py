"""A tree of candidate tokens, built once by the proposer and read by the runtime (how it goes
into one batch), the verifier (which child follows which), stats and the controller (which
nodes were the draft's own choices).

Node i has parents[i] as its parent (-1: the round's newest token, the root). A node's children
are tried in the order they were added; the first child of each node is the draft's own chain.
A chain is the tree whose every node has one child.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property


class Tree:
    """The shape of a tree proposal (its tokens live in the Proposal)."""

    def __init__(self, parents: Sequence[int]):
        if any(not -1 <= p < i for i, p in enumerate(parents)):
            raise ValueError("a tree's nodes come after their parents (parent -1: the root)")
        self.parents = tuple(parents)

    def __len__(self) -> int:
        return len(self.parents)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tree) and other.parents == self.parents

    def __repr__(self) -> str:
        return f"Tree({list(self.parents)})"

    @classmethod
    def chain(cls, n: int) -> "Tree":
        return cls(range(-1, n - 1))

    @cached_property
    def children(self) -> dict[int, list[int]]:
        """Each node's children in order (-1: the root's)."""
        out: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents):
            out.setdefault(parent, []).append(i)
        return out

    @cached_property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.parents) - 1))

    @cached_property
    def first_children(self) -> frozenset[int]:
        """The nodes that are their parent's first child: the draft's own choices."""
        return frozenset(kids[0] for kids in self.children.values())

    @cached_property
    def main_branch(self) -> list[int]:
        """The nodes of the branch of first children, from the root down."""
        branch, node = [], -1
        while self.children.get(node):
            node = self.children[node][0]
            branch.append(node)
        return branch

    @cached_property
    def depth(self) -> list[int]:
        """Each node's distance from the root (the root's children: 1)."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out

    @cached_property
    def n_leaves(self) -> int:
        return sum(1 for i in range(len(self.parents)) if i not in self.children)

    def child(self, node: int, tokens: Sequence[int], token: int) -> int | None:
        """node's child holding token, or None."""
        return next((c for c in self.children.get(node, ()) if tokens[c] == token), None)

    def path_of(self, tokens: Sequence[int], accepted: Sequence[int]) -> list[int]:
        """The nodes along which accepted tokens run from the root."""
        path, node = [], -1
        for token in accepted:
            found = self.child(node, tokens, token)
            if found is None:
                raise ValueError(f"token {token} is not a child of node {node}")
            path.append(found)
            node = found
        return path

    def is_path(self, path: Sequence[int]) -> bool:
        """Whether path runs from the root down, parent to child."""
        return all(0 <= b < len(self.parents) and self.parents[b] == a for a, b in zip([-1, *path], path))
