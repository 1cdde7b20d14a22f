"""P(target accepts a drafted token | the draft's confidence in it), learned per model pair."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Optional

import numpy as np


N_EXPLORE = 8  # judged drafts before the controller trusts a pair's acceptance over optimism
MEAN_PRIOR = 0.6  # a pair's acceptance before any of its drafts was judged
LONG_RUN_DECAY = 0.995  # per judged draft: the pair's long-run acceptance spans a few hundred
LONG_RUN_WEIGHT = 2.0  # drafts' worth of MEAN_PRIOR in it (N_EXPLORE drafts are judged before it is trusted)
# standard errors of the pair's record a plan may hope for: the record is renewed only by
# drafting, so a record that reads low by chance must not keep the draft off for good
RECORD_HOPE = 1.5

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
    follows the text: it decays faster, and new_text() shrinks it to a weak prior. That prior
    is the pair's own long-run acceptance (its last few hundred judged drafts), not a fixed
    figure: a rejection or two at the start of a text, or a stretch of plain rounds (which
    judge no drafts, so the mean sinks back to its prior), must not stand for a pair that
    drafts this kind of text at 90%.
    """

    def __init__(self, decay: float = 0.98, mean_decay: float = 0.95, prior_weight: float = 2.0,
                 prior: Optional[np.ndarray] = None):
        self.decay, self.mean_decay, self.w = decay, mean_decay, prior_weight
        self.prior = _BIN_PRIOR if prior is None else prior
        self.hits = np.zeros(len(_BIN_PRIOR))
        self.seen = np.zeros(len(_BIN_PRIOR))
        self.mean_hits, self.mean_seen = 0.0, 0.0
        self.long_hits, self.long_seen = 0.0, 0.0  # every proposed draft, decaying per judged draft
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

    def mean(self, prior: Optional[float] = None) -> float:
        """Acceptance of the tokens that were drafted lately, whatever their confidence; prior:
        what it leans on while few were (default: the pair's long-run acceptance)."""
        return _leaning(self.mean_hits, self.mean_seen, self.long_run() if prior is None else prior, self.w)

    def long_run(self) -> float:
        """Acceptance of the pair's last few hundred proposed drafts (0.6 before any)."""
        return (self.long_hits + MEAN_PRIOR * LONG_RUN_WEIGHT) / (self.long_seen + LONG_RUN_WEIGHT)

    def hoped_mean(self) -> float:
        """mean() plus RECORD_HOPE standard errors, counting the pair's judged drafts (not the
        prior's weight): what a plan may hope a draft round brings. Greedy on the estimate,
        a plan is stuck with an unlucky start, since only drafting renews it: at 3,000 tokens
        of KV on our CPU the F16 target breaks even at about 0.8, the pair drafts the chat's
        answers at 0.86, and a start of 5 accepted of 7 kept whole answers plain. The hope
        shrinks as drafts are judged (at 0.8: 0.19 after 8, 0.06 after 100, 0.04 at the decayed
        count's ceiling of 200), so a draft that really loses stops after a few dozen of them."""
        return _hoped(self.mean(), self.long_seen)

    def as_dict(self) -> dict:
        """The predicted acceptance from each confidence edge up, with the tokens behind it."""
        return {f">={edge}": [round(self.predict(edge), 3), round(float(seen), 1)]
                for edge, seen in zip([0.0, *CONFIDENCE_EDGES], self.seen)}

    def record(self) -> dict:
        """What a later process may start from: the confidence calibration and the long-run
        acceptance; not the text's mean, nor how many drafts this process judged (a new process
        still tries the draft optimistically before trusting any record)."""
        return {"hits": self.hits.tolist(), "seen": self.seen.tolist(), "long": [self.long_hits, self.long_seen],
                "siblings": None if self._siblings is None else self._siblings.record()}

    @classmethod
    def from_record(cls, record: Optional[dict], prior: Optional[np.ndarray] = None) -> "Acceptance":
        """An Acceptance starting from record() (a fresh one where it is missing or malformed)."""
        acc = cls(prior=prior)
        if not isinstance(record, dict):
            return acc
        try:
            hits = np.asarray(record["hits"], dtype=np.float64)
            seen = np.asarray(record["seen"], dtype=np.float64)
            long_hits, long_seen = (float(x) for x in record["long"])
        except (TypeError, KeyError, ValueError):
            return acc
        values = np.concatenate([hits, seen, [long_hits, long_seen]])
        if hits.shape != acc.hits.shape or seen.shape != acc.seen.shape or not np.all(np.isfinite(values)) \
                or np.any(values < 0) or bool(np.any(np.greater(hits, seen))) or long_hits > long_seen:
            return acc
        acc.hits, acc.seen, acc.long_hits, acc.long_seen = hits, seen, long_hits, long_seen
        if record.get("siblings") is not None:
            acc._siblings = cls.from_record(record["siblings"], prior=_SIBLING_PRIOR)
        return acc

    def new_text(self) -> None:
        """A new generation: the last text's mean acceptance stays only as a prior worth w tokens."""
        self.mean_hits, self.mean_seen = _shrunk(self.mean_hits, self.mean_seen, self.w)

    def age(self) -> None:
        self.age_calibration()
        self.mean_hits *= self.mean_decay
        self.mean_seen *= self.mean_decay

    def age_calibration(self) -> None:
        """The confidence bins' decay, per round of any generation of the pair."""
        if self._siblings is not None:
            self._siblings.age()
        self.hits *= self.decay
        self.seen *= self.decay
        self._table = None

    def observe(self, confidences: Sequence[float], n_accepted: int) -> None:
        """A round's drafts with their confidences; the target judged up to the first rejection."""
        for c, accepted in _judged(confidences, n_accepted):
            self.judge(c, accepted, proposed=True)

    def judge(self, confidence: float, accepted: bool, *, proposed: bool, text: bool = True) -> None:
        """One judged draft token. A token the draft dropped (not proposed) but whose position
        the round reached is judged too, against the target's own token there: without it the
        low-confidence bins would never learn, since low confidence is where drafting stops.
        text=False: a TextAcceptance keeps the text's mean itself."""
        b = bisect.bisect_right(CONFIDENCE_EDGES, confidence)
        self.n_judged += 1
        self.seen[b] += 1
        self.hits[b] += accepted
        self._table = None
        if proposed:
            if text:
                self.mean_seen += 1
                self.mean_hits += accepted
            self.long_seen = self.long_seen * LONG_RUN_DECAY + 1
            self.long_hits = self.long_hits * LONG_RUN_DECAY + accepted


