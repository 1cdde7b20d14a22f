"""A closed SpecLlama never lets llama.cpp touch freed memory: an open stream ends cleanly or
raises ClosedError, from the thread that iterates it or while another thread decodes. Each
case runs in a subprocess, so a segmentation fault fails the test rather than the test run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import SETTINGS

pytestmark = pytest.mark.children  # each test waits on a llama.cpp child

PROLOGUE = """
import sys, threading, time
import specllama
target, draft = sys.argv[1], sys.argv[2]
def load():
    return specllama.load(target, draft, n_ctx={n_ctx}, n_threads={n_threads})
""".format(**SETTINGS)


def run(model_paths, body: str) -> list[str]:
    script = PROLOGUE + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script, str(model_paths["target"]), str(model_paths["draft"])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    return proc.stdout.split()


def test_next_on_a_stream_after_close_ends_it(model_paths):
    out = run(model_paths, """
        llm = load()
        s = llm.stream("def f(x):", max_tokens=64)
        next(iter(s))
        llm.close()
        try:
            next(iter(s))
            print("chunk")
        except StopIteration:
            print("ended", s.result.finish_reason)
        except specllama.ClosedError:
            print("closed")
    """)
    assert out in (["ended", "cancelled"], ["closed"]), out


def test_close_from_another_thread_while_it_decodes(model_paths):
    out = run(model_paths, """
        llm = load()
        s = llm.stream("Write a long story about a lighthouse keeper.", max_tokens=400)
        seen = []
        def consume():
            try:
                for chunk in s:
                    seen.append(chunk)
                print("ended", s.result.finish_reason)
            except specllama.ClosedError:
                print("closed")
        t = threading.Thread(target=consume)
        t.start()
        while len(seen) < 3:
            time.sleep(0.01)
        llm.close()
        t.join(60)
        print("joined", not t.is_alive(), len(seen) < 400)
    """)
    assert out[-3:] == ["joined", "True", "True"] and out[:-3] in (["ended", "cancelled"], ["closed"]), out


def test_a_stream_dropped_unclosed_frees_its_slot(model_paths):
    """A `for` loop left with break drops its Stream without close(): the generation ends then,
    as close() ends it, and its slot is free again at once (cyclic garbage collection off: only
    the reference count). Before, the slot stayed taken, and with every slot held by a dropped
    stream the next request waited for good (found by a benchmark whose streaming thread broke out
    of its loop: the next 2,000-token prompt waited for the whole 3,000-token stream)."""
    out = run(model_paths, """
        import gc
        gc.disable()
        llm = specllama.load(target, draft, n_ctx=2048, n_threads=2, n_parallel=1)
        for chunk in llm.stream("def f(x):", max_tokens=64):
            break
        answers = []
        t = threading.Thread(target=lambda: answers.append(llm.generate("def g(y):", max_tokens=8).finish_reason))
        t.start()
        t.join(120)
        print("answered", answers, "again", llm.generate("def h(z):", max_tokens=8).finish_reason)
    """)
    assert out == ["answered", "['length']", "again", "length"], out


def test_a_stream_never_started_raises_closed_error_after_close(model_paths):
    out = run(model_paths, """
        llm = load()
        s = llm.stream("def f(x):", max_tokens=8)
        llm.close()
        llm.close()  # twice is fine
        try:
            next(s)
        except specllama.ClosedError:
            print("closed")
    """)
    assert out == ["closed"]


def test_every_use_after_close_raises_closed_error(model_paths):
    out = run(model_paths, """
        llm = load()
        llm.generate("hi", max_tokens=2)
        target, draft = llm.target, llm.draft
        llm.close()
        calls = [lambda: llm.generate("x"), lambda: llm.costs(), lambda: llm.tokenize("x"),
                 lambda: llm.chat([{"role": "user", "content": "x"}]), lambda: target.decode([1]),
                 lambda: target.logits(0), lambda: target.tokenize("x"), lambda: draft.sync([1, 2]),
                 lambda: target.truncate(0), lambda: llm.create_completion("x")]
        for call in calls:
            try:
                call()
                print("no-error")
            except specllama.ClosedError:
                print("ClosedError")
            except IndexError:
                print("IndexError")
    """)
    assert set(out) <= {"ClosedError", "IndexError"} and out.count("ClosedError") >= 9, out


def test_importing_the_memory_plan_loads_no_llama_cpp():
    proc = subprocess.run([sys.executable, "-c", "import sys, specllama.models.plan, specllama.runtime.settings; "
                           "print('llama_cpp' in sys.modules)"], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr
