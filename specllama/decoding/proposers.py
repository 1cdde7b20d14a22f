"""Proposers: where the candidate tokens x_1..x_k of a round come from.

A generation starts its Proposer once (start: the prompt, the sampling settings and random
generator, the constraint and the policy that decides how far to draft); each round then asks
for a proposal from one source, and the draft's report of what it did lands in `report`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .constraints import Constraint
from ..caching.prompt_cache import PromptCache
from .proposals import EMPTY, NO_REPORT, DraftMore, DraftReport, Proposal, TreeShape
from ..runtime.protocols import Drafter
from ..runtime.session import common_prefix
from .sampling import (Dist, SamplingSettings, distribution, greedy, inner, sample, top_candidates,
                       top_probability)
from .tree import Tree


@dataclass
class Generation:
    """What every round of one generation shares: its sampling, random draws, constraint, and
    the policy's draft_more (how far to draft, asked after each drafted token)."""

    sampling: SamplingSettings
    rng: np.random.Generator
    draft_more: DraftMore
    constraint: Optional[Constraint] = None


class _TreeBuilder:
    """A tree proposal as it is built: the draft's chain, siblings beside it, lookup's branch."""

    def __init__(self, shape: Optional[TreeShape]):
        self.shape = shape  # None: a chain, as long as the draft goes
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.q: list[Optional[Dist]] = []
        self.confidence: list[float] = []
        self.n_leaves = 1  # the chain's end

    def full(self, new_branch: bool) -> bool:
        if self.shape is None:
            return False
        return len(self.tokens) >= self.shape.n_nodes or (new_branch and self.n_leaves >= self.shape.n_branches)

    def add(self, token: int, parent: int, q: Optional[Dist], confidence: float) -> int:
        if parent in self.parents:  # beside an existing child: a new branch
            self.n_leaves += 1
        self.tokens.append(token)
        self.parents.append(parent)
        self.q.append(q)
        self.confidence.append(confidence)
        return len(self.tokens) - 1

    def merge(self, offer: Sequence[int]) -> None:
        """Add prompt lookup's continuation: shared tokens are free, the rest a branch beside
        the draft's where each token pays for its row."""
        assert self.shape is not None
        node = -1
        for depth, token in enumerate(offer, 1):
            found = next((i for i, (t, p) in enumerate(zip(self.tokens, self.parents)) if p == node and t == token),
                         None)
            if found is not None:
                node = found
                continue
            if self.full(node in self.parents) or not self.shape.lookup_node(depth):
                return
            node = self.add(token, node, None, float("nan"))

    def proposal(self, sampled: bool) -> Proposal:
        tree = Tree(self.parents)
        return Proposal(self.tokens, (self.q or None) if sampled else None, None if tree.is_chain else tree)


