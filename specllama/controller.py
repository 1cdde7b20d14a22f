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
paid more. A drafted token is dropped when its chance to add a token is not worth its row in
the verify pass: P_i < R * (v(i + 1) - v(i)).

Costs are learned online (OnlineCosts): every round times its verify pass and every draft
step, and robust running estimates correct the calibration they start from, so a noisy or
stale calibration cannot keep speculation on where it loses.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np


@dataclass(frozen=True)
class Costs:
    """Measured seconds: verify[n - 1] for a target pass over n tokens; draft per token."""

    verify: tuple[float, ...]
    draft_token: float

    def v(self, n: int) -> float:
        if n <= len(self.verify):
            return self.verify[n - 1]
        slope = self.verify[-1] - self.verify[-2] if len(self.verify) > 1 else self.verify[-1]
        return self.verify[-1] + slope * (n - len(self.verify))


MIN_RATIO = 0.05  # the least measured/calibrated ratio a fit may give
# v(n) is tabulated this far past the longest draft: a tree's siblings add rows to a round
TREE_ROWS = 18


class OnlineCosts:
    """Running estimates of v(n) and the draft's cost per token, starting from a calibration.

    The calibrated curve (made non-decreasing) gives v(n)'s shape; what rounds measure scales
    it. Sizes 2 and up share one robust straight line through the ratios measured/calibrated
    (Theil-Sen, over the last rounds): one pass here scatters 15% from the next, so a per-size
    median makes neighbouring sizes look 30 ms apart and cuts drafts short, while a line
    through every size keeps the increments, which decide how far to draft, smooth. v(1), the
    figure every choice is weighed against, is measured by the occasional plain round, relative
    to the line's level at the time: the machine's load moves the whole curve, so v(1) follows
    it between plain rounds instead of going stale. The draft cost is the median of the last
    measured steps. frozen=True keeps the calibration (seeded sampling: the same seed must
    give the same text, so no timing may steer the rounds).
    """

    def __init__(self, seed: Costs, *, window: int = 9, frozen: bool = False, refresh: int = 64):
        self.seed, self.frozen, self.refresh = seed, frozen, refresh
        # the calibrated curve's shape, non-decreasing: a pass over more tokens never costs less
        self._shape = Costs(tuple(np.maximum.accumulate(seed.verify).tolist()), seed.draft_token)
        self._one: deque = deque(maxlen=window)  # [measured / calibrated v(1), the line's level then]
        self._batches: deque = deque(maxlen=4 * window)  # (n, measured / calibrated v(n)), n >= 2
        self._draft: deque = deque(maxlen=window)
        self._catch_up: deque = deque(maxlen=window)  # the draft's seconds per token in a batch
        self._last_one = 0  # n_observed when v(1) was last measured
        self._line: Optional[tuple[float, float, int, int]] = None  # cached fit
        self.n_observed = 0

    def observe_verify(self, n: int, seconds: float) -> None:
        if self.frozen or seconds <= 0:
            return
        ratio = seconds / self._shape.v(n)
        self.n_observed += 1
        if n == 1:
            self._one.append([ratio, self._level() if len(self._batches) >= 3 else None])
            self._last_one = self.n_observed
        else:
            self._batches.append((n, ratio))
            self._line = None
            unplaced = [measured for measured in self._one if measured[1] is None]
            if unplaced and len(self._batches) >= 3:
                level = self._level()  # plain rounds before any line: the first level after
                for measured in unplaced:
                    measured[1] = level

    def wants(self, n: int) -> bool:
        """Whether v(1) has too few recent measurements to trust (never when frozen)."""
        if self.frozen or n != 1:
            return False
        return len(self._one) < 3 or self.n_observed - self._last_one > self.refresh

    def observe_draft_step(self, seconds: float) -> None:
        if not self.frozen and seconds > 0:
            self._draft.append(seconds)

    def observe_catch_up(self, n_tokens: int, seconds: float) -> None:
        """The draft decoded n_tokens at once (its prefill, or catching up) in seconds."""
        if not self.frozen and n_tokens >= 2 and seconds > 0:
            self._catch_up.append(seconds / n_tokens)

    @property
    def catch_up_token(self) -> float:
        """The draft's seconds per token decoded in a batch; a single token's cost until measured
        (no less: a catch-up assumed cheap would send rounds to the draft that lookup serves)."""
        return statistics.median(self._catch_up) if self._catch_up else self.draft_token

    def _fit(self) -> tuple[float, float, int, int]:
        """(intercept, slope, n_lo, n_hi) of the ratio line over measured sizes n_lo..n_hi."""
        if self._line is None:
            if not self._batches:
                overall = statistics.median(r for r, _ in self._one) if self._one else 1.0
                self._line = (overall, 0.0, 2, 2)
            else:
                n, r = np.array(self._batches, dtype=float).T
                i, j = np.triu_indices(len(n), 1)
                distinct = n[i] != n[j]
                slope = float(np.median((r[j] - r[i])[distinct] / (n[j] - n[i])[distinct])) if distinct.any() else 0.0
                self._line = (float(np.median(r - slope * n)), slope, int(n.min()), int(n.max()))
        return self._line

    def _ratio(self, n: int) -> float:
        if n == 1 and len(self._one) >= 3:
            if all(level for _, level in self._one):
                return statistics.median(r / level for r, level in self._one) * self._level()
            return statistics.median(r for r, _ in self._one)
        intercept, slope, n_lo, n_hi = self._fit()
        # no extrapolating the trend; and however wild the rounds, no cost at or below zero
        return max(intercept + slope * min(max(n, n_lo), n_hi), MIN_RATIO)

    def _level(self) -> float:
        return self._ratio(2)

    def v(self, n: int) -> float:
        return float(self.table(n)[n])

    @property
    def draft_token(self) -> float:
        return statistics.median(self._draft) if len(self._draft) >= 3 else self.seed.draft_token

    def table(self, n_max: int) -> np.ndarray:
        """[0, v(1), ..., v(n_max)]"""
        v = np.array([self._shape.v(n) * self._ratio(n) for n in range(1, n_max + 1)])
        v[1:] = np.maximum.accumulate(v[1:])  # more tokens never cost less
        return np.concatenate(([0.0], v))

    def as_dict(self) -> dict:
        v = self.table(16)
        return {"v_ms": {n: round(float(v[n]) * 1000, 2) for n in (1, 2, 3, 4, 6, 8, 12, 16)},
                "draft_token_ms": round(self.draft_token * 1000, 2),
                "draft_catch_up_token_ms": round(self.catch_up_token * 1000, 3), "n_observed": self.n_observed,
                "frozen": self.frozen}


