"""Proposers: where the candidate tokens x_1..x_k of a round come from."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Optional

import numpy as np

from .constraints import Constraint
from .prompt_cache import PromptCache
from .runtime import Runtime
from .sampling import Dist, SamplingSettings, distribution, greedy, sample


class Proposal(NamedTuple):
    """Drafted tokens and, for sampling, the distributions q_i they were drawn from."""

    tokens: list[int]
    q: Optional[list[Optional[Dist]]] = None  # None: deterministic proposals (greedy or lookup)
    confidence: Sequence[float] = ()  # the draft model's probability of each token it drafted
    dropped: Optional[tuple[int, float]] = None  # a token drafted but not proposed, with its confidence


EMPTY = Proposal([])

# After the draft picks x_i: "more" (decode it, draft another), "stop" (propose x_1..x_i) or
# "drop" (propose x_1..x_{i-1}); called with the draft's confidence in x_1..x_i.
DraftMore = Callable[[list[float]], str]


class DraftModelProposer:
    """A small model of the same family drafts autoregressively in its own KV cache.

    The cache is not rolled back here: each propose() syncs it to the accepted tokens, which
    keeps the accepted prefix, drops rejected drafts and feeds what the draft has not seen
    (the correction token, tokens other sources proposed, and the last draft token after a
    fully accepted round).
    """

    def __init__(self, draft: Runtime, cache: Optional[PromptCache] = None, canonical: bool = False,
                 follows_target: bool = False):
        self.draft = draft
        self.cache = cache
        # the target's MTP layers (runtime.MtpHead) are fed by the target's own decodes, the
        # prompt's included: nothing to prefill
        self.follows_target = follows_target
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

    def _prefill_now(self) -> None:
        tokens, self._prompt = self._prompt, None
        t0 = time.perf_counter()
        if self.follows_target:
            pass
        elif len(tokens) > self.draft.n_ctx:
            self.draft.truncate(0)
        elif self.cache is None:
            self.draft.truncate(0)
            self.draft.sync(tokens)
        else:
            self.n_prompt_cached = self.cache.prefill(tokens, self.canonical).n_reused
        self.t_prefill = time.perf_counter() - t0

    def propose(self, tokens: Sequence[int], n_draft: int, sampling: SamplingSettings,
                rng: np.random.Generator, draft_more: DraftMore,
                constraint: Optional[Constraint] = None) -> Proposal:
        """Draft up to n_draft tokens after tokens; under a constraint, from rows shaped as the
        target's will be (its state is explored and rolled back)."""
        if self._prompt is not None:
            self._prefill_now()
        n_draft = min(n_draft, self.draft.n_ctx - len(tokens) + 1)
        if n_draft <= 0:
            return EMPTY
        self.draft.sync(tokens)
        n_history = len(constraint.history) if constraint is not None else 0
        drafted: list[int] = []
        q: list[Optional[Dist]] = []
        confidence: list[float] = []
        try:
            for i in range(n_draft):
                row = self.draft.logits(0)
                if constraint is not None:
                    row = constraint.apply(row)
                if sampling.greedy:
                    x = greedy(row)
                    confidence.append(_top_probability(row))
                else:
                    q_i = distribution(row, sampling)
                    x = sample(q_i, rng)
                    q.append(q_i)
                    confidence.append(q_i.prob(x))
                decision = draft_more(confidence)
                if decision == "drop":
                    dropped = (x, confidence.pop())
                    del q[len(drafted):]
                    return Proposal(drafted, q or None, confidence, dropped)
                drafted.append(x)
                if decision == "stop" or i + 1 == n_draft:
                    break
                if constraint is not None:  # the next row is shaped after x
                    constraint.accept(x)
                self.draft.decode([x])
            return Proposal(drafted, q or None, confidence)
        finally:
            if constraint is not None:  # the constraint follows accepted tokens only
                constraint.rollback(len(constraint.history) - n_history)


def _top_probability(row: np.ndarray) -> float:
    m = row.max()
    return float(1.0 / np.exp(row - m).sum())


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
        self.last_match = 0  # length of the n-gram behind the last proposal (0: none)

    def prefill(self, tokens: Sequence[int]) -> None:
        self._index.clear()
        self._tokens = []
        self._extend(tokens)

    def _extend(self, tokens: Sequence[int]) -> None:
        n_old = len(self._tokens)
        if tokens[:n_old] != self._tokens:  # a different sequence: index from scratch
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

    def propose(self, tokens: Sequence[int], n_draft: int, sampling: SamplingSettings,
                rng: np.random.Generator, draft_more: Optional[DraftMore] = None) -> Proposal:
        n, start = self.match(tokens)
        self.last_match = n
        if n == 0:
            return EMPTY
        return Proposal(list(tokens[start:start + n_draft]), None)


class Proposer:
    """Where a round's candidates come from: the draft model, prompt lookup, or both, the
    policy choosing between them each round."""

    def __init__(self, draft: Optional[DraftModelProposer], lookup: Optional[PromptLookupProposer]):
        self.draft, self.lookup = draft, lookup

    def prefill(self, tokens: Sequence[int]) -> None:
        for source in (self.draft, self.lookup):
            if source is not None:
                source.prefill(tokens)

    def draft_prefill(self) -> tuple[int, float]:
        """(prompt tokens the draft model reused, seconds its prefill took); 0s if it never ran."""
        return (self.draft.n_prompt_cached, self.draft.t_prefill) if self.draft is not None else (0, 0.0)

    def lookup_offer(self, tokens: Sequence[int], n_max: int) -> tuple[int, list[int]]:
        """(n-gram length of prompt lookup's match, up to n_max tokens it would propose)."""
        if self.lookup is None or n_max <= 0:
            return 0, []
        n, start = self.lookup.match(tokens)
        return (n, list(tokens[start:start + n_max])) if n else (0, [])

    def propose(self, tokens: Sequence[int], source: str, n_draft: int, sampling: SamplingSettings,
                rng: np.random.Generator, draft_more: DraftMore,
                constraint: Optional[Constraint] = None) -> Proposal:
        if source == "draft" and self.draft is not None:
            return self.draft.propose(tokens, n_draft, sampling, rng, draft_more, constraint)
        if source == "lookup" and self.lookup is not None:
            return self.lookup.propose(tokens, n_draft, sampling, rng)
        return EMPTY
