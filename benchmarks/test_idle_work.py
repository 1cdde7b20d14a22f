"""A conversation's next turn arriving while idle work runs: how long it waits for that work.

    .venv/bin/python -m pytest benchmarks/test_idle_work.py -s

After a turn with a long new prompt (about 1,250 tokens: part of Python's shlex.py, new each
trial), the draft was left behind (the turn could not repay its prefill) and catches up while
idle. The next turn is sent 0.6-5 s after the answer, as a chat UI's follow-up requests or an
agent's next call come. Its time to first token beyond its own prefill is what it waited for
the catch-up: in pieces of about 0.5 s (where the draft's pieces are measured bitwise; a request
stops the catch-up between two) against whole 512-token chunks, alternating trial by trial in
one process. The Q4_K_M test target (a quicker first prefill; the catch-up is the draft's,
the same for either target) with the 0.5B draft, 2 threads.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import specllama
from specllama.measuring.concurrency_probes import measure_pieces

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import shlex_source  # noqa: E402

N_THREADS = int(os.environ.get("SPECLLAMA_BENCH_THREADS", "2"))
DELAYS = [0.6, 0.9, 1.2, 1.6, 2.0, 2.5, 3.0, 5.0]  # seconds between an answer and the next turn


def _next_turn_wait(llm, trial: int, delay: float) -> float:
    """Seconds the next turn's first token took beyond its own prefill."""
    messages = [{"role": "system", "content": f"[{trial}] Answer about this file:\n\n```python\n"
                 + shlex_source()[:5000] + "```"},
                {"role": "user", "content": "What does this file do? One sentence."}]
    answer = llm.chat(messages, max_tokens=24)
    time.sleep(delay)
    messages += [{"role": "assistant", "content": answer.text}, {"role": "user", "content": "And the class in it?"}]
    t0 = time.perf_counter()
    stream = llm.chat_stream(messages, max_tokens=8)
    next(iter(stream))
    ttft = time.perf_counter() - t0
    for _ in stream:
        pass
    llm.warm_up()  # the rest of the catch-up, so every trial starts alike
    return ttft - stream.result.stats.t_prefill


def test_a_next_turn_waits_for_the_draft_s_catch_up_a_piece_at_most(bench_models):
    with specllama.load(bench_models["target"], bench_models["draft"], n_ctx=4096, n_threads=N_THREADS,
                        idle_work=True) as llm:
        llm.warm_up()
        measure_pieces(llm.pool.pieces, (llm.draft,))  # cached per machine; measured here if not yet
        n_piece = llm.pool.n_piece(llm.draft)
        waits: dict[str, list[float]] = {"pieces": [], "whole chunks": []}
        for i, delay in enumerate(DELAYS):  # each delay in both configurations, which goes first alternating
            for config in list(waits)[::1 if i % 2 == 0 else -1]:
                llm.pool.pieces[llm.draft.identity] = n_piece if config == "pieces" else 0
                waits[config].append(_next_turn_wait(llm, 2 * i + (config == "pieces"), delay))
                print(f"  {config:12} next turn {delay:.1f} s after the answer: waited {waits[config][-1]:.2f} s",
                      flush=True)
    print(f"\nthe draft's pieces: {n_piece} rows and up (0: measured to differ, whole chunks either way)")
    for config, seconds in waits.items():
        print(f"{config:12}: waited {statistics.mean(seconds):.2f} s on average, at most {max(seconds):.2f} s "
              f"({len(seconds)} turns)")
