"""How far to draft each round, and from which source, chosen from this machine's costs and
this text's acceptance as the generation runs.

Speculation pays when (expected tokens per round) / (round time) beats one plain target step.
With k drafted tokens, P_j the chance drafts 1..j are all accepted, c_d the draft's cost per
token and v(n) the target's cost to decode n tokens at once:

    E[tokens | k] = 1 + sum_{j=1..k} P_j        T(k) = k * c_d + v(k + 1)

Each round the Controller compares plain decoding (1 / v(1)), the draft model and prompt
lookup (free to draft, so T = v(k + 1)) by their best expected rate R. While the draft model
drafts x_1..x_i, it goes on while m more drafts are expected to bring more tokens than R would
in the time they take:

    P_i * gain(m) > R * (m * c_d + v(i + 1 + m) - v(i + 1))

P_i, the chance x_1..x_i are all accepted, multiplies the acceptance predicted for each token
from the draft's own probability of it (a calibration of that confidence against what the
target accepted, kept per model pair), and gain(m) counts the tokens m more drafts would add
at the text's mean acceptance. So the draft runs long on code it is sure of and stops at the
first uncertain token of prose. The yardstick is R, not the round's own E/T (renewal-reward:
the long-run rate is what a round's time could otherwise buy): after a run of sure tokens a
round's own E/T stands above R, and on our CPU it stopped code drafts at 3-4 tokens where 5
paid more. A drafted token is dropped when neither it nor any continuation is worth the rows they
add to the verify pass: P_i * (1 + gain(m)) <= R * (m * c_d + v(i + 1 + m) - v(i)) for every m
(on a CPU the second row of a pass costs several times the third, so a first token alone
rarely pays for its row while the tokens after it share that cost).

Costs are learned online (OnlineCosts): every round times its verify pass and every draft
step, and robust running estimates correct the calibration they start from, so a noisy or
stale calibration cannot keep speculation on where it loses.

A record that stopped the draft is not renewed while it stays off (other rounds judge no
drafts, and the draft falls further behind). Two things bring it back: the text's mean sinks
back to the pair's long-run record, and the catch-up (one batch) is spread over the tokens the
draft will serve (lag_cost). And rounds without the draft earn a credit, EXPLORE_SHARE of their
modelled time; once it covers a short draft round, its catch-up included, the draft is tried
again (never to start its prefill), the try's modelled cost beyond the best other source's
paid from the credit: where the draft loses, trying costs at most that share of the time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np

from ..decoding.proposals import RoundOutcome
from ..decoding.tree import Tree
from .acceptance import N_EXPLORE, Acceptance, TextAcceptance
from ..decoding.limits import TREE_ROWS
from .costs import OnlineCosts, shared_pass_costs

EXPLORE_SHARE = 0.015  # of the modelled time of rounds without the draft, spent trying it again
TRY_DRAFT = 2  # the most tokens such a try drafts
EXPLORE_PREFILL_SHARE = 0.1  # of the expected plain time, the draft's prefill a plan may start on hope
CATCH_UP_HORIZON = 32  # tokens a catch-up is expected to serve before the draft is left behind again
# tokens a generation is expected to run at its start where its limit allows more (GenerateOptions'
# default max_tokens): a client that sends no max_tokens leaves thousands, over which any prefill
# of the draft looked free
EXPECTED_LENGTH = 256


class Policy(Protocol):
    """What the loop asks of a policy each round: plan a source and how far to draft, decide
    during drafting, and learn from what the round did."""

    limit: int
    width: int
    has_draft: bool
    lookup: bool

    def plan(self, k_cap: int, n_match: int, n_lookup: int, lag: tuple[int, bool] = (0, False),
             n_kv: int = 0) -> tuple[str, int]: ...

    def draft_more(self, confidences: list[float]) -> str: ...

    def sibling(self, confidence: float) -> bool: ...

    def lookup_node(self, depth: int) -> bool: ...

    def observe(self, outcome: RoundOutcome) -> None: ...

    def load(self, n_other: int, n_lanes: int, n_cap: Optional[int]) -> None: ...

    def as_dict(self) -> dict: ...


class FixedDraft:
    """Always draft k tokens from the draft model (or fewer when the context or the fidelity
    limit says so); prompt lookup goes first on long matches only when asked to. width > 1
    verifies a tree: width - 1 of the draft's next-best tokens beside each drafted one."""

    def __init__(self, k: int, *, has_draft: bool = True, lookup: bool = False, width: int = 1):
        self.limit, self.width = k, width
        self.has_draft, self.lookup = has_draft, lookup

    def plan(self, k_cap: int, n_match: int, n_lookup: int, lag: tuple[int, bool] = (0, False),
             n_kv: int = 0) -> tuple[str, int]:
        k = min(self.limit, k_cap)
        if k <= 0:
            return "none", 0
        if n_lookup and (not self.has_draft or (self.lookup and n_match >= 3)):
            return "lookup", min(k, n_lookup)
        return ("draft", k) if self.has_draft else ("none", 0)

    def draft_more(self, confidences: list[float]) -> str:
        return "more"

    def sibling(self, confidence: float) -> bool:
        return True

    def lookup_node(self, depth: int) -> bool:
        return self.lookup

    def observe(self, outcome: RoundOutcome) -> None:
        pass

    def load(self, n_other: int, n_lanes: int, n_cap: Optional[int]) -> None:
        pass

    def as_dict(self) -> dict:
        return {"kind": "fixed", "n_draft": self.limit, **({"width": self.width} if self.width > 1 else {})}


