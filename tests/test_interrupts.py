"""Interrupting a generation anywhere inside a round leaves both KV caches usable and exact."""

from __future__ import annotations

import threading

import pytest

import specllama

from conftest import SETTINGS
from prompts import CODE, PROSE


class Boom(KeyboardInterrupt):
    pass


def interrupt_nth_call(obj, name, n, monkeypatch, before=True):
    """Wrap a real method so its n-th call raises Boom (before or after doing its work)."""
    real = getattr(obj, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n and before:
            raise Boom(f"{name} #{n}")
        out = real(*args, **kwargs)
        if calls["n"] == n:
            raise Boom(f"after {name} #{n}")
        return out

    monkeypatch.setattr(obj, name, wrapper)
    return calls


@pytest.fixture(scope="module")
def expected(plain):
    return {p: plain.generate(p, max_tokens=40).tokens for p in (CODE, PROSE)}


# (runtime, method, call number, before/after): drafting, verification, and between the two
POINTS = [
    ("draft", "decode", 3, True),   # while drafting
    ("draft", "decode", 4, False),  # after a draft step, before the proposal returns
    ("target", "decode", 3, True),  # before a verify pass
    ("target", "decode", 3, False), # after a verify pass, before acceptance and rollback
    ("target", "truncate", 4, False),  # after rollback, before the tokens are yielded
    ("draft", "sync", 2, False),    # after the draft caught up, before it drafts
]


@pytest.mark.parametrize("which, method, n, before", POINTS)
def test_interrupt_inside_a_round_then_next_generate_is_exact(pair, expected, monkeypatch, which, method, n, before):
    runtime = getattr(pair, which)
    interrupt_nth_call(runtime, method, n, monkeypatch, before)
    with pytest.raises(Boom):
        pair.generate(CODE, max_tokens=40, n_draft=2)
    monkeypatch.undo()
    for prompt in (CODE, PROSE):
        assert pair.generate(prompt, max_tokens=40, n_draft=2).tokens == expected[prompt]


def test_exception_in_the_consumer_then_exact(pair, expected):
    stream = pair.stream(PROSE, max_tokens=40, n_draft=2)
    with pytest.raises(ZeroDivisionError):
        for i, _ in enumerate(stream):
            if i == 5:
                1 / 0
    stream.close()
    assert pair.generate(PROSE, max_tokens=40, n_draft=2).tokens == expected[PROSE]


def test_two_threads_each_get_their_own_output(model_paths, expected):
    """Two threads at once decode in two slots; neither's output depends on the other's."""
    results = []
    start = threading.Barrier(2)
    llm = specllama.load(model_paths["target"], model_paths["draft"], n_parallel=2, **SETTINGS)

    def worker():
        start.wait()
        results.append(llm.generate(CODE, max_tokens=40, n_draft=2, exact="bitwise").tokens)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)  # two 40-token generations take seconds: past this they hang
    assert not any(t.is_alive() for t in threads), "a generation never ended"
    llm.close()
    assert results == [expected[CODE]] * 2
