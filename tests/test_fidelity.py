"""Fidelity levels, KV-length grouping, lazy measurement and the near-tie rule, on synthetic data."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specllama.errors import InvalidParameterError
from specllama.measuring.fidelity import (ASSUMED_REUSE_DIFF, MAX_VERIFY, ROUNDING_BOUND, BatchDiffs,
                                          DiffTable, Limits, ReuseTable, kv_group, kv_length, near_tie,
                                          parse_level)

# F16-like: float rounding at every size; Q4_K-like: bitwise to 3, then another kernel path
F16 = BatchDiffs(256, tuple([0.015] * (MAX_VERIFY - 1)), complete=True)
Q4 = BatchDiffs(256, (0.0, 0.0, 0.7), complete=False)
Q4_LONG = BatchDiffs(512, (0.59,), complete=False)


def test_levels_parse_with_true_and_false_kept_for_old_callers():
    assert parse_level("bitwise").bound == 0.0 and parse_level(True).name == "bitwise"
    assert parse_level("rounding").bound == ROUNDING_BOUND
    assert parse_level("off").bound == math.inf and parse_level(False).name == "off"
    assert parse_level(0.5).bound == 0.5 and str(parse_level(0.5)) == "bound 0.5"
    for bad in ("exactish", -1, math.nan, None, [0.1]):
        with pytest.raises(InvalidParameterError, match="exact"):
            parse_level(bad)


def test_kv_length_is_padded_to_256_and_grouped_by_doubling():
    assert [kv_length(n, 4096) for n in (1, 256, 257, 512, 513)] == [256, 256, 512, 512, 768]
    assert kv_length(300, 300) == 300  # never past the context
    assert [kv_group(n) for n in (256, 512, 768, 1024, 1280, 2048, 2304)] == [0, 1, 2, 2, 3, 3, 4]


def test_largest_batch_is_the_prefix_within_the_bound():
    assert F16.largest_batch(0.0) == 1 and F16.largest_batch(ROUNDING_BOUND) == MAX_VERIFY
    assert Q4.largest_batch(0.0) == 3 and Q4.largest_batch(ROUNDING_BOUND) == 3
    assert Q4.largest_batch(1.0) == 4  # measured up to 4 only: nothing unmeasured is allowed
    assert Q4_LONG.largest_batch(ROUNDING_BOUND) == 1


def test_a_partial_measurement_covers_only_bounds_it_ran_past():
    assert Q4.covers(0.0) and Q4.covers(0.5)
    assert not Q4.covers(1.0)  # 0.7 <= 1.0 and sizes past 4 were never measured
    assert BatchDiffs(256, (0.015,), complete=False).covers(0.0)
    assert not BatchDiffs(256, (0.015,), complete=False).covers(ROUNDING_BOUND)
    assert F16.covers(math.inf)


class Measured:
    """Stands in for what calibrate has cached (by KV group) and for the idle-work queue: records
    where a measurement was asked for."""

    def __init__(self, by_group):
        self.by_group, self.calls = by_group, []

    def cached(self, group):
        return self.by_group.get(group)

    def missing(self, n_past, bound=None):
        self.calls.append((n_past, bound))

    def table(self):
        return DiffTable(self.cached, self.missing, 4096)


def test_a_kv_group_not_measured_is_asked_for_and_decodes_plainly_meanwhile():
    measured = Measured({})
    table = measured.table()
    assert table.get(0, 0.0) is None and measured.calls == [(0, 0.0)]
    table.groups[0] = Q4  # the idle work ran
    assert table.get(100, 0.0) is Q4 and measured.calls == [(0, 0.0)]
    assert table.get(300, 0.0) is None and measured.calls[-1] == (300, 0.0)
    limits = Limits(parse_level("bitwise"), table)
    assert limits.max_batch(300) == 1 and any("KV <= 512" in w for w in limits.waiting)
    assert not limits.wants_check(300)  # bitwise assumes nothing


def test_a_kv_group_not_measured_takes_a_shorter_one_s_limit_where_the_level_allows_a_difference():
    measured = Measured({0: F16})
    limits = Limits(parse_level("rounding"), measured.table())
    assert limits.max_batch(300) == MAX_VERIFY and measured.calls == [(300, ROUNDING_BOUND)]  # still asked for
    assert any("KV <= 512" in w and "assumed" in w for w in limits.waiting)
    # the round that checks it judges near-ties as a reused cache's unmeasured rows are judged
    assert limits.wants_check(300) and limits.tolerance(300, 4) == 2 * ASSUMED_REUSE_DIFF
    limits.checked(300, 0.02)
    assert limits.tolerance(300, 4) == 2 * ROUNDING_BOUND  # the rest of the generation: no longer 1.0 off
    after = Limits(parse_level("rounding"), limits.table)
    assert not after.wants_check(300) and after.max_batch(300) == MAX_VERIFY
    assert after.tolerance(300, 4) == 2 * ROUNDING_BOUND  # as far off as the level allows
    assert after.tolerance(10, 1) == 2 * ROUNDING_BOUND  # and the drift stays
    assert Limits(parse_level("bitwise"), measured.table()).max_batch(300) == 1


def test_a_live_check_past_half_the_bound_ends_the_assumption_there_and_further_out():
    measured = Measured({0: Q4})
    limits = Limits(parse_level("rounding"), measured.table())
    assert limits.max_batch(300) == 3 and limits.max_batch(600) == 3
    limits.checked(300, 0.59)  # Q4_K rows on another path at KV 512
    assert limits.max_batch(300) == 1 and limits.max_batch(600) == 1 and limits.max_batch(10) == 3
    assert not limits.wants_check(600)
    limits.table.groups[1] = Q4_LONG  # the probe ran when idle: its measurement decides
    assert limits.max_batch(300) == 1 and limits.tolerance(300, 1) == 0.0


def test_what_is_cached_is_read_once_not_per_round():
    reads = []
    table = DiffTable(lambda group: reads.append(group), lambda n_past, bound: None, 4096)
    for n_past in (300, 301, 302):
        table.get(n_past, 0.0)
    assert reads == [1]


def test_a_probe_that_would_cross_a_padding_step_waits_for_the_next_group():
    measured = Measured({0: Q4})
    limits = Limits(parse_level("bitwise"), measured.table())
    assert limits.max_batch(500) == 1  # 12 cells left before 512: plain decoding meanwhile
    assert measured.calls == []
    assert limits.max_batch(520) == 1 and measured.calls == [(520, 0.0)]


def test_a_tighter_measurement_is_asked_again_for_a_looser_bound():
    first = BatchDiffs(256, (0.015,), complete=False)
    measured = Measured({0: first})
    table = measured.table()
    assert table.get(10, 0.0) is first and measured.calls == []
    assert table.get(10, ROUNDING_BOUND) is first and measured.calls == [(10, ROUNDING_BOUND)]


def test_limits_follow_the_level_and_never_cross_a_padding_step():
    measured = Measured({0: F16, 1: F16})
    bitwise = Limits(parse_level("bitwise"), measured.table())
    rounding = Limits(parse_level("rounding"), measured.table())
    off = Limits(parse_level("off"), measured.table())
    assert bitwise.max_batch(10) == 1
    assert rounding.max_batch(10) == MAX_VERIFY
    assert rounding.max_batch(250) == 6  # rows 250..255 stay at KV length 256
    assert off.max_batch(250) > 1000
    assert rounding.used == {"KV <= 256": MAX_VERIFY}


def test_tolerance_is_twice_the_difference_and_keeps_the_drift_of_earlier_batches():
    measured = Measured({0: F16})
    limits = Limits(parse_level("rounding"), measured.table())
    assert limits.tolerance(10, 1) == 0.0  # nothing batched yet: a plain row is the target's own
    limits.max_batch(10)
    assert limits.tolerance(10, 4) == pytest.approx(0.03)
    assert limits.tolerance(20, 1) == pytest.approx(0.03)  # its KV came from that batch
    assert math.isnan(Limits(parse_level("off"), measured.table()).tolerance(10, 4))


def test_a_reuse_difference_not_measured_is_assumed_large_and_asked_for():
    """Near-ties on a reused cache are over-counted until the difference is measured, never
    missed."""
    asked = []
    reuse = ReuseTable(lambda group: {1: 0.4}.get(group), asked.append, 4096)
    limits = Limits(parse_level("rounding"), Measured({0: F16, 1: F16}).table())
    limits.reuse = reuse
    assert limits.tolerance(10, 1) == pytest.approx(2 * ASSUMED_REUSE_DIFF) and asked == [10]
    assert limits.tolerance(300, 1) == pytest.approx(2 * 0.4)  # measured there
    limits.reach(20)
    assert any("assumed" in w for w in limits.waiting) and not reuse.known(20) and reuse.known(300)


def test_near_tie_rule_on_synthetic_rows():
    row = np.array([1.0, 5.0, 4.95, -3.0], dtype=np.float32)
    assert near_tie(row, 0.1) and not near_tie(row, 0.04)
    assert not near_tie(row, 0.0)  # bitwise: no difference, nothing can flip
    assert not near_tie(np.array([0.0, 9.0, 1.0], dtype=np.float32), 2.0)


def test_a_flip_under_a_bounded_difference_is_always_a_near_tie():
    """If no logit moves by more than d, the greedy choice can only change where the top two
    were within 2d: the rule must catch every flip, and flag few rows that cannot flip."""
    rng = np.random.default_rng(0)
    d, n_flips, n_flagged = 0.05, 0, 0
    for _ in range(3000):
        row = rng.normal(size=64).astype(np.float32) * 3
        moved = row + rng.uniform(-d, d, size=64).astype(np.float32)
        flagged = near_tie(row, 2 * d)
        n_flagged += flagged
        if np.argmax(moved) != np.argmax(row):
            n_flips += 1
            assert flagged
    assert n_flips > 5, "the synthetic rows never flipped, so the rule was not tested"
    assert n_flagged < 400