class Controller:
    """Each round: plain, draft model or prompt lookup, and how far, by expected tokens/second.

    Args:
        costs: OnlineCosts (shared across generations, so what one learned serves the next).
        limit: the most tokens a round may draft.
        has_draft, lookup: which sources exist.
        acceptance: the draft's Acceptance, shared across generations like costs (None: new).
        clock: seconds now; the gaps between draft_more calls time the draft's steps.
        width: the most candidates a round may verify at one position (1: chains only).
        n_tokens: the most tokens the generation may produce (spreads the draft's prefill).
    """

    def __init__(self, costs: OnlineCosts, limit: int, *, has_draft: bool, lookup: bool,
                 acceptance: Optional[Acceptance] = None, clock: Callable[[], float] = time.perf_counter,
                 width: int = 1, n_tokens: int = 256):
        self.costs, self.limit, self.clock, self.width = costs, limit, clock, width
        self.n_tokens, self.n_left = n_tokens, n_tokens
        self.has_draft, self.lookup = has_draft, lookup
        # the pair's calibration, shared by its generations; this text's own mean
        self.draft_acceptance = TextAcceptance(acceptance if acceptance is not None else Acceptance())
        self.lookup_hits = np.zeros(5)  # by match length 2, 3, 4+ (index = min(n, 4))
        self.lookup_seen = np.zeros(5)
        self._v = costs.table(limit + TREE_ROWS)
        self._c_d = costs.draft_token
        self._round: Optional[_Round] = None
        self._match = 0  # n-gram length behind this round's lookup proposal
        self._credit = 0.0  # modelled seconds the controller may spend trying the draft again
        self._trying = False  # this round tries a draft its record says loses
        self._rate_else = 0.0  # the best rate without the draft, as this round was planned
        self._load: tuple[int, int, Optional[int]] = (0, 1, None)  # load()'s: the last round's pass
        self._n_kv = 0  # cached tokens the round's draft steps attend over

    def _best_draft_rate(self, alpha: float, k_max: int, c_d: Optional[float] = None,
                         lag_per_token: float = 0.0) -> tuple[float, int]:
        if k_max <= 0:
            return 0.0, 0
        ks = np.arange(1, k_max + 1)
        expected = 1.0 + np.cumsum(alpha ** ks)
        rates = expected / (ks * (self._c_d if c_d is None else c_d) + self._v[ks + 1] + expected * lag_per_token)
        best = int(np.argmax(rates))
        return float(rates[best]), best + 1

    def lookup_alpha(self, n_match: int) -> float:
        i = min(n_match, 4)
        return float((self.lookup_hits[i] + 0.5 * 2.0) / (self.lookup_seen[i] + 2.0))

    def lag_cost(self, n_lag: int, prefill: bool) -> float:
        """Seconds each token a draft round brings must carry for the tokens the draft is
        behind beyond the one every round feeds it, spread over the tokens the rounds it serves
        bring: the generation's expected rest for its prefill, at most CATCH_UP_HORIZON for a
        catch-up (other sources may leave it behind again). Charged to one round, the lag kept
        the draft off for good; spread per round, a 4-draft round at 91% carried 2.2x too little."""
        horizon = self.expected_left() if prefill else min(self.n_left, CATCH_UP_HORIZON)
        return self._catch_up(n_lag) / max(horizon, 1)

    def explore_allowance(self) -> float:
        """Seconds of the draft's prefill a generation may risk on hope rather than on its
        record: EXPLORE_PREFILL_SHARE of the plain time of the tokens it is expected to bring."""
        return EXPLORE_PREFILL_SHARE * self.expected_left() * self._v[1]

    def expected_left(self) -> int:
        """Tokens the generation is expected to bring still, within its limit: answers' lengths
        are heavy-tailed, so one that has run g tokens is expected to run about g more, and at
        its start about EXPECTED_LENGTH."""
        return min(self.n_left, max(self.n_tokens - self.n_left, EXPECTED_LENGTH))

    def _catch_up(self, n_lag: int) -> float:
        """The draft's seconds to decode the n_lag tokens it is behind, beyond the one token
        every round feeds it."""
        return self.costs.catch_up(n_lag) - self.costs.catch_up(1) if n_lag >= 2 else 0.0

    def plan(self, k_cap: int, n_match: int, n_lookup: int, lag: tuple[int, bool] = (0, False),
             n_kv: int = 0) -> tuple[str, int]:
        """The source ("none", "draft", "lookup") and most tokens to draft this round; lag: the
        draft's (tokens to decode first, whether its prefill is among them); n_kv: tokens held."""
        self._n_kv = n_kv
        self.load(*self._load)  # the passes and draft steps priced at the context's length
        # a round makes at most k + 1 tokens: drafts past the generation's end buy nothing
        k_cap = min(k_cap, self.limit, self.n_left - 1 if self.n_left > 0 else k_cap)
        self._round, self._match, self._trying = None, n_match, False
        best, choice = 1.0 / self._v[1], ("none", 0)
        if k_cap <= 0 or (self.costs.wants(1) and self._load[1] <= 1):
            # a plain round now and then keeps v(1), the figure every choice is weighed
            # against, measured: a stale one could keep speculation on where it loses
            return choice
        draft_rate = on_record = 0.0
        if self.has_draft:
            lag_per_token = self.lag_cost(*lag)
            on_record, _ = self._best_draft_rate(self.draft_acceptance.mean(), k_cap, lag_per_token=lag_per_token)
            # optimistic until the pair has judged N_EXPLORE drafts: a draft never tried is
            # never learned (a pessimistic start kept a fresh load plain through whole
            # generations of code it drafts at 80%), nor one whose first draft, an answer's
            # unsure opening, was rejected; a few rounds find out. After that, hoping for
            # RECORD_HOPE standard errors above the mean (greedy on it, an unlucky start kept
            # a draft off that only drafting could renew). Hope is for a generation planning
            # alone: beside other lanes a draft that loses stalls every lane's pass while what
            # it teaches serves one lane (8 requests at once in a new process each explored: 6
            # prefills of 0.4-1.0 s for 79 drafts, 41% accepted). Nor for a prefill over
            # explore_allowance(): a long prompt's (17 s for 2,900 tokens here) is paid in
            # full on the request's path, where idle time would catch the draft up for free
            if self._load[1] > 1 or (lag[1] and self._catch_up(lag[0]) > self.explore_allowance()):
                hope = self.draft_acceptance.mean()
            elif self.draft_acceptance.n_judged < N_EXPLORE:
                hope = 1.0
            else:
                hope = self.draft_acceptance.hoped_mean()
            draft_rate, _ = self._best_draft_rate(hope, k_cap, lag_per_token=lag_per_token)
        if self.lookup and n_lookup:
            rate, k = self._best_draft_rate(self.lookup_alpha(n_match), min(k_cap, n_lookup), c_d=0.0)
            if rate > best:
                best, choice = rate, ("lookup", k)
        if draft_rate > best:
            choice = ("draft", k_cap)
        elif self.has_draft and not lag[1] and \
                self._credit >= self._c_d + self._v[2] - 1.0 / best + self._catch_up(lag[0]):
            # a short try: a token or two tell whether the text has turned
            choice, self._trying = ("draft", min(k_cap, TRY_DRAFT)), True
        if choice[0] == "draft":
            alpha = self.draft_acceptance.mean()
            gain = [0.0]
            for m in range(1, choice[1] + 1):
                gain.append(gain[-1] + alpha ** m)  # expected extra tokens from m more drafts
            # the rate the round's drafts must beat: the best other source's, or the draft's
            # own on its record (optimism picks an untried draft; it must not raise the bar,
            # or an untried draft drops its every token)
            self._round = _Round(choice[1], gain, self._v.tolist(), max(best, on_record))
        self._rate_else = best
        return choice

    def draft_more(self, confidences: list[float]) -> str:
        """After the draft chose x_i with the given confidence: "more" (decode it and draft
        another), "stop" (propose x_1..x_i) or "drop" (propose x_1..x_{i-1})."""
        r, now = self._round, self.clock()
        if r is None:
            return "more"
        if r.t_last is not None:
            # one draft decode since the last call
            self.costs.observe_draft_step(now - r.t_last, self._load[1] > 1, self._n_kv)
        r.t_last = now
        # x_i's row comes after the root, x_1..x_{i-1} and the siblings verified beside them
        i, v, c_d = len(confidences) + r.n_siblings, r.v, self._c_d
        p_all = r.p_all * self.draft_acceptance.predict(confidences[-1])
        # x_i's draft step is spent either way; keeping it costs its row in the verify pass,
        # shared with the rows of any drafts after it (on a CPU the second row of a pass costs
        # five times the third): dropped only where no continuation pays for it
        n_more = r.k_max - len(confidences)
        if not any(p_all * (1.0 + r.gain[m]) > r.rate * (m * c_d + v[i + 1 + m] - v[i]) for m in range(n_more + 1)):
            return "drop"
        r.p_reach, r.p_all, r.n_chain = r.p_all, p_all, len(confidences)
        # would m more drafts (each accepted at the mean rate) yield more than the rate
        # rounds achieve would in the time they take?
        for m in range(1, r.k_max - len(confidences) + 1):
            if p_all * r.gain[m] > r.rate * (m * c_d + v[i + 1 + m] - v[i + 1]):
                return "more"
        return "stop"

    def sibling(self, confidence: float) -> bool:
        """Whether to verify, beside the token the draft just kept, another it gave this
        confidence: it adds a token when its position is reached and the target picks it
        (then the kept token was wrong), worth its row if P(reached) * P(picked) > R * row cost."""
        r = self._round
        # the bins pool all low confidences: a 2% second choice must not borrow a 25% one's record
        return r is not None and self._worth_row(
            r.p_reach * min(confidence, self.draft_acceptance.siblings.predict(confidence)))

    def lookup_node(self, depth: int) -> bool:
        """Whether prompt lookup's depth-th token (a branch beside the draft's) pays for its row."""
        r = self._round
        return r is not None and self._worth_row(self.lookup_alpha(self._match) ** depth)

    def _worth_row(self, p_gain: float) -> bool:
        r = self._round
        assert r is not None  # asked while the draft drafts a round
        n_rows = 1 + r.n_chain + r.n_siblings
        if n_rows >= len(r.v) - 1 or p_gain <= r.rate * (r.v[n_rows + 1] - r.v[n_rows]):
            return False
        r.n_siblings += 1
        return True

    def observe(self, outcome: RoundOutcome) -> None:
        """What a round did (RoundOutcome): its source, proposal and the draft's report, the
        tokens it produced, its verify time over its rows, and what prompt lookup offered."""
        proposal, report, new = outcome.proposal, outcome.report, outcome.new
        n_accepted = len(new) - 1
        self.n_left -= len(new)
        self._pay_for_trying(outcome)
        self.costs.observe_verify(outcome.rows, outcome.seconds, self._n_kv)
        if report.catch_up[0] >= 2:
            self.costs.observe_catch_up(*report.catch_up)
        self.draft_acceptance.age()
        self.lookup_hits *= self.draft_acceptance.mean_decay
        self.lookup_seen *= self.draft_acceptance.mean_decay
        if outcome.source == "draft" and proposal.tree is not None:
            self._observe_tree(proposal.tokens, proposal.tree, report.confidence, new)
        elif outcome.source == "draft":
            self.draft_acceptance.observe(report.confidence, n_accepted)
            if report.dropped is not None and outcome.greedy and n_accepted == len(proposal.tokens):
                token, confidence = report.dropped  # its position was reached: new[-1] is the target's
                self.draft_acceptance.judge(confidence, new[-1] == token, proposed=False)
        if outcome.offer:
            self._judge_offer(outcome.offer, new)
        # a lane plans the next round as if its pass held the others' rows again (plan() prices it)
        self._load = (outcome.n_other, outcome.n_lanes, outcome.n_cap)

    def load(self, n_other: int, n_lanes: int, n_cap: Optional[int]) -> None:
        """Plan the next rounds for a pass holding n_other rows of n_lanes - 1 other lanes beside
        this lane's (load-adaptive: drafts pay only while their rows are cheap beside the pass);
        n_cap: the rows of the pass it may plan for, the others' and its share. A lane's first round plans for the lanes
        generating as it starts: planned as if alone, every request arriving at a busy server
        drafted its first round and started the draft's prefill."""
        self._load = (n_other, n_lanes, n_cap)
        n_rows = self.limit + TREE_ROWS
        self._v = shared_pass_costs(self.costs.table(n_rows + n_other, self._n_kv), n_other, n_lanes, n_rows, n_cap)
        self._c_d = self.costs.draft_cost(n_lanes > 1, self._n_kv)

    def _pay_for_trying(self, outcome: RoundOutcome) -> None:
        """Rounds without the draft earn credit; a round that tried it again pays its modelled
        cost beyond what the best other source would take for its tokens (from the cost model,
        not the clock: with frozen costs a seed decides the same rounds every time)."""
        v = self._v
        rows = min(max(outcome.rows, 1), len(v) - 1)
        if self._trying:  # at least one draft step: the draft drafted before anything was decided
            # the whole catch-up, not lag_cost's share: it is spent whether or not the draft
            # serves the rounds after (a try every so many plain rounds would otherwise cost a
            # compute-bound target the draft's batch time of every token it decoded plainly)
            n_steps = max(1, len(outcome.report.confidence) + (outcome.report.dropped is not None))
            self._credit -= n_steps * self._c_d + self._catch_up(outcome.report.catch_up[0]) + v[rows] \
                - len(outcome.new) / self._rate_else
        elif outcome.source != "draft":
            self._credit += EXPLORE_SHARE * v[rows]

    def _judge_offer(self, offer: list[int], new: list[int]) -> None:
        """Lookup's offer, judged against what the round produced whoever proposed: free
        evidence, so lookup is weighed on its record even in rounds it was not chosen."""
        n_judged = 0
        for offered, produced in zip(offer, new):
            n_judged += 1
            if offered != produced:
                break
        i = min(self._match, 4)
        self.lookup_seen[i] += n_judged
        self.lookup_hits[i] += n_judged - (offer[n_judged - 1] != new[n_judged - 1])

    def _observe_tree(self, tokens: Sequence[int], tree: Tree, confidence: Sequence[float], new: list[int]) -> None:
        """Judge every node whose parent the round reached: kept if on the accepted path. The chain
        calibrates the draft's confidence and counts toward its mean; siblings calibrate their own."""
        on_path = {-1, *tree.path_of(tokens, new[:-1])}
        for i, (parent, c) in enumerate(zip(tree.parents, confidence)):
            if parent in on_path and c == c:  # reached, and drafted (lookup's have no confidence)
                if i in tree.first_children:
                    self.draft_acceptance.judge(c, i in on_path, proposed=True)
                else:
                    self.draft_acceptance.siblings.judge(c, i in on_path, proposed=False)

    def as_dict(self) -> dict:
        return {"kind": "auto", "width": self.width, "draft_model": self.has_draft, "lookup": self.lookup,
                "draft_acceptance": round(self.draft_acceptance.mean(), 3),
                "acceptance_by_confidence": self.draft_acceptance.as_dict(), **self.costs.as_dict()}


@dataclass
class _Round:
    k_max: int
    gain: list[float]  # gain[m]: expected accepted tokens among m more drafts, if all so far are
    v: list[float]  # v[n]: the target's cost to verify n tokens
    rate: float  # tokens per second rounds are expected to achieve
    p_all: float = 1.0  # chance every draft so far is accepted
    p_reach: float = 1.0  # chance the latest draft's position is reached
    n_chain: int = 0  # drafts kept so far
    n_siblings: int = 0  # tree nodes beside the chain: more verify rows
    t_last: Optional[float] = None
