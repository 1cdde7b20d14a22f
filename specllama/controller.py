"""How far to draft each round: fixed, or chosen from measured costs and observed acceptance.

Speculation pays when (expected tokens per round) / (round time) beats one plain target step.
With k drafted tokens, alpha_i the chance position i is accepted given 1..i-1 were, c_d the
draft's cost per token and v(n) the target's cost to decode n tokens at once:

    E[tokens | k] = 1 + sum_{j=1..k} prod_{i=1..j} alpha_i      T(k) = k * c_d + v(k + 1)

AdaptiveDraft picks argmax_k E/T every round (k = 0 is plain decoding), keeps decayed
acceptance counts per position, and while speculation is off it drafts one token every
`probe_every` rounds so it notices when the text becomes predictable.
"""

from __future__ import annotations

from dataclasses import dataclass

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


class FixedDraft:
    """Always draft k tokens (or fewer when the context or the exact-mode cap says so)."""

    early_stop = 0.0
    hopeless = False

    def __init__(self, k: int):
        self.limit = k

    def choose(self, k_max: int) -> int:
        return min(self.limit, k_max)

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        pass


PROBE_ALPHA = 0.9


class AdaptiveDraft:
    """Choose the draft length with the best expected tokens per second, round by round."""

    def __init__(self, costs: Costs, k_limit: int, *, decay: float = 0.95, prior: float = 0.7,
                 prior_weight: float = 2.0, probe_every: int = 8, early_stop: float = 0.4):
        self.costs = costs
        self.limit = k_limit
        self.decay = decay
        self.prior, self.prior_weight = prior, prior_weight
        self.probe_every = probe_every
        self.early_stop = early_stop  # the proposer stops when its own top probability falls below
        self.reached = np.zeros(k_limit)
        self.accepted = np.zeros(k_limit)
        self.n_plain_rounds = 0
        # even if every draft were accepted, would any length beat plain decoding?
        ks = np.arange(1, k_limit + 1)
        best_case = (ks + 1) / (ks * costs.draft_token + np.array([costs.v(k + 1) for k in ks]))
        self.hopeless = k_limit == 0 or best_case.max() <= 1.0 / costs.v(1)

    def alpha(self) -> np.ndarray:
        """Estimated acceptance of position i given 1..i-1 were accepted.

        Each position's prior is the estimate of the position before it, so what the first
        positions teach carries to deeper ones that are rarely reached.
        """
        w = self.prior_weight
        out = np.empty(self.limit)
        prior = self.prior
        for i in range(self.limit):
            out[i] = prior = (self.accepted[i] + prior * w) / (self.reached[i] + w)
        return out

    def expected_rates(self, k_max: int, alpha: np.ndarray | None = None) -> np.ndarray:
        """E[tokens per round] / T(round) for k = 0..k_max."""
        alpha = self.alpha() if alpha is None else alpha
        reach = np.concatenate(([1.0], np.cumprod(alpha[:k_max])))  # reach[j] = prod_{i<=j} alpha_i
        expected = np.cumsum(reach)  # expected[k] = 1 + sum_{j=1..k} reach[j]
        ks = np.arange(k_max + 1)
        times = ks * self.costs.draft_token + np.array([self.costs.v(k + 1) for k in ks])
        return expected / times

    def choose(self, k_max: int) -> int:
        k_max = min(k_max, self.limit)
        if k_max <= 0 or self.hopeless:
            return 0
        k = int(np.argmax(self.expected_rates(k_max)))
        if k == 0:
            self.n_plain_rounds += 1
            if self.n_plain_rounds % self.probe_every == 0:
                # probe at the length that would pay if the text turned predictable
                return max(1, int(np.argmax(self.expected_rates(k_max, np.full(k_max, PROBE_ALPHA)))))
        return k

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        self.reached *= self.decay
        self.accepted *= self.decay
        n_reached = min(n_drafted, n_accepted + 1)  # positions the target actually judged
        self.reached[:n_reached] += 1
        self.accepted[:n_accepted] += 1
