"""A host's own llama_cpp.Llama beside an idle SpecLlama in the same process: its speed kept.

    .venv/bin/python -m pytest benchmarks/test_beside_host.py -s

A library must not slow the program that imports it. A llama_cpp.Llama (the Q4_K_M test
target, 2 threads) generates N_TOKENS greedy tokens: alone; right after a SpecLlama pair was
loaded on a fresh SPECLLAMA_HOME (idle, queued measurements waiting); right after that pair
answered a request; and again seconds later. Each rate is against the mean of the alone rates
measured before the pair's load and after it closed, the median of N_REPEATS.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import llama_cpp

import specllama

N_TOKENS = int(os.environ.get("SPECLLAMA_BENCH_TOKENS", "64"))
N_THREADS = int(os.environ.get("SPECLLAMA_BENCH_THREADS", "2"))
N_REPEATS = int(os.environ.get("SPECLLAMA_BENCH_REPEATS", "3"))


def host_rate(llama: llama_cpp.Llama) -> float:
    t0 = time.perf_counter()
    out = llama.create_completion("def quicksort(items):", max_tokens=N_TOKENS, temperature=0.0)
    n = out["usage"]["completion_tokens"]
    return n / (time.perf_counter() - t0)


def test_a_host_s_llama_keeps_its_speed_beside_an_idle_specllama(bench_models, monkeypatch):
    monkeypatch.setenv("SPECLLAMA_HOME", tempfile.mkdtemp(prefix="specllama-beside-"))
    monkeypatch.delenv("SPECLLAMA_IDLE_WORK", raising=False)
    host = llama_cpp.Llama(str(bench_models["target"]), n_ctx=2048, n_threads=N_THREADS, verbose=False)
    host_rate(host)  # its one-time work
    ratios: dict[str, list[float]] = {"after load": [], "after a request": [], "6 s later": []}
    for _ in range(N_REPEATS):
        before = host_rate(host)
        with specllama.load(bench_models["target"], bench_models["draft"], n_ctx=2048, n_threads=N_THREADS) as llm:
            rates = {"after load": host_rate(host)}
            llm.generate("def quicksort(items):", max_tokens=32)
            rates["after a request"] = host_rate(host)
            time.sleep(6)
            rates["6 s later"] = host_rate(host)
        time.sleep(6)  # the pair's decode thread ends 5 s after its last call
        alone = (before + host_rate(host)) / 2
        for name, rate in rates.items():
            ratios[name].append(rate / alone)
    print(f"\nllama_cpp.Llama ({N_TOKENS} tokens, {N_THREADS} threads) beside an idle SpecLlama, "
          f"median of {N_REPEATS}, each against its speed alone:")
    for name, values in ratios.items():
        print(f"  {name:16} {statistics.median(values):.2f}x ({', '.join(f'{v:.2f}' for v in values)})")
    del host
