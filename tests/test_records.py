"""Cost curves that check themselves, on synthetic curves shaped like what a busy machine wrote."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from conftest import spinning_on_every_core
from specllama.measuring import records

QUIET = [0.035 + 0.008 * (n - 1) for n in range(1, 18)]  # a Q4_K_M 1.5B on 2 quiet cores


def test_a_quiet_curve_checks_out():
    assert records.costs_problem(QUIET, 0.012, [0.035, 0.036, 0.034], [0.012, 0.0125, 0.012]) is None


def test_repeats_that_disagree_say_the_machine_was_busy():
    why = records.costs_problem(QUIET, 0.012, [0.035, 0.978, 0.9])
    assert why is not None and "varied" in why
    assert "draft" in records.costs_problem(QUIET, 0.012, [0.035] * 3, [0.012, 3.2, 0.03])


def test_a_draft_batch_cheaper_than_one_step_or_dearer_than_its_steps_is_refused():
    assert records.costs_problem(QUIET, 0.012, draft_batch=[64, 0.2]) is None
    for seconds in (0.010, 64 * 0.012):
        why = records.costs_problem(QUIET, 0.012, draft_batch=[64, seconds])
        assert why is not None and "64 tokens at once" in why


def test_timings_the_os_moves_by_a_few_tenths_of_a_millisecond_are_not_a_busy_machine():
    """A GPU's (or a tiny model's) decodes of 0.4-1 ms, which the OS's scheduling moves by a few
    tenths of a millisecond: calibrate refused most such curves. The same timings at a CPU's
    scale (x60) say the machine was busy."""
    fast = [0.0007, 0.0004] + [0.0008 + 0.00002 * n for n in range(15)]  # a batch of 2 "below" one
    repeats, steps = [0.0004, 0.00085, 0.0009], [0.0003, 0.0007, 0.0007]
    assert records.costs_problem(fast, 0.0003, repeats, steps) is None
    slow = [60 * v for v in fast]
    assert "batch of 2" in records.costs_problem(slow, 0.018)
    assert "varied" in records.costs_problem(QUIET, 0.012, [60 * v for v in repeats])
    assert "varied" in records.costs_problem(QUIET, 0.012, draft_repeats=[60 * v for v in steps])


def test_one_slow_repeat_is_a_spike_not_a_busy_machine():
    assert records.costs_problem(QUIET, 0.012, [0.035, 0.978, 0.036], [0.012, 0.05, 0.012]) is None


def test_a_batch_of_four_may_cost_less_than_three_as_cpu_kernels_do():
    measured = [0.077, 0.113, 0.130, 0.119, 0.163, 0.205, 0.219, 0.233]  # Q4_K_M 1.5B, 2 x86 cores
    assert records.costs_problem(measured, 0.04, [0.113, 0.085, 0.086, 0.077, 0.070]) is None


def test_a_bigger_batch_timed_far_below_a_smaller_one_is_refused():
    curve = list(QUIET)
    curve[5] = 4.036  # one size measured while something else ran
    assert "below" in records.costs_problem(curve, 0.012)


def test_a_negative_marginal_cost_is_refused():
    falling = [0.2] + [0.19 - 0.011 * n for n in range(16)]
    falling = [max(v, 0.001) for v in falling]
    assert records.costs_problem(falling, 0.012) is not None


def test_a_flat_curve_is_plausible_but_stale_against_live_decodes():
    flat = [3.232] * 17  # every size timed at 3.2 s: flat like a GPU's, but this machine does 35 ms
    assert records.costs_problem(flat, 3.232) is None
    record = records.costs_value(flat, 3.232)
    assert "ms now" in records.stale(record, v1_now=0.036, draft_now=0.012)
    assert records.stale(records.costs_value(QUIET, 0.012), v1_now=0.04, draft_now=0.013) is None


def test_the_curve_must_agree_with_its_own_repeated_one_token_timing():
    assert "disagrees" in records.costs_problem([0.012] + QUIET[1:], 0.012, [0.035, 0.036, 0.035])


def test_records_carry_when_and_how(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLLAMA_HOME", str(tmp_path))
    stored = records.write("costs|x", records.costs_value(QUIET, 0.012), "probe while idle")
    assert records.read("costs|x") == stored and stored["how"] == "probe while idle" and stored["measured_at"]
    assert "probe while idle" in records.describe(stored) and records.describe(None) == "not measured yet"


def test_idle_probes_on_the_conversation_run_deepest_first():
    """A probe leaves the cache cut at its own depth: run shallow first, and a deeper one queued
    beside it no longer finds a conversation long enough (as CI saw: the limit at KV 768-1024
    was never measured because the one at 512-768 ran before it)."""
    from specllama.measuring.idle import IdleWork, Task

    cache = {"length": 1000}  # the live conversation reaches group 2 (KV 768-1024)
    ran = []

    def probe(group, at):
        def run(stop):
            ran.append(group)
            cache["length"] = at  # cut where it measured
        return Task(f"probe|{group}", run, lambda: cache["length"] > at, depth=group)

    idle = IdleWork(threading.Lock(), lambda: False, start=False)
    idle.add(Task("costs", lambda stop: cache.update(length=0), takes_context=True))
    idle.add(probe(1, 520))
    idle.add(probe(2, 780))
    assert idle.warm_up() == ["probe|2", "probe|1", "costs"]
    assert ran == [2, 1]


def test_the_draft_catches_up_after_the_work_that_takes_its_context():
    """The costs probe takes the draft's context and queues the catch-up again: run first, the
    catch-up was undone and warm_up() left the draft empty (a chat's next turn, 2,900 tokens
    behind, never drafted). The catch-up runs last; a task queued again after it ran runs again."""
    from specllama.measuring.idle import IdleWork, Task

    draft = {"cached": 0}
    idle = IdleWork(threading.Lock(), lambda: False, start=False)

    def catch_up():
        return Task("draft catch-up", lambda stop: draft.update(cached=3000), restores=True)

    def costs(stop):
        draft.update(cached=0)
        idle.add(catch_up())

    idle.add(catch_up())
    idle.add(Task("costs", costs, takes_context=True))
    idle.add(Task("probe|4", lambda stop: None, depth=4))
    assert idle.warm_up() == ["probe|4", "costs", "draft catch-up"]
    assert draft["cached"] == 3000

    def again(key, other):  # two tasks that queue each other: each runs twice, then warm_up ends
        return Task(key, lambda stop: idle.add(again(other, key)))

    idle.add(again("a", "b"))
    assert idle.warm_up() == ["a", "b", "a", "b"]


def test_a_disturbed_measurement_waits_before_the_idle_thread_retries_it():
    """A measurement the machine disturbed is retried later, not at the next idle moment: on a
    busy machine a probe rerun every half second keeps it busier (and is disturbed again)."""
    from specllama.measuring.idle import GRACE_SECONDS, IdleWork, Task

    runs: list[float] = []

    def measure(stop):
        runs.append(time.monotonic())
        return len(runs) > 1  # the first run looked busy

    idle = IdleWork(threading.Lock(), lambda: False)
    try:
        idle.add(Task("costs", measure, what="the decode-cost curve"))
        deadline = time.monotonic() + 60  # other objects' idle work in this process may run first
        while not runs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(runs) == 1
        time.sleep(4 * GRACE_SECONDS)
        assert len(runs) == 1 and idle.pending() == ["the decode-cost curve"]
        assert idle.warm_up() == ["costs"] and len(runs) == 2 and idle.pending() == []  # asked for: now
    finally:
        idle.close()


def test_work_with_one_long_call_waits_for_a_longer_quiet():
    """The piece probe's whole chunk is one llama.cpp call a request cannot stop (4.2 s on the
    F16 target here): the idle thread starts it only after PROBE_QUIET_SECONDS without a
    generation, not at the grace that lets short work start between back-to-back requests;
    warm_up() runs it at once."""
    from specllama.measuring.concurrency_probes import PROBE_QUIET_SECONDS
    from specllama.measuring.idle import GRACE_SECONDS, IdleWork, Task

    runs: list[tuple[str, float]] = []
    idle = IdleWork(threading.Lock(), lambda: False)
    try:
        idle.busy()  # a generation just ended
        t0 = time.monotonic()
        idle.add(Task("short", lambda stop: runs.append(("short", time.monotonic() - t0))))
        idle.add(Task("long", lambda stop: runs.append(("long", time.monotonic() - t0)), quiet=PROBE_QUIET_SECONDS))
        deadline = time.monotonic() + 60  # other objects' idle work in this process may run first
        while len(runs) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = dict(runs)
        assert set(started) == {"short", "long"}, runs
        assert GRACE_SECONDS <= started["short"] <= started["long"] and started["long"] >= PROBE_QUIET_SECONDS, runs
        idle.busy()
        idle.add(Task("long again", lambda stop: runs.append(("long again", 0.0)), quiet=PROBE_QUIET_SECONDS))
        assert idle.warm_up() == ["long again"]  # asked for: now, whatever the quiet
    finally:
        idle.close()


def test_the_cores_other_processes_use_are_read_per_cpu_without_idle_time():
    from specllama.measuring.cores import busy_jiffies

    stat = ("cpu  900 0 300 5000 50 0 0 0 0 0\n"
            "cpu0 100 5 50 2000 20 1 2 3 0 0\n"  # busy: 100+5+50+1+2+3; idle and iowait left out
            "cpu1 800 0 250 3000 30 0 0 10 0 0\n"
            "intr 12345 0 0\nctxt 999\n")
    assert busy_jiffies(stat, {0}) == 161
    assert busy_jiffies(stat, {0, 1}) == 161 + 1060
    assert busy_jiffies(stat, {5}) == 0  # a CPU this process may not run on


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat (Linux)")
def test_idle_work_waits_while_other_processes_hold_the_cores(monkeypatch):
    """A probe run while another process spins on the cores would time that process (and slow
    it): the work waits until the cores are free, then runs."""
    import specllama.measuring.idle
    from specllama.measuring.idle import IdleWork, Task

    monkeypatch.setattr(specllama.measuring.idle, "BUSY_POLL_SECONDS", 0.5)
    runs: list[float] = []
    idle = IdleWork(threading.Lock(), lambda: False, n_threads=len(os.sched_getaffinity(0)))
    try:
        with spinning_on_every_core():
            time.sleep(0.5)  # the burners spin
            idle.add(Task("costs", lambda stop: runs.append(time.monotonic()), what="the decode-cost curve"))
            time.sleep(4)
            assert runs == [] and idle.cores_taken and idle.pending() == ["the decode-cost curve"]
        deadline = time.monotonic() + 60  # other objects' idle work in this process may run first
        while not runs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runs and not idle.cores_taken and idle.pending() == []
    finally:
        idle.close()


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat (Linux)")
def test_idle_work_in_progress_leaves_the_cores_to_a_process_that_starts_using_them(monkeypatch):
    """A probe started on free cores used to run to its end (4-8 s) when another process began
    decoding: both ran at half speed, and the other one's timings looked busy. It ends within a
    window of the other process starting, and runs again once the cores are free."""
    import specllama.measuring.idle
    from specllama.measuring.idle import IdleWork, Preempted, Task

    monkeypatch.setattr(specllama.measuring.idle, "BUSY_POLL_SECONDS", 0.5)
    started, ended = threading.Event(), []

    def probe(stop):  # a measurement that checks stop() between its llama.cpp calls
        started.set()
        t0, seconds = time.monotonic(), 20 if not ended else 0.2
        while time.monotonic() - t0 < seconds:
            if stop():
                ended.append(("preempted", time.monotonic()))
                raise Preempted()
            time.sleep(0.02)
        ended.append(("done", time.monotonic()))

    idle = IdleWork(threading.Lock(), lambda: False, n_threads=len(os.sched_getaffinity(0)))
    task = Task("costs", probe, what="the decode-cost curve")
    try:
        idle.add(task)
        assert started.wait(60)  # other objects' idle work in this process may run first
        with spinning_on_every_core():
            spun = time.monotonic()
            while not ended and time.monotonic() - spun < 25:
                time.sleep(0.05)
            assert ended and ended[0][0] == "preempted" and ended[0][1] - spun < 3, ended
            assert idle.pending() == ["the decode-cost curve"]  # queued again, not dropped
            # not at once, and at a random time: two processes' idle work would meet again (the
            # idle thread sets it once the probe has returned)
            settled = time.monotonic() + 5
            while task.not_before == 0.0 and time.monotonic() < settled:
                time.sleep(0.01)
            assert task.not_before >= ended[0][1] + 0.2 * 0.5
        deadline = time.monotonic() + 60
        while idle.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [how for how, _ in ended] == ["preempted", "done"] and idle.pending() == []
    finally:
        idle.close()