class DraftModelProposer:
    """A small model of the same family drafts autoregressively in its own KV cache.

    The cache is not rolled back here: each propose() syncs it to the accepted tokens, which
    keeps the accepted prefix, drops rejected drafts and feeds what the draft has not seen
    (the correction token, tokens other sources proposed, and the last draft token after a
    fully accepted round). A draft that follows its target (MTP layers) is fed by the target's
    own decodes, the prompt's included: nothing to prefill.
    """

    def __init__(self, draft: Drafter, cache: Optional[PromptCache] = None, canonical: bool = False,
                 scope: str = ""):
        self.draft, self.cache, self.scope = draft, cache, scope
        # a seeded sampled generation needs q independent of what ran before: the draft then
        # reuses only what a fresh prefill computes bit for bit, like the target
        self.canonical = canonical
        self._prompt: Optional[list[int]] = None  # to prefill before the first draft
        self.n_prompt_cached = 0
        self.t_prefill = 0.0

    def prefill(self, tokens: Sequence[int]) -> None:
        """Note the prompt; it is prefilled (reusing the draft's prompt cache) only when the
        first round drafts, so a generation that never drafts never pays for it."""
        self._prompt = list(tokens)

    def lag(self, tokens: Sequence[int]) -> tuple[int, bool]:
        """(tokens the draft would decode before drafting after tokens, whether that includes
        its prefill): 1 in the steady state, more after rounds from other sources."""
        if self.draft.follows_target:
            return 0, False
        have = self.draft.cached
        if self._prompt is not None:
            have = have[:common_prefix(have, self._prompt)]
        return max(1, len(tokens) - common_prefix(have, tokens)), self._prompt is not None

    def _prefill_now(self) -> None:
        tokens, self._prompt = self._prompt, None
        assert tokens is not None
        t0 = time.perf_counter()
        if self.draft.follows_target:
            pass
        elif len(tokens) > self.draft.n_ctx:
            self.draft.truncate(0)
        elif self.cache is None:
            self.draft.truncate(0)
            self.draft.sync(tokens)
        else:
            self.n_prompt_cached = self.cache.prefill(tokens, self.canonical, self.scope).n_reused
        self.t_prefill = time.perf_counter() - t0

    def propose(self, tokens: Sequence[int], n_draft: int, gen: Generation, shape: Optional[TreeShape] = None,
                offer: Sequence[int] = ()) -> tuple[Proposal, DraftReport]:
        """Draft up to n_draft tokens after tokens; under a constraint, from rows shaped as the
        target's will be (its state is explored and rolled back). With a shape (and no
        constraint), the draft's next-best tokens at a position may be proposed beside its
        own, and prompt lookup's offer merged in, as a tree: siblings come from the same row,
        so they cost verify rows but no draft step."""
        n_draft = min(n_draft, self.draft.n_ctx - len(tokens) + 1)
        if n_draft <= 0:
            return EMPTY, NO_REPORT
        catch_up = self._sync(tokens)
        # the steps where the draft's one-token decodes cost least (on the decode thread where it can)
        proposal, confidence, dropped = self.draft.drafting(self._steps, n_draft, gen, shape, offer)
        return proposal, DraftReport(confidence, dropped, catch_up)

    def _steps(self, n_draft: int, gen: Generation, shape: Optional[TreeShape], offer: Sequence[int]
               ) -> tuple[Proposal, list[float], Optional[tuple[int, float]]]:
        """propose's draft steps from where _sync left the draft: (the proposal, each node's
        confidence, the token a policy dropped and its confidence)."""
        constraint, sampling = gen.constraint, gen.sampling
        branching = shape is not None and shape.width > 1 and constraint is None
        tree = _TreeBuilder(shape if branching else None)
        n_history = len(constraint.history) if constraint is not None else 0
        confidence: list[float] = []
        parent, dropped = -1, None
        try:
            for i in range(n_draft):
                row = self.draft.logits(0)
                if constraint is not None:
                    row = constraint.apply(row)
                q_i: Optional[Dist] = None
                if sampling.greedy:
                    x = greedy(row)
                    confidence.append(top_probability(row, x))
                else:
                    q_i = distribution(row, sampling)
                    x = sample(q_i, gen.rng)
                    confidence.append(q_i.prob(x))
                decision = gen.draft_more(_deciding(confidence, q_i))
                if decision == "drop":
                    dropped = (x, confidence.pop())
                    break
                node = tree.add(x, parent, q_i, confidence[-1])
                if branching:
                    assert shape is not None
                    wanted = lambda c: not tree.full(True) and shape.sibling(c)  # noqa: E731
                    top = confidence[-1] if sampling.greedy else 0.0
                    for alt, q_alt, c_alt in _next_best(row, x, q_i, top, shape.width - 1, gen.rng, wanted):
                        tree.add(alt, parent, q_alt, c_alt)
                parent = node
                if decision == "stop" or i + 1 == n_draft or tree.full(False):
                    break
                if constraint is not None:  # the next row is shaped after x
                    constraint.accept(x)
                self.draft.decode([x])
            if branching and offer:
                tree.merge(offer)
            return tree.proposal(not sampling.greedy), tree.confidence, dropped
        finally:
            if constraint is not None:  # the constraint follows accepted tokens only
                constraint.rollback(len(constraint.history) - n_history)

    def _sync(self, tokens: Sequence[int]) -> tuple[int, float]:
        """Bring the draft to tokens (prefilling it first if it has not been): what that decoded."""
        if self.draft.follows_target:  # fed by the target's decodes: nothing of its own to catch up
            if self._prompt is not None:
                self._prefill_now()
            self.draft.sync(tokens)
            return 0, 0.0
        t0 = time.perf_counter()
        n_have = common_prefix(self.draft.cached, tokens) if self._prompt is None else 0
        if self._prompt is not None:
            self._prefill_now()
            n_have = self.n_prompt_cached
        self.draft.sync(tokens)
        return max(1, len(tokens) - n_have), time.perf_counter() - t0


def _deciding(confidence: list[float], q: Optional[Dist]) -> list[float]:
    """The confidences a policy decides on after the draft picked its latest token. Sampled:
    the latest is replaced by the probability a draw from q is expected to have. Whether a
    sampled candidate is proposed must not depend on its own value: the verifier judges it as
    drawn from q, and a candidate kept only where its value was likely is not (the output
    would lean to the draft's favourites); it may depend on every earlier candidate."""
    return confidence if q is None else [*confidence[:-1], inner(q.probs, q.probs)]


