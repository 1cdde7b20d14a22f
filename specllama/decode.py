"""The speculative decoding loop: propose -> verify in one target pass -> accept -> roll back.

It yields one Step per target pass and never looks at text: stopping rules live in the caller,
which simply stops iterating. Plain decoding is the same loop with no proposer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .constraints import Constraint
from .fidelity import Limits, kv_length, near_tie, top_gap
from .proposers import EMPTY, Proposal, Proposer, TreeShape
from .runtime import Runtime
from .sampling import SamplingSettings, distribution, greedy, top_candidates
from .stats import Stats
from .verify import greedy_verify, speculative_verify, tree_greedy_verify, tree_speculative_verify


@dataclass(frozen=True)
class Step:
    """Tokens accepted by one target pass; the first n_from_draft of them were drafted.

    logprobs (when asked for): per token, its log-probability under the target's raw row and
    that row's n most likely (token, log-probability) pairs.
    """

    tokens: list[int]
    n_from_draft: int
    logprobs: Optional[list[tuple[float, list[tuple[int, float]]]]] = None


def generate_steps(
    target: Runtime,
    proposer: Optional[Proposer],
    sampling: SamplingSettings,
    rng: np.random.Generator,
    prompt: Sequence[int],
    policy: Any,
    limits: Limits,
    stats: Stats,
    constraint: Optional[Constraint] = None,
    n_logprobs: Optional[int] = None,
) -> Iterator[Step]:
    """Yield the accepted tokens round by round, forever or until the context is full.

    The caller has prefilled the target: its KV cache holds the prompt, with logits for the
    prompt's last token. policy (FixedDraft or Controller) decides each round's source and
    draft length within the verify size the fidelity limits allow at the current KV length.

    The target's KV cache always holds tokens[:-1]: the newest token is fed as the first
    row of the next verify batch.

    constraint (a grammar, logit bias, penalties) shapes every row before its token is chosen
    and follows the accepted tokens; n_logprobs asks each Step for logprobs with that many
    alternatives (0: the chosen token's only).
    """
    tokens = list(prompt)
    t_start = time.perf_counter()
    # 0. the first token comes from the prefill's last row; on a reused cache that row may be a
    # near-tie, judged once the first round knows the tolerance
    n_accepted, next_token, rows = _verify(target, EMPTY, sampling, rng, constraint)
    first_gap = top_gap(rows[0]) if sampling.greedy and limits.reuse is not None else None
    stats.t_prefill += time.perf_counter() - t_start
    tokens.append(next_token)
    if proposer is not None:  # the draft model prefills when a round first drafts with it
        proposer.prefill(prompt)
    yield Step([next_token], 0, _logprobs(target, [next_token], n_logprobs))
    try:
        while len(tokens) <= target.n_ctx:
            n_past = len(tokens) - 1
            # 1. the largest verify batch the fidelity level allows here (measured on first reach,
            # with the difference rows on a reused cache carry)
            t0 = time.perf_counter()
            limits.reach(n_past)
            n_verify_max = limits.max_batch(n_past) if proposer is not None else 1
            n_pending = _pending_rows(target, n_past, n_verify_max)
            t1 = time.perf_counter()
            # 2. propose from the source and as far as the policy wants, within limits and context;
            # tokens the grammar forces come first, for free, and the source continues after them
            source, n_draft, proposal, offer, forced = "none", 0, EMPTY, [], []
            if proposer is not None:
                k_cap = min(target.n_ctx - len(tokens), n_verify_max - 1, target.max_verify - 1) - n_pending
                forced = constraint.forced(k_cap) if constraint is not None else []
                context = [*tokens, *forced]
                with _exploring(constraint, forced):
                    n_match, offer = proposer.lookup_offer(context, k_cap - len(forced))
                    source, n_draft = policy.plan(k_cap - len(forced), n_match, len(offer),
                                                  proposer.draft_lag(context))
                    if n_draft > 0:
                        proposal = proposer.propose(context, source, n_draft, sampling, rng, policy.draft_more,
                                                    constraint, _shape(policy, target, k_cap, constraint), offer)
                        if constraint is not None:  # a token the grammar forbids is never accepted
                            proposal = _within(proposal, constraint.n_valid(proposal.tokens))
            drafted, proposal = proposal, _after(forced, proposal)
            t2 = time.perf_counter()
            # 3. verify: one target pass over [newest token, x_1..x_k], logits for all k+1 rows
            # (a tree: each branch a sequence of its own, so no branch sees another)
            if proposal.parents is None:
                target.decode([tokens[-1], *proposal.tokens], n_logits=len(proposal.tokens) + 1)
            else:
                target.decode_tree([tokens[-1], *proposal.tokens], [-1, *(p + 1 for p in proposal.parents)])
            t3 = time.perf_counter()
            # 4. accept the agreeing prefix (a tree: the longest agreeing path) plus one target token
            path, next_token, rows = _verify(target, proposal, sampling, rng, constraint)
            n_accepted, path_rows = len(path), [0, *(i + 1 for i in path)]
            if first_gap is not None:
                _judge_first_row(first_gap, limits.tolerance(n_past, 1), stats)
                first_gap = None
            if sampling.greedy and (proposer is not None or limits.reuse is not None):
                _count_near_ties(rows, limits.tolerance(n_past - n_pending, n_pending + len(proposal.tokens) + 1),
                                 len(tokens) - len(prompt), stats)
            new = [*(proposal.tokens[i] for i in path), next_token]
            step = Step(new, n_accepted, _logprobs(target, new, n_logprobs, path_rows))
            # 5. roll the target back to what was accepted
            target.truncate(n_past + 1 + n_accepted, path_rows if proposal.parents is not None else None)
            tokens.extend(new)
            t4 = time.perf_counter()
            stats.t_calibrate += t1 - t0
            stats.t_draft += t2 - t1
            stats.t_verify += t3 - t2
            stats.t_rollback += t4 - t3
            stats.record_round(len(proposal.tokens), n_accepted, source, len(forced))
            if proposal.parents is not None:
                stats.record_tree(proposal, path)
            if proposer is not None:
                # the policy judges its own source, on the rounds that reached its drafts; what
                # the rollback cost (a recurrent state restored and replayed) is part of the pass
                if n_accepted >= len(forced):
                    policy.observe(source, drafted, new[len(forced):], t4 - t2, offer, sampling.greedy,
                                   n_verify=n_pending + len(proposal.tokens) + 1)
                else:
                    policy.observe("grammar", EMPTY, new, t4 - t2, [], sampling.greedy,
                                   n_verify=n_pending + len(proposal.tokens) + 1)
            yield step
    finally:
        # interrupted between verify and rollback: drop the unverified rows (a recurrent memory
        # that cannot stop there drops more, for the next prefill to decode again)
        target.discard(len(tokens) - 1)
        if proposer is not None:  # the draft's prefill ran inside a draft step: count it apart
            stats.n_draft_prompt_cached, stats.t_draft_prefill = proposer.draft_prefill()
            stats.t_draft -= stats.t_draft_prefill
        if first_gap is not None:  # no round ran: judge the first row if the tolerance is known
            _judge_first_row(first_gap, limits.tolerance(len(prompt) - 1, 1, measure=False), stats)


def _pending_rows(target: Runtime, n_past: int, n_verify_max: int) -> int:
    """Rows this round's batch gives to tokens a tree round kept off its first branch (not in
    the KV cache yet, they go in front of the batch). Where they would make the batch larger
    than the fidelity level allows, or start it below a KV padding step, they are decoded
    one at a time first."""
    n = target.n_pending
    if n and (n >= n_verify_max or kv_length(n_past - n + 1, target.n_ctx) != kv_length(n_past + 1, target.n_ctx)):
        target.flush_pending()
        return 0
    return n


def _judge_first_row(gap: float, tolerance: float, stats: Stats) -> None:
    if math.isnan(tolerance):
        stats.near_ties = None
    elif tolerance > 0 and gap <= tolerance:
        stats.near_tie_positions.insert(0, 0)


def _count_near_ties(rows: list[np.ndarray], tolerance: float, n_generated: int, stats: Stats) -> None:
    """Record the accepted rows whose top two logits are within tolerance: the only places
    where plain decoding could have chosen another token."""
    if math.isnan(tolerance):  # this level measured nothing, so nothing can be judged
        stats.near_ties = None
        return
    for i, row in enumerate(rows):
        if near_tie(row, tolerance):
            stats.near_tie_positions.append(n_generated + i)


def _shape(policy: Any, target: Runtime, k_cap: int, constraint: Optional[Constraint]) -> Optional[TreeShape]:
    """How far this round may branch: trees need a target that verifies them and no constraint
    (a grammar's state follows one path)."""
    width = getattr(policy, "width", 1)
    if width <= 1 or target.n_branches <= 1 or constraint is not None:
        return None
    return TreeShape(width, k_cap, target.n_branches, policy.sibling, policy.lookup_node)


def _verify(target: Runtime, proposal: Proposal, sampling: SamplingSettings, rng: np.random.Generator,
            constraint: Optional[Constraint]) -> tuple[list[int], int, list[np.ndarray]]:
    """(the accepted drafts' indices, next_token, the rows the verifier read, as tokens were
    chosen from them, in path order).

    Under a constraint, row i is shaped after x_1..x_{i-1}: the verifier asks for row i only
    once it has accepted x_{i-1}, which the constraint then consumes; the round's last token
    is consumed last, so the constraint ends holding exactly the accepted tokens.
    """
    seen: list[np.ndarray] = []
    if proposal.parents is not None:  # a tree (never under a constraint): walk it
        def row(node: int) -> np.ndarray:
            seen.append(target.logits(node + 1))
            return seen[-1]

        if sampling.greedy:
            path, next_token = tree_greedy_verify(proposal.tokens, proposal.parents, lambda node: greedy(row(node)))
        else:
            path, next_token = tree_speculative_verify(proposal.tokens, proposal.parents, proposal.q,
                                                       lambda node: distribution(row(node), sampling), rng)
        return path, next_token, seen

    def rows() -> Iterator[np.ndarray]:
        for i in range(len(proposal.tokens) + 1):
            if i > 0 and constraint is not None:
                constraint.accept(proposal.tokens[i - 1])  # the verifier accepted it
            row = target.logits(i)
            seen.append(row if constraint is None else constraint.apply(row))
            yield seen[-1]

    if sampling.greedy:
        n_accepted, next_token = greedy_verify(proposal.tokens, (greedy(row) for row in rows()))
    else:
        q = proposal.q if proposal.q is not None else [None] * len(proposal.tokens)
        n_accepted, next_token = speculative_verify(proposal.tokens, q,
                                                    (distribution(row, sampling) for row in rows()), rng)
    if constraint is not None:
        constraint.accept(next_token)
    return list(range(n_accepted)), next_token, seen


@contextmanager
def _exploring(constraint: Optional[Constraint], tokens: list[int]) -> Iterator[None]:
    """The constraint advanced over tokens for the duration, then rolled back."""
    if constraint is None or not tokens:
        yield
        return
    for token in tokens:
        constraint.accept(token)
    try:
        yield
    finally:
        constraint.rollback(len(tokens))


def _after(forced: list[int], proposal: Proposal) -> Proposal:
    """forced, then the proposal: one round (a forced token's q is one-hot, as lookup's)."""
    if not forced:
        return proposal
    q = [None] * len(forced) + list(proposal.q) if proposal.q is not None else None
    return Proposal([*forced, *proposal.tokens], q)


def _within(proposal: Proposal, n: int) -> Proposal:
    """The proposal's first n tokens."""
    if n >= len(proposal.tokens):
        return proposal
    return Proposal(proposal.tokens[:n], proposal.q[:n] if proposal.q is not None else None,
                    proposal.confidence[:n])


def _logprobs(target: Runtime, tokens: list[int], n_top: Optional[int],
              rows: Optional[Sequence[int]] = None) -> Optional[list]:
    """Each token's log-probability in its row of the last decode (token i's is rows[i], or
    row i), with the row's top n_top."""
    if n_top is None:
        return None
    out = []
    for i, token in enumerate(tokens):
        row = target.logits(rows[i] if rows is not None else i).astype(np.float64)
        m = row.max()
        logp = row - (m + math.log(np.exp(row - m).sum()))
        top = top_candidates(logp, n_top) if n_top else []
        out.append((float(logp[token]), [(int(t), float(logp[t])) for t in top]))
    return out