def draft_can_pay(costs: OnlineCosts, k_max: int) -> bool:
    """Whether a draft that is always right would beat plain decoding at some length <= k_max."""
    ks = np.arange(1, k_max + 1)
    v = costs.table(k_max + 1)
    return k_max > 0 and bool(np.max((ks + 1) / (ks * costs.draft_token + v[ks + 1])) > 1.0 / v[1])


N_EXPLORE = 8  # judged drafts before the controller trusts a pair's acceptance over optimism

# Edges of the draft-confidence bins (the draft's probability of the token it proposes).
CONFIDENCE_EDGES = [0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98]
_BIN_PRIOR = np.array([0.15, 0.4, 0.6, 0.75, 0.85, 0.92, 0.96, 0.99])  # ~ a calibrated draft
# a tree's sibling (the draft's second or third choice) is picked less often than a first
# choice of the same confidence: the target mostly agrees with the draft's first
_SIBLING_PRIOR = np.array([0.05, 0.15, 0.3, 0.45, 0.55, 0.65, 0.75, 0.85])


class Acceptance:
    """P(target accepts a drafted token | the draft's confidence in it), learned as it goes,
    and the mean acceptance of this text's drafts.

    How confidence maps to acceptance is a property of the draft/target pair more than of the
    text (on our code, prose, edit and JSON runs every token drafted with confidence >= 0.9 was
    accepted), so one Acceptance serves a model pair's generations: its bins decay slowly,
    and new_text() keeps them. A bin with little data leans on a prior near its confidence,
    and the predictions are kept non-decreasing in confidence (pool adjacent violators): a few
    unlucky rejections in one bin must not rank it below a less confident one. The mean
    follows the text: it decays faster, and new_text() shrinks it to a weak prior.
    """

    def __init__(self, decay: float = 0.98, mean_decay: float = 0.95, prior_weight: float = 2.0,
                 prior: Optional[np.ndarray] = None):
        self.decay, self.mean_decay, self.w = decay, mean_decay, prior_weight
        self.prior = _BIN_PRIOR if prior is None else prior
        self.hits = np.zeros(len(_BIN_PRIOR))
        self.seen = np.zeros(len(_BIN_PRIOR))
        self.mean_hits, self.mean_seen = 0.0, 0.0
        self.n_judged = 0  # drafts ever judged (never decays: whether the pair has been tried)
        self._table: Optional[np.ndarray] = None  # the monotone predictions, per bin
        self._siblings: Optional["Acceptance"] = None

    @property
    def siblings(self) -> "Acceptance":
        """The same calibration for the draft's next-best tokens a tree verifies beside its own."""
        if self._siblings is None:
            self._siblings = Acceptance(self.decay, self.mean_decay, self.w, prior=_SIBLING_PRIOR)
        return self._siblings

    def predict(self, confidence: float) -> float:
        if self._table is None:
            self._table = _non_decreasing((self.hits + self.prior * self.w) / (self.seen + self.w),
                                          self.seen + self.w)
        return float(self._table[bisect.bisect_right(CONFIDENCE_EDGES, confidence)])

    def mean(self, prior: float = 0.6) -> float:
        """Acceptance of the tokens that were drafted lately, whatever their confidence."""
        return (self.mean_hits + prior * self.w) / (self.mean_seen + self.w)

    def as_dict(self) -> dict:
        """The predicted acceptance from each confidence edge up, with the tokens behind it."""
        return {f">={edge}": [round(self.predict(edge), 3), round(float(seen), 1)]
                for edge, seen in zip([0.0, *CONFIDENCE_EDGES], self.seen)}

    def new_text(self) -> None:
        """A new generation: the last text's mean acceptance stays only as a prior worth w tokens."""
        if self.mean_seen > self.w:
            self.mean_hits *= self.w / self.mean_seen
            self.mean_seen = self.w

    def age(self) -> None:
        if self._siblings is not None:
            self._siblings.age()
        self.hits *= self.decay
        self.seen *= self.decay
        self.mean_hits *= self.mean_decay
        self.mean_seen *= self.mean_decay
        self._table = None

    def observe(self, confidences: Sequence[float], n_accepted: int) -> None:
        """A round's drafts with their confidences; the target judged up to the first rejection."""
        n_judged = min(len(confidences), n_accepted + 1)
        for i, c in enumerate(confidences[:n_judged]):
            self.judge(c, i < n_accepted, proposed=True)

    def judge(self, confidence: float, accepted: bool, *, proposed: bool) -> None:
        """One judged draft token. A token the draft dropped (not proposed) but whose position
        the round reached is judged too, against the target's own token there: without it the
        low-confidence bins would never learn, since low confidence is where drafting stops."""
        b = bisect.bisect_right(CONFIDENCE_EDGES, confidence)
        self.n_judged += 1
        self.seen[b] += 1
        self.hits[b] += accepted
        self._table = None
        if proposed:
            self.mean_seen += 1
            self.mean_hits += accepted