def _next_best(row: np.ndarray, x: int, q: Optional[Dist], top: float, n: int, rng: np.random.Generator,
               wanted: Callable[[float], bool] = lambda confidence: True
               ) -> Iterator[tuple[int, Optional[Dist], float]]:
    """Up to n candidates beside x from the same draft row, best first, as (token, the
    distribution it was drawn from given the ones before, the draft's probability of it),
    while wanted(confidence) says yes, asked before each is drawn. Greedy: the next-largest
    logits (top: the probability of x, the largest), asked with their own probability.
    Sampled: draws without replacement from q, each from q without the tokens before it,
    asked with the probability such a draw is expected to have (see _deciding)."""
    if n <= 0:
        return
    if q is None:
        m = row[x]
        for token in top_candidates(row, n + 1).tolist():
            if token == x:
                continue
            c = float(np.exp(row[token] - m) * top)
            if not wanted(c):
                return
            yield int(token), None, c
        return
    taken = [x]
    for _ in range(n):
        keep = ~np.isin(q.ids, taken)
        if not keep.any() or q.probs[keep].sum() <= 0:
            return
        q_j = Dist(q.ids[keep], q.probs[keep] / q.probs[keep].sum())
        if not wanted(inner(q_j.probs, q.probs[keep])):
            return
        token = sample(q_j, rng)
        taken.append(token)
        yield token, q_j, q.prob(token)


class PromptLookupProposer:
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens.

    Free (no model, no memory) and strong when the output copies the input: edits, extraction,
    code that repeats names. Longer matches are tried first. Proposals are deterministic, so
    sampling verifies them with the sample-and-compare rule (q one-hot).
    """

    def __init__(self, n_min: int = 2, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self._tokens: list[int] = []

    def prefill(self, tokens: Sequence[int]) -> None:
        self._index.clear()
        self._tokens = []
        self._extend(tokens)

    def _extend(self, tokens: Sequence[int]) -> None:
        n_old = len(self._tokens)
        if list(tokens[:n_old]) != self._tokens:  # a different sequence: index from scratch
            self._index.clear()
            n_old = 0
        self._tokens = list(tokens)
        # index every n-gram that is followed by at least one token
        for end in range(max(n_old, self.n_min), len(tokens)):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._index[tuple(tokens[end - n:end])] = end

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(n-gram length, start of the continuation) of the longest match, or (0, 0)."""
        self._extend(tokens)
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            end = self._index.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return n, end
        return 0, 0

    def offer(self, tokens: Sequence[int], n_max: int) -> tuple[int, list[int]]:
        """(n-gram length of the longest match, up to n_max tokens that followed it)."""
        n, start = self.match(tokens)
        return (n, list(tokens[start:start + n_max])) if n and n_max > 0 else (0, [])


class Proposer:
    """Where a round's candidates come from: the draft model, prompt lookup, or both, the
    policy choosing between them each round."""

    def __init__(self, draft: Optional[DraftModelProposer], lookup: Optional[PromptLookupProposer]):
        self.draft, self.lookup = draft, lookup
        self.gen: Optional[Generation] = None
        self.report = NO_REPORT  # what the draft did for the last proposal

    def start(self, prompt: Sequence[int], gen: Generation) -> None:
        """A generation after prompt begins."""
        self.gen, self.report = gen, NO_REPORT
        for source in (self.draft, self.lookup):
            if source is not None:
                source.prefill(prompt)

    def draft_prefill(self) -> tuple[int, float]:
        """(prompt tokens the draft model reused, seconds its prefill took); 0s if it never ran."""
        return (self.draft.n_prompt_cached, self.draft.t_prefill) if self.draft is not None else (0, 0.0)

    def draft_lag(self, tokens: Sequence[int]) -> tuple[int, bool]:
        """DraftModelProposer.lag, or (0, False) without a draft model."""
        return self.draft.lag(tokens) if self.draft is not None else (0, False)

    def lookup_offer(self, tokens: Sequence[int], n_max: int) -> tuple[int, list[int]]:
        """(n-gram length of prompt lookup's match, up to n_max tokens it would propose)."""
        return self.lookup.offer(tokens, n_max) if self.lookup is not None else (0, [])

    def propose(self, tokens: Sequence[int], source: str, n_draft: int, offer: list[int],
                shape: Optional[TreeShape] = None) -> Proposal:
        """The round's proposal from source; with a shape, a tree that may take prompt
        lookup's offer in as a branch beside the draft's."""
        assert self.gen is not None, "start() the generation first"
        self.report = NO_REPORT
        if source == "draft" and self.draft is not None:
            proposal, self.report = self.draft.propose(tokens, n_draft, self.gen, shape, offer)
            return proposal
        if source == "lookup":
            return Proposal(offer[:n_draft]) if offer else EMPTY
        return EMPTY
