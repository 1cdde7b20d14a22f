"""The values a round passes around: what was proposed, what the draft reported doing, how far
a round may branch, and what the round produced (which the policy learns from)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from .sampling import Dist
from .tree import Tree


class Proposal(NamedTuple):
    """Drafted tokens x_1..x_k and, for sampling, the distributions q_i they were drawn from
    (None: deterministic proposals, greedy or prompt lookup). tree None: a chain, x_1..x_k in
    order; otherwise each token's parent in the tree (a child's q is the distribution it was
    drawn from given its earlier siblings)."""

    tokens: list[int]
    q: Optional[list[Optional[Dist]]] = None
    tree: Optional[Tree] = None

    def first(self, n: int) -> "Proposal":
        """The first n tokens (a chain's prefix)."""
        if n >= len(self.tokens):
            return self
        return Proposal(self.tokens[:n], self.q[:n] if self.q is not None else None)


EMPTY = Proposal([])


@dataclass(frozen=True)
class DraftReport:
    """What the draft did for a proposal, for the policy: its probability of each proposed
    token (NaN: a token it did not draft), a token it drafted but did not propose (with that
    probability), and what it decoded before drafting (its prefill or catching up with tokens
    other sources proposed): tokens and seconds."""

    confidence: Sequence[float] = ()
    dropped: Optional[tuple[int, float]] = None
    catch_up: tuple[int, float] = (0, 0.0)


NO_REPORT = DraftReport()

# After the draft picks x_i: "more" (decode it, draft another), "stop" (propose x_1..x_i) or
# "drop" (propose x_1..x_{i-1}); called with the draft's confidence in x_1..x_i.
DraftMore = Callable[[list[float]], str]


class TreeShape(NamedTuple):
    """How far a round may branch: at most width candidates per position, n_nodes tokens and
    n_branches leaves in all; sibling(confidence) says whether a next-best draft token is
    worth its verify row, lookup_node(depth) the same for prompt lookup's tokens."""

    width: int
    n_nodes: int
    n_branches: int
    sibling: Callable[[float], bool]
    lookup_node: Callable[[int], bool]


@dataclass(frozen=True)
class RoundOutcome:
    """What one round did, as the policy learns from it.

    source: "none", "draft", "lookup" or "grammar" (the round did not get past the tokens a
    grammar forced); proposal and report: what the source proposed (before forced tokens);
    new: the tokens the round produced (accepted drafts, then the target's own); seconds: its
    verify pass and rollback; offer: what prompt lookup offered at its start; n_verify: the
    rows verified (forced and pending tokens included; a lane's: the whole shared pass's);
    n_other, n_lanes: a lane's pass, the rows in it of n_lanes - 1 other lanes; n_cap: the most
    rows a pass with the lane's rows may hold and it may plan for, n_other and its share
    (shared.fair_room; None: not a lane)."""

    source: str
    proposal: Proposal
    new: list[int]
    seconds: float
    greedy: bool
    report: DraftReport = NO_REPORT
    offer: list[int] = field(default_factory=list)
    n_verify: int = 0
    n_other: int = 0
    n_lanes: int = 1
    n_cap: Optional[int] = None

    @property
    def rows(self) -> int:
        return self.n_verify or len(self.proposal.tokens) + 1