class TextAcceptance:
    """One generation's view of its pair's Acceptance. The confidence calibration, the long-run
    record and the count of judged drafts are the pair's, learned from every generation,
    concurrent ones included; the mean acceptance of the text's drafts is this generation's
    own. Shared, a request beside others planned from their texts' drafts (one lane's prose
    rejections sank another's code mean) and every lane's start weakened the others' means.
    A generation starts from the pair's last text's mean as a prior worth w tokens, as a
    chat's next turn did before, and leaves its own there for the next."""

    def __init__(self, pair: Acceptance):
        self.pair, self.w, self.mean_decay = pair, pair.w, pair.mean_decay
        self.mean_hits, self.mean_seen = _shrunk(pair.mean_hits, pair.mean_seen, self.w)

    @property
    def n_judged(self) -> int:
        return self.pair.n_judged

    @property
    def siblings(self) -> Acceptance:
        return self.pair.siblings

    def predict(self, confidence: float) -> float:
        return self.pair.predict(confidence)

    def long_run(self) -> float:
        return self.pair.long_run()

    def mean(self, prior: Optional[float] = None) -> float:
        """This text's acceptance, leaning on prior (default: the pair's long run) while few
        of its drafts were judged."""
        return _leaning(self.mean_hits, self.mean_seen, self.pair.long_run() if prior is None else prior, self.w)

    def hoped_mean(self) -> float:
        """Acceptance.hoped_mean() on this text's mean: the standard error counts the pair's record."""
        return _hoped(self.mean(), self.pair.long_seen)

    def as_dict(self) -> dict:
        return self.pair.as_dict()

    def age(self) -> None:
        """A round went by: the pair's calibration and this text's mean decay."""
        self.pair.age_calibration()
        self.mean_hits *= self.mean_decay
        self.mean_seen *= self.mean_decay
        self._leave()

    def observe(self, confidences: Sequence[float], n_accepted: int) -> None:
        for c, accepted in _judged(confidences, n_accepted):
            self.judge(c, accepted, proposed=True)

    def judge(self, confidence: float, accepted: bool, *, proposed: bool) -> None:
        self.pair.judge(confidence, accepted, proposed=proposed, text=False)
        if proposed:
            self.mean_seen += 1
            self.mean_hits += accepted
            self._leave()

    def _leave(self) -> None:
        """This text's mean as the pair's last (what the next generation starts from)."""
        self.pair.mean_hits, self.pair.mean_seen = self.mean_hits, self.mean_seen


def _judged(confidences: Sequence[float], n_accepted: int) -> list[tuple[float, bool]]:
    """A round's drafts the target judged (up to its first rejection), each with its verdict."""
    return [(c, i < n_accepted) for i, c in enumerate(confidences[:min(len(confidences), n_accepted + 1)])]


def _leaning(hits: float, seen: float, prior: float, w: float) -> float:
    """hits / seen, leaning on prior with the weight of w tokens."""
    return (hits + prior * w) / (seen + w)


def _hoped(p: float, long_seen: float) -> float:
    """p plus RECORD_HOPE standard errors, counting long_seen judged drafts."""
    return min(1.0, p + RECORD_HOPE * math.sqrt(p * (1.0 - p) / (long_seen + 2.0)))


def _shrunk(hits: float, seen: float, w: float) -> tuple[float, float]:
    """A mean's counts shrunk to at most w tokens' worth (the last text's, for a new one)."""
    return (hits * w / seen, w) if seen > w else (hits, seen)


def _non_decreasing(y: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-decreasing fit to y (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, n_bins]
    for y_i, w_i in zip(y.tolist(), weight.tolist()):
        blocks.append([y_i, w_i, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.repeat([m for m, _, _ in blocks], [int(n) for _, _, n in blocks])
