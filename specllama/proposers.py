"""Proposers: where the candidate tokens x_1..x_k of a round come from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Optional, Protocol

import numpy as np

from .runtime import Runtime
from .sampling import Dist, SamplingSettings, distribution, greedy, sample


class Proposal(NamedTuple):
    """Drafted tokens and, for sampling, the distributions q_i they were drawn from."""

    tokens: list[int]
    q: Optional[list[Optional[Dist]]] = None  # None: deterministic proposals (greedy or lookup)


EMPTY = Proposal([])


class Proposer(Protocol):
    def prefill(self, tokens: Sequence[int]) -> None:
        """See the prompt before the first round (its time counts as prefill)."""

    def propose(self, tokens: Sequence[int], n_draft: int, sampling: SamplingSettings,
                rng: np.random.Generator) -> Proposal:
        """Propose up to n_draft tokens to follow tokens (prompt + everything accepted)."""


class DraftModelProposer:
    """A small model of the same family drafts autoregressively in its own KV cache.

    The cache is not rolled back here: each propose() syncs it to the accepted tokens, which
    keeps the accepted prefix, drops rejected drafts and feeds what the draft has not seen
    (the correction token, and the last draft token too after a fully accepted round).
    """

    def __init__(self, draft: Runtime):
        self.draft = draft

    def prefill(self, tokens: Sequence[int]) -> None:
        if len(tokens) <= self.draft.n_ctx:
            self.draft.sync(tokens)

    def propose(self, tokens: Sequence[int], n_draft: int, sampling: SamplingSettings,
                rng: np.random.Generator) -> Proposal:
        n_draft = min(n_draft, self.draft.n_ctx - len(tokens) + 1)
        if n_draft <= 0:
            return EMPTY
        self.draft.sync(tokens)
        drafted: list[int] = []
        q: list[Optional[Dist]] = []
        for i in range(n_draft):
            row = self.draft.logits(0)
            if sampling.greedy:
                x = greedy(row)
            else:
                q_i = distribution(row, sampling)
                x = sample(q_i, rng)
                q.append(q_i)
            drafted.append(x)
            if i + 1 < n_draft:
                self.draft.decode([x])
        return Proposal(drafted, q or None)
