"""The speculative decoding loop: propose -> verify in one target pass -> accept -> roll back.

It yields one Step per target pass and never looks at text: stopping rules live in the caller,
which simply stops iterating. Plain decoding is the same loop with no proposer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .constraints import Constraint
from ..controller import Policy, planning_load
from ..measuring.fidelity import Limits, near_tie, top_gap
from .proposals import EMPTY, NO_REPORT, DraftReport, Proposal, RoundOutcome, TreeShape
from .proposers import Generation, Proposer
from ..runtime.protocols import LaneLoad, Model, Pass
from .sampling import Dist, SamplingSettings, distribution, greedy, top_candidates
from .stats import Stats
from .verify import greedy_verify, speculative_verify, tree_greedy_verify, tree_speculative_verify


@dataclass(frozen=True)
class Step:
    """Tokens accepted by one target pass; the first n_from_draft of them were proposed: the
    first n_forced by a grammar, the rest by the round's source ("draft" or "lookup").

    logprobs (when asked for): per token, its log-probability under the target's raw row and
    that row's n most likely (token, log-probability) pairs.
    """

    tokens: list[int]
    n_from_draft: int
    logprobs: Optional[list[tuple[float, list[tuple[int, float]]]]] = None
    source: str = "none"
    n_forced: int = 0

    def origin(self, i: int) -> str:
        """Who chose tokens[i]: "grammar", "draft", "lookup" (kept by the target), or "target"."""
        if i >= self.n_from_draft:
            return "target"
        return "grammar" if i < self.n_forced else self.source


@dataclass
class Decoding:
    """What one generation decodes with. The caller has prefilled the target: its KV cache
    holds the prompt, with logits for the prompt's last token. The policy decides each round's
    source and draft length within the verify size the fidelity limits allow at the current KV
    length; the constraint (a grammar, logit bias, penalties) shapes every row before its token
    is chosen and follows the accepted tokens; n_logprobs asks each Step for logprobs with that
    many alternatives (0: the chosen token's only). lane: where the target is a lane of a shared
    context, what its rounds plan for (its verify passes ride with other lanes' rows)."""

    target: Model
    proposer: Optional[Proposer]
    policy: Policy
    sampling: SamplingSettings
    rng: np.random.Generator
    limits: Limits
    stats: Stats
    constraint: Optional[Constraint] = None
    n_logprobs: Optional[int] = None
    lane: Optional[LaneLoad] = None


@dataclass(frozen=True)
class _Round:
    """A round's proposal (forced tokens, then the source's), and for the policy what the source
    proposed alone, with the draft's report."""

    source: str
    proposal: Proposal
    drafted: Proposal
    n_forced: int
    offer: list[int]
    n_pending: int
    report: DraftReport


def generate_steps(d: Decoding, prompt: Sequence[int]) -> Generator[Step, None, None]:
    """Yield the accepted tokens round by round, forever or until the context is full. The
    target's KV cache always holds tokens[:-1]: the newest token is the first row of the next
    verify batch."""
    target, stats, tokens = d.target, d.stats, list(prompt)
    t0 = time.perf_counter()
    # 0. the first token comes from the prefill's last row; on a reused cache (or in a lane) it may be a
    # near-tie, judged once the first round knows the tolerance
    _, next_token, rows = _verify(d, EMPTY)
    first_gap = top_gap(rows[0]) if d.sampling.greedy and (d.limits.reuse is not None
                                                           or d.limits.shared is not None) else None
    stats.t_prefill += time.perf_counter() - t0
    tokens.append(next_token)
    if d.proposer is not None:  # the draft model prefills when a round first drafts with it
        d.proposer.start(prompt, Generation(d.sampling, d.rng, d.policy.draft_more, d.constraint))
    yield Step([next_token], 0, _logprobs(target, [next_token], d.n_logprobs))
    try:
        while len(tokens) <= target.n_ctx:
            n_past = len(tokens) - 1
            t0 = time.perf_counter()
            # 1. the largest verify batch the fidelity level allows here (plain decoding where it
            # has not been measured yet: the probe is queued for when the process is idle)
            d.limits.reach(n_past)
            # (a lane: also the largest pass its rows may ride in, other lanes' included)
            cap = d.limits.max_batch(n_past) if d.proposer is not None or d.lane is not None else 1
            n_verify_max = cap if d.proposer is not None else 1
            if d.lane is not None and not stats.n_rounds:  # the first round plans for the lanes generating now
                d.policy.load(*_lane_load(d.lane, cap, 0, 1))
            t1 = time.perf_counter()
            # 2. propose: tokens the grammar forces first (free), then the policy's source
            r = _propose(d, tokens, n_verify_max)
            t2 = time.perf_counter()
            # 3. verify: one target pass over [newest token, x_1..x_k], logits for all k+1 rows
            # (a tree: each branch a sequence of its own, so no branch sees another)
            done, row0 = _verify_pass(d, tokens[-1], r.proposal, n_past, cap)
            t3 = time.perf_counter()
            # 4. accept the agreeing prefix (a tree: the longest agreeing path) plus one target token
            path, next_token, rows = _verify(d, r.proposal)
            _judge_near_ties(d, rows, first_gap, n_past, r, len(tokens) - len(prompt), done)
            first_gap = None
            new = [*(r.proposal.tokens[i] for i in path), next_token]
            step = Step(new, len(path), _logprobs(target, new, d.n_logprobs, [0, *(i + 1 for i in path)]),
                        r.source, r.n_forced)
            # 5. roll the target back to what was accepted
            target.truncate(n_past + 1 + len(path), path if r.proposal.tree is not None else None)
            tokens.extend(new)
            _record(d, r, path, new, (t0, t1, t2, t3, time.perf_counter()), done, cap)
            if row0 is not None:
                _check_assumed(d, row0, tokens[n_past], n_past, new[:-1])
            yield step
    finally:
        # interrupted between verify and rollback: drop the unverified rows (a recurrent memory
        # that cannot stop there drops more, for the next prefill to decode again)
        target.discard(len(tokens) - 1)
        if d.proposer is not None:  # the draft's prefill ran inside a draft step: count it apart
            stats.n_draft_prompt_cached, stats.t_draft_prefill = d.proposer.draft_prefill()
            stats.t_draft -= stats.t_draft_prefill
        if first_gap is not None:  # no round ran: judge the first row if the tolerance is known
            _judge_first_row(first_gap, d.limits.tolerance(len(prompt) - 1, 1), stats)


def _propose(d: Decoding, tokens: list[int], n_verify_max: int) -> _Round:
    """The round's proposal within k_cap: what the verify limit, the context and the memory's
    rollback allow, less the rows pending tokens of an earlier tree take."""
    n_pending = d.target.pending_rows(n_verify_max)
    if d.proposer is None:
        return _Round("none", EMPTY, EMPTY, 0, [], n_pending, NO_REPORT)
    k_cap = min(d.target.n_ctx - len(tokens), n_verify_max - 1, d.target.max_verify - 1) - n_pending
    forced = d.constraint.forced(k_cap) if d.constraint is not None else []
    context = [*tokens, *forced]
    drafted, report = EMPTY, NO_REPORT
    with _exploring(d.constraint, forced):
        n_match, offer = d.proposer.lookup_offer(context, k_cap - len(forced))
        source, n_draft = d.policy.plan(k_cap - len(forced), n_match, len(offer), d.proposer.draft_lag(context),
                                        len(context))
        if n_draft > 0:
            drafted = d.proposer.propose(context, source, n_draft, offer, _shape(d, k_cap))
            report = d.proposer.report
            if d.constraint is not None:  # a token the grammar forbids is never accepted
                n_valid = d.constraint.n_valid(drafted.tokens)
                if n_valid < len(drafted.tokens):
                    drafted, report = drafted.first(n_valid), DraftReport(report.confidence[:n_valid])
    # forced tokens, then the source's: one round (a forced token's q is one-hot, as lookup's)
    q: Optional[list[Optional[Dist]]] = None if drafted.q is None else [*([None] * len(forced)), *drafted.q]
    proposal = drafted if not forced else Proposal([*forced, *drafted.tokens], q)
    return _Round(source, proposal, drafted, len(forced), offer, n_pending, report)


def _shape(d: Decoding, k_cap: int) -> Optional[TreeShape]:
    """How far this round may branch: trees need a target that verifies them and no constraint
    (a grammar's state follows one path)."""
    if d.policy.width <= 1 or d.target.n_branches <= 1 or d.constraint is not None:
        return None
    return TreeShape(d.policy.width, k_cap, d.target.n_branches, d.policy.sibling, d.policy.lookup_node)


def _record(d: Decoding, r: _Round, path: list[int], new: list[int], times: tuple[float, ...], done: Pass,
            cap: int) -> None:
    """Where the round's time went, its counts, and what the policy learns from it: its own
    source, on the rounds that reached its drafts; what the rollback cost (a recurrent state
    restored and replayed) is part of the pass (done: what the verify pass held; cap: the
    most rows it could)."""
    t0, t1, t2, t3, t4 = times
    stats = d.stats
    stats.t_draft += t2 - t0  # the limit's lookup (t0..t1) is part of planning the round
    stats.t_verify += t3 - t2
    stats.t_rollback += t4 - t3
    stats.record_round(len(r.proposal.tokens), len(path), r.source, r.n_forced)
    if r.proposal.tree is not None:
        stats.record_tree(r.proposal.tree, path)
    if d.proposer is not None:
        # a lane's pass: its rows (other lanes' too) are what its time bought, and the time it
        # waited for other lanes' rounds is not this round's cost; the next round plans for
        # the lanes generating now (planning_load)
        n_own = r.n_pending + len(r.proposal.tokens) + 1
        n_verify = max(n_own, done.n_rows)
        seconds = t4 - t2 - done.t_waited
        n_other, n_lanes, n_cap = _lane_load(d.lane, cap, n_verify - n_own, done.n_lanes)
        room = n_cap if d.lane is not None else None
        if len(path) >= r.n_forced:
            d.policy.observe(RoundOutcome(r.source, r.drafted, new[r.n_forced:], seconds, d.sampling.greedy,
                                          r.report, r.offer, n_verify, n_other, n_lanes, room))
        else:
            d.policy.observe(RoundOutcome("grammar", EMPTY, new, seconds, d.sampling.greedy, n_verify=n_verify,
                                          n_other=n_other, n_lanes=n_lanes, n_cap=room))


def _lane_load(lane: Optional[LaneLoad], cap: int, n_other: int, n_lanes: int) -> tuple[int, int, int]:
    """What a lane plans its next round for: the rows and lanes beside its own (planning_load,
    from its last pass's), and the rows of a pass of at most cap it may plan for, the others'
    and its share (shared.fair_room): its rows past that are priced as a pass of their own.
    A context of its own (lane None): its last pass's, and all of cap."""
    if lane is None:
        return n_other, n_lanes, n_other + cap
    n_other, n_lanes = planning_load(n_other, n_lanes, lane.n_active())
    return n_other, n_lanes, n_other + lane.room(cap)


def _judge_near_ties(d: Decoding, rows: list[np.ndarray], first_gap: Optional[float], n_past: int, r: _Round,
                     n_generated: int, done: Pass) -> None:
    """Record the accepted rows whose top two logits are within the tolerance: the only places
    where plain decoding could have chosen another token (and the first row's, in round one);
    done: what the rows' pass held."""
    if first_gap is not None:
        _judge_first_row(first_gap, d.limits.tolerance(n_past, 1), d.stats)
    if not d.sampling.greedy or (d.proposer is None and d.limits.reuse is None and d.limits.shared is None):
        return
    # the rows' pass: the round's own rows, or more where other lanes' rows rode with them
    n_rows = max(r.n_pending + len(r.proposal.tokens) + 1, done.n_rows)
    tolerance = d.limits.tolerance(n_past - r.n_pending, n_rows)
    if math.isnan(tolerance):  # this level measured nothing, so nothing can be judged
        d.stats.near_ties = None
        return
    for i, row in enumerate(rows):
        if near_tie(row, tolerance):
            d.stats.near_tie_positions.append(n_generated + i)


def _judge_first_row(gap: float, tolerance: float, stats: Stats) -> None:
    if math.isnan(tolerance):
        stats.near_ties = None
    elif tolerance > 0 and gap <= tolerance:
        stats.near_tie_positions.insert(0, 0)


def _verify_pass(d: Decoding, newest: int, proposal: Proposal, n_past: int,
                 cap: int) -> tuple[Pass, Optional[np.ndarray]]:
    """One target pass over [newest, x_1..x_k], logits for every row (a tree: each branch a
    sequence of its own, so no branch sees another), in a pass of at most cap rows (a lane:
    other lanes' rows may ride in it). What the pass held, and where the round's verify limit
    is assumed and not checked yet (fidelity.Limits.wants_check), a copy of the first row, for
    _check_assumed; else None."""
    target = d.target
    if proposal.tree is None:
        done = target.decode([newest, *proposal.tokens], n_logits=len(proposal.tokens) + 1, cap=cap)
    else:
        done = target.decode_tree(newest, proposal.tokens, proposal.tree, cap)
    checking = proposal.tokens and d.limits.shared is None and d.limits.wants_check(n_past)
    return done, target.logits(0).copy() if checking else None


def _check_assumed(d: Decoding, row0: np.ndarray, newest: int, n_past: int, accepted: list[int]) -> None:
    """The first row of a verify pass where the limit is assumed, against the same row decoded
    alone (once per KV group and process: about two one-row passes, where the probe it stands in
    for takes 4-8 s here): the target's cache goes back to n_past, decodes newest alone, then the
    accepted tokens again. A first row further off than half the level's bound ends the
    assumption (fidelity.DiffTable.assumed)."""
    target = d.target
    target.truncate(n_past)
    target.decode([newest])
    diff = float(np.max(np.abs(target.logits(0) - row0)))
    if accepted:
        target.decode(accepted)
    d.limits.checked(n_past, diff)


def _verify(d: Decoding, proposal: Proposal) -> tuple[list[int], int, list[np.ndarray]]:
    """(the accepted drafts' indices, next_token, the rows the verifier read, as tokens were
    chosen from them, in path order).

    Under a constraint, row i is shaped after x_1..x_{i-1}: the verifier asks for row i only
    once it has accepted x_{i-1}, which the constraint then consumes; the round's last token
    is consumed last, so the constraint ends holding exactly the accepted tokens.
    """
    target, sampling, constraint = d.target, d.sampling, d.constraint
    seen: list[np.ndarray] = []
    if proposal.tree is not None:  # a tree (never under a constraint): walk it
        def row(node: int) -> np.ndarray:
            seen.append(target.logits(node + 1))
            return seen[-1]

        if sampling.greedy:
            path, next_token = tree_greedy_verify(proposal.tokens, proposal.tree, lambda node: greedy(row(node)))
        else:
            path, next_token = tree_speculative_verify(proposal.tokens, proposal.tree, proposal.q or [],
                                                       lambda node: distribution(row(node), sampling), d.rng)
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
                                                    (distribution(row, sampling) for row in rows()), d.rng)
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


def _logprobs(target: Model, tokens: list[int], n_top: Optional[int],
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
        top: Sequence[int] = top_candidates(logp, n_top).tolist() if n_top else []
        out.append((float(logp[token]), [(int(t), float(logp[t])) for t in top]))
    return out
