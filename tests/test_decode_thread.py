"""Every llama_decode on one OS thread (runtime/decoder.py): llama.cpp's OpenMP team belongs to
the calling thread, and two requests' threads calling in turn stalled each other's graphs
(benchmarks/test_concurrency.py, "spec, turns"). Real models, real llama.cpp; the thread's own
rules on plain functions."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import llama_cpp
import pytest

import specllama
from conftest import SETTINGS
from specllama.runtime.decoder import DecodeThread


def test_every_llama_decode_runs_on_one_thread_whichever_request_asks(tiny_paths, monkeypatch):
    """Two requests at once in slots of their own, then one on this thread: llama.cpp is
    called from one thread, none of theirs, and each output is still the one it has alone."""
    real, callers = llama_cpp.llama_decode, set()

    def recorded(ctx, batch):
        # by name too: a thread's ident is reused once it ends, and the decode thread ends
        # whenever nothing of specllama's runs
        callers.add((threading.get_ident(), threading.current_thread().name))
        return real(ctx, batch)

    with specllama.load(tiny_paths["attention-draft"], n_parallel=2, **SETTINGS) as llm:
        prompts = ["Hello there", "Once upon a time"]
        alone = [llm.generate(p, max_tokens=12).tokens for p in prompts]
        monkeypatch.setattr(llama_cpp, "llama_decode", recorded)
        requesters, start = set(), threading.Barrier(2)

        def ask(prompt):
            requesters.add(threading.get_ident())
            start.wait()
            return llm.generate(prompt, max_tokens=12)

        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(ask, prompts))
        during = set(callers)
        llm.generate(prompts[0], max_tokens=4)
    assert [r.tokens for r in together] == alone
    assert len(during) == 1, during
    assert {name for _, name in callers} == {"specllama-decode"}, callers
    assert not {ident for ident, _ in during} & (requesters | {threading.get_ident()})


def test_a_round_s_draft_steps_are_one_call_to_the_decode_thread(tiny_paths, monkeypatch):
    """A draft with a context of its own takes its steps on the decode thread (Runtime.drafting):
    a round hands that thread its draft's catch-up, its steps and its verify pass, not each step's
    decode (25-44 us of hand-off a step); the output is the one whose steps were handed off one
    by one."""
    from specllama.runtime import decoder
    from specllama.runtime.core import Runtime

    tiny = tiny_paths["attention-draft"]
    real, handed = decoder.DecodeThread.run, []

    def counted(self, fn, *args):
        if threading.get_ident() != self._ident:
            handed.append(fn)
        return real(self, fn, *args)

    with specllama.load(tiny, tiny, n_draft=4, tree=1, exact="off", **SETTINGS) as llm:
        llm.generate("Hello there", max_tokens=8)  # both prompts prefilled
        monkeypatch.setattr(decoder.DecodeThread, "run", counted)
        fast = llm.generate("Hello there", max_tokens=48)
        n_fast = handed.count(decoder._decode)
        monkeypatch.setattr(Runtime, "drafting", lambda self, steps, *args: steps(*args))
        handed.clear()
        slow = llm.generate("Hello there", max_tokens=48)
    s = fast.stats
    assert fast.tokens == slow.tokens and s.n_drafted >= 2 * s.n_rounds, s.as_dict()
    assert n_fast <= 2 * s.n_rounds + 2 < handed.count(decoder._decode), (n_fast, s.n_rounds, len(handed))


def test_the_decode_thread_ends_once_nothing_of_specllama_s_runs(tiny_paths):
    """Its OpenMP team outliving the work made a host's own llama_cpp.Llama decode at 0.71x
    its speed beside an idle SpecLlama (benchmarks/test_beside_host.py): it ends with the last
    generation, not 5 s later, and the next one starts another."""
    def alive() -> bool:
        return any(t.name == "specllama-decode" for t in threading.enumerate())

    with specllama.load(tiny_paths["attention-draft"], **SETTINGS) as llm:
        for _ in range(2):
            llm.generate("Hello there", max_tokens=4)
            deadline = time.monotonic() + 1.0
            while alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not alive()


def test_an_interrupt_is_raised_once_the_call_has_returned():
    """Ctrl-C while a call runs on the decode thread: the caller raises KeyboardInterrupt only
    after the call is done, as with the C call made in place (its rollback must not touch a
    context llama.cpp is still computing in)."""
    decoder, state = DecodeThread(), {}

    def slow():
        time.sleep(0.4)
        state["done"] = time.perf_counter()
        return 7

    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        try:
            decoder.run(slow)
        finally:
            state["raised"] = time.perf_counter()
    timer.join()
    assert state["done"] <= state["raised"]
    assert decoder.run(lambda: 3) == 3  # and it keeps working


def test_a_call_s_error_is_raised_in_its_caller_and_the_thread_goes_on():
    decoder = DecodeThread()
    with pytest.raises(ValueError, match="bad batch"):
        decoder.run(lambda: (_ for _ in ()).throw(ValueError("bad batch")))
    idents = {decoder.run(threading.get_ident) for _ in range(3)}
    assert len(idents) == 1 and threading.get_ident() not in idents


def test_the_thread_ends_when_idle_and_the_next_call_starts_another(monkeypatch):
    """Idle for IDLE_EXIT_SECONDS, the thread ends (and llama.cpp's OpenMP team with it, which
    would otherwise slow another thread's llama_decode calls); a later call starts a new one, and
    calls arriving as the old one ends are never lost."""
    from specllama.runtime import decoder as module

    monkeypatch.setattr(module, "IDLE_EXIT_SECONDS", 0.05)
    decoder = DecodeThread()

    def alive() -> set:
        return {t.ident for t in threading.enumerate() if t.name == "specllama-decode"}

    first = decoder.run(threading.get_ident)
    time.sleep(0.3)
    assert first not in alive()
    second = decoder.run(threading.get_ident)
    assert second != threading.get_ident() and second in alive()
    for pause in (0.03, 0.045, 0.05, 0.055, 0.07) * 4:  # calls racing the thread's end
        time.sleep(pause)
        assert decoder.run(lambda: 11) == 11


def test_a_failed_decode_says_what_llama_cpp_logged(tiny_paths):
    """llama_decode's status -1 is any invalid batch; why is only in llama.cpp's log, which is
    silent unless verbose. A batch whose positions skip ahead of the cache raises a DecodeError
    naming llama.cpp's reason, and the runtime decodes on afterwards."""
    from specllama.errors import DecodeError
    from specllama.runtime import ModelSettings, Runtime

    with Runtime.load(tiny_paths["attention-draft"], ModelSettings(**SETTINGS)) as rt:
        rt.decode([1, 2, 3])
        rt._batch.fill([4], 7, 1)  # position 7 after 0..2: not consecutive
        with pytest.raises(DecodeError, match=r"status -1 .*position 7 .*llama.cpp: .*consecutive"):
            rt._pass(7, 1)
        rt.decode([4])
        assert rt.cached == [1, 2, 3, 4]
