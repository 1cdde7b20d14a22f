"""A long prompt's prefill alone: specllama's Runtime against llama_cpp.Llama, same settings.

    .venv/bin/python -m pytest benchmarks/test_prefill.py -s

1,536 tokens of Python's shlex.py (SPECLLAMA_BENCH_PREFILL_TOKENS sets it), the Q4_K_M test
target, n_ctx 6144, n_batch 512, flash attention off, 2 threads, in one process, the two
alternating over REPEATS rounds (this machine's run-to-run spread is larger than a small gap:
compare within a round). Our Runtime with tree branches (as load() makes the target) and with chains only.
"""

from __future__ import annotations

import inspect
import os
import shlex
import time

import llama_cpp

from specllama.runtime import Runtime
from specllama.runtime.decoder import DECODER
from specllama.runtime.settings import ModelSettings

N_THREADS = int(os.environ.get("SPECLLAMA_BENCH_THREADS", "2"))
N_TOKENS = int(os.environ.get("SPECLLAMA_BENCH_PREFILL_TOKENS", "1536"))  # at most the file's ~2,900
N_CTX = 6144  # as benchmarks/test_chat.py
REPEATS = 2


def _ours(path, n_branches: int) -> float:
    with Runtime.load(path, ModelSettings(n_ctx=N_CTX, n_threads=N_THREADS, flash_attn=False),
                      n_branches=n_branches) as runtime:
        tokens = runtime.tokenize(inspect.getsource(shlex), add_special=True)[:N_TOKENS]
        t0 = time.perf_counter()
        runtime.decode(tokens, aligned=True)
        return time.perf_counter() - t0


def _theirs(path) -> float:
    llm = llama_cpp.Llama(str(path), n_ctx=N_CTX, n_batch=512, n_threads=N_THREADS, flash_attn=False, verbose=False)
    try:
        tokens = llm.tokenize(inspect.getsource(shlex).encode())[:N_TOKENS]
        t0 = time.perf_counter()
        llm.eval(tokens)
        return time.perf_counter() - t0
    finally:
        llm.close()


def test_prefill_against_llama_cpp_python(bench_models):
    path = bench_models["target"]
    # llama_cpp.Llama on specllama's decode thread: one OpenMP team in the process, as each side
    # has in a process of its own (two live teams slow both: runtime/decoder.py)
    runs = {"specllama (tree branches)": lambda: _ours(path, 8), "llama_cpp.Llama": lambda: DECODER.run(_theirs, path),
            "specllama (chains)": lambda: _ours(path, 1)}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(REPEATS):
        for name in (list(runs) if repeat % 2 == 0 else list(runs)[::-1]):
            seconds[name].append(runs[name]())
    print(f"\nprefill of {N_TOKENS} tokens, seconds per round:")
    for name, values in seconds.items():
        print(f"  {name:>26}: " + ", ".join(f"{v:.1f}" for v in values))