def _non_decreasing(y: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-decreasing fit to y (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, n_bins]
    for y_i, w_i in zip(y.tolist(), weight.tolist()):
        blocks.append([y_i, w_i, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.repeat([m for m, _, _ in blocks], [n for _, _, n in blocks])


class FixedDraft:
    """Always draft k tokens from the draft model (or fewer when the context or the fidelity
    limit says so); prompt lookup goes first on long matches only when asked to. width > 1
    verifies a tree: width - 1 of the draft's next-best tokens beside each drafted one."""

    def __init__(self, k: int, *, has_draft: bool = True, lookup: bool = False, width: int = 1):
        self.limit, self.width = k, width
        self.has_draft, self.lookup = has_draft, lookup

    def plan(self, k_cap: int, n_match: int, n_lookup: int, lag: tuple[int, bool] = (0, False)) -> tuple[str, int]:
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

    def observe(self, source: str, proposal: Any, new: list[int], t_verify: float, offer: list[int],
                greedy: bool, n_verify: Optional[int] = None) -> None:
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
        self.n_left = n_tokens
        self.has_draft, self.lookup = has_draft, lookup
        self.draft_acceptance = acceptance if acceptance is not None else Acceptance()
        self.draft_acceptance.new_text()
        self.lookup_hits = np.zeros(5)  # by match length 2, 3, 4+ (index = min(n, 4))
        self.lookup_seen = np.zeros(5)
        self._v = costs.table(limit + TREE_ROWS)
        self._c_d = costs.draft_token
        self._round: Optional[_Round] = None
        self._match = 0  # n-gram length behind this round's lookup proposal

    def _best_draft_rate(self, alpha: float, k_max: int, c_d: Optional[float] = None,
                         extra: float = 0.0) -> tuple[float, int]:
        if k_max <= 0:
            return 0.0, 0
        ks = np.arange(1, k_max + 1)
        expected = 1.0 + np.cumsum(alpha ** ks)
        rates = expected / (ks * (self._c_d if c_d is None else c_d) + self._v[ks + 1] + extra)
        best = int(np.argmax(rates))
        return float(rates[best]), best + 1

    def lookup_alpha(self, n_match: int) -> float:
        i = min(n_match, 4)
        return float((self.lookup_hits[i] + 0.5 * 2.0) / (self.lookup_seen[i] + 2.0))

    def lag_cost(self, n_lag: int, prefill: bool) -> float:
        """Seconds of draft decoding a draft round must pay before its first draft, beyond the
        one token every round feeds it: catching up with tokens other sources proposed, in
        full; its prefill, spread over the tokens the generation may still produce (a
        one-time cost, worth paying where the draft will serve many rounds)."""
        seconds = max(0, n_lag - 1) * self.costs.catch_up_token
        if prefill:
            seconds *= (1.0 + self.draft_acceptance.mean()) / max(self.n_left, 1)
        return seconds

    def plan(self, k_cap: int, n_match: int, n_lookup: int, lag: tuple[int, bool] = (0, False)) -> tuple[str, int]:
        """The source ("none", "draft", "lookup") and most tokens to draft this round; lag is
        the draft's (tokens to decode before drafting, whether its prefill is among them)."""
        k_cap = min(k_cap, self.limit)
        self._round, self._match = None, n_match
        best, choice = 1.0 / self._v[1], ("none", 0)
        if k_cap <= 0 or self.costs.wants(1):
            # a plain round now and then keeps v(1), the figure every choice is weighed
            # against, measured: a stale one could keep speculation on where it loses
            return choice
        if self.has_draft:
            # optimistic while the pair has judged few drafts (a prior of 1 worth w tokens): a
            # draft never tried is never learned (a pessimistic start kept a fresh load plain
            # through whole generations of code it drafts at 80%), and one round finds out
            untried = self.draft_acceptance.n_judged < N_EXPLORE
            alpha = self.draft_acceptance.mean(prior=1.0 if untried else 0.6)
            rate, _ = self._best_draft_rate(alpha, k_cap, extra=self.lag_cost(*lag))
            if rate > best:
                best, choice = rate, ("draft", k_cap)
        if self.lookup and n_lookup:
            rate, k = self._best_draft_rate(self.lookup_alpha(n_match), min(k_cap, n_lookup), c_d=0.0)
            if rate > best:
                best, choice = rate, ("lookup", k)
        if choice[0] == "draft":
            alpha = self.draft_acceptance.mean()
            gain = [0.0]
            for m in range(1, choice[1] + 1):
                gain.append(gain[-1] + alpha ** m)  # expected extra tokens from m more drafts
            self._round = _Round(choice[1], gain, self._v.tolist(), best)
        return choice

    def draft_more(self, confidences: list[float]) -> str:
        """After the draft chose x_i with the given confidence: "more" (decode it and draft
        another), "stop" (propose x_1..x_i) or "drop" (propose x_1..x_{i-1})."""
        r, now = self._round, self.clock()
        if r is None:
            return "more"
        if r.t_last is not None:
            self.costs.observe_draft_step(now - r.t_last)  # one draft decode since the last call
        r.t_last = now
        # x_i's row comes after the root, x_1..x_{i-1} and the siblings verified beside them
        i, v, c_d = len(confidences) + r.n_siblings, r.v, self._c_d
        p_all = r.p_all * self.draft_acceptance.predict(confidences[-1])
        # x_i's draft step is spent either way; keeping it costs its row in the verify pass
        if p_all < r.rate * (v[i + 1] - v[i]):
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
        n_rows = 1 + r.n_chain + r.n_siblings
        if n_rows >= len(r.v) - 1 or p_gain <= r.rate * (r.v[n_rows + 1] - r.v[n_rows]):
            return False
        r.n_siblings += 1
        return True

    def observe(self, source: str, proposal: Any, new: list[int], t_verify: float, offer: list[int],
                greedy: bool, n_verify: Optional[int] = None) -> None:
        """What a round did: its source and proposal (tokens, confidences, a dropped token),
        the tokens it produced (accepted drafts, then the target's own), its verify time (of
        n_verify rows: more than the proposal's when forced tokens came first), and what prompt
        lookup offered at its start."""
        n_drafted = len(proposal.tokens)
        n_accepted = len(new) - 1
        self.n_left -= len(new)
        self.costs.observe_verify(n_verify or n_drafted + 1, t_verify)
        if getattr(proposal, "catch_up", (0, 0.0))[0] >= 2:
            self.costs.observe_catch_up(*proposal.catch_up)
        self.draft_acceptance.age()
        self.lookup_hits *= self.draft_acceptance.mean_decay
        self.lookup_seen *= self.draft_acceptance.mean_decay
        if source == "draft" and getattr(proposal, "parents", None) is not None:
            self._observe_tree(proposal, new)
        elif source == "draft":
            self.draft_acceptance.observe(proposal.confidence, n_accepted)
            if proposal.dropped is not None and greedy and n_accepted == n_drafted:
                token, confidence = proposal.dropped  # its position was reached: new[-1] is the target's
                self.draft_acceptance.judge(confidence, new[-1] == token, proposed=False)
        if offer:
            # lookup's offer, judged against what the round produced whoever proposed: free
            # evidence, so lookup is weighed on its record even in rounds it was not chosen
            n_judged = 0
            for offered, produced in zip(offer, new):
                n_judged += 1
                if offered != produced:
                    break
            i = min(self._match, 4)
            self.lookup_seen[i] += n_judged
            self.lookup_hits[i] += n_judged - (offer[n_judged - 1] != new[n_judged - 1])
        self._v = self.costs.table(self.limit + TREE_ROWS)
        self._c_d = self.costs.draft_token

    def _observe_tree(self, proposal: Any, new: list[int]) -> None:
        """Judge every node whose parent the round reached: kept if on the accepted path. The
        draft's chain calibrates its confidence and counts toward its mean acceptance;
        siblings calibrate their own."""
        node, on_path, first = -1, {-1}, {}
        for i, parent in enumerate(proposal.parents):
            first.setdefault(parent, i)
        for token in new[:-1]:
            node = next(i for i, (t, p) in enumerate(zip(proposal.tokens, proposal.parents)) if p == node and t == token)
            on_path.add(node)
        for i, (parent, c) in enumerate(zip(proposal.parents, proposal.confidence)):
            if parent in on_path and c == c:  # reached, and drafted (lookup's have no confidence)
                if first[parent] == i:
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
