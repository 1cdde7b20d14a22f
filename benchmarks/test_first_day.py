"""The first day: a script calling generate back to back on a fresh machine, nothing measured yet.

    .venv/bin/python -m pytest benchmarks/test_first_day.py -s            # F16 target (default)
    SPECLLAMA_BENCH_FIRST_DAY_TARGET=q4 .venv/bin/python -m pytest benchmarks/test_first_day.py -s

For each workload (code, edit; 128 greedy tokens, 2 threads) a fresh SPECLLAMA_HOME and a fresh
load of the pair with the defaults a script gets, then SPECLLAMA_BENCH_CALLS calls back to back
with no pause between the pair's calls (the rate of each against a plain call of a second
object run just before it, so machine drift cancels), then warm_up() (every measurement made
and cached) and the same call again, between two plain ones: the speedup the first day should
reach. Also printed: how long the load
took (the short-context limit probe is part of it) and what each call's costs came from.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pytest

import specllama

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import rate  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

N_TOKENS = int(os.environ.get("SPECLLAMA_BENCH_TOKENS", "128"))
N_THREADS = int(os.environ.get("SPECLLAMA_BENCH_THREADS", "2"))
N_CALLS = int(os.environ.get("SPECLLAMA_BENCH_CALLS", "8"))
TARGET = {"q4": "target", "f16": "target-f16"}[os.environ.get("SPECLLAMA_BENCH_FIRST_DAY_TARGET", "f16")]


@pytest.mark.parametrize("workload", ["code", "edit"])
def test_first_day_back_to_back(bench_models, workload, monkeypatch):
    monkeypatch.setenv("SPECLLAMA_HOME", tempfile.mkdtemp(prefix="specllama-first-day-"))
    messages = [{"role": "user", "content": WORKLOADS[workload]}]
    with specllama.load(bench_models[TARGET], None, n_ctx=4096, n_threads=N_THREADS) as plain:
        plain.chat(messages, max_tokens=8)  # its one-time work, untimed
        t0 = time.perf_counter()
        with specllama.load(bench_models[TARGET], bench_models["draft"], n_ctx=4096, n_threads=N_THREADS) as llm:
            t_load = time.perf_counter() - t0
            calls, plain_rates = [], []
            for _ in range(N_CALLS):  # each call right after a plain one: machine drift cancels in their ratio
                plain_rates.append(rate(plain.chat(messages, max_tokens=N_TOKENS).stats))
                calls.append(llm.chat(messages, max_tokens=N_TOKENS))
            llm.warm_up()
            probed = llm.planner.book.get()
            warm_plain = [rate(plain.chat(messages, max_tokens=N_TOKENS).stats)]
            warm = llm.chat(messages, max_tokens=N_TOKENS)
            warm_plain.append(rate(plain.chat(messages, max_tokens=N_TOKENS).stats))
    ratios = [rate(r.stats) / base for r, base in zip(calls, plain_rates)]
    warm_ratio = rate(warm.stats) / statistics.mean(warm_plain)
    print(f"\n{TARGET} {workload}: load {t_load:.1f} s, plain {min(plain_rates):.1f}-{max(plain_rates):.1f} tok/s; "
          f"warm {warm_ratio:.2f}x")
    for i, r in enumerate(calls, 1):
        s = r.stats
        print(f"  call {i}: {ratios[i - 1]:.2f}x ({ratios[i - 1] / warm_ratio:.2f} of warm), "
              f"{s.tokens_per_round:.2f} tokens a round, pending: {s.measurements_pending}")
    print(f"  warm:   {warm.stats.tokens_per_round:.2f} tokens a round, identical to call 1: "
          f"{warm.tokens == calls[0].tokens}")
    print("  the costs each decided from (ms: one pass of n rows, a draft step):")
    print(f"    probe's curve v(n) {({n: round(probed.v(n) * 1e3, 2) for n in (1, 2, 3, 4, 6, 8, 12, 16)})}, "
          f"draft {probed.draft_token * 1e3:.2f}")
    for name, r in [*((f"call {i}", calls[i - 1]) for i in (1, 3, N_CALLS)), ("warm", warm)]:
        c = r.stats.controller
        print(f"    {name:7} v(n) {c.get('v_ms')}, draft {c.get('draft_token_ms')}; {r.stats.sources}")
    for r in calls:  # greedy output differs from plain decoding only at near-ties the run counted
        assert r.tokens == calls[0].tokens or r.stats.near_ties
