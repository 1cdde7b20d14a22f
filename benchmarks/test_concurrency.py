"""Several requests at once: aggregate tokens per second and each request's waits.

    .venv/bin/python -m pytest benchmarks/test_concurrency.py -s
    SPECLLAMA_BENCH_TARGETS=q4,f16 .venv/bin/python -m pytest benchmarks/test_concurrency.py -s

1, 2 and 4 streamed chat requests sent at the same moment (code, an edit, prose and a title
request, in turn), greedy, 2 threads, in one process, against the same requests:
  one at a time   single-slot behaviour with speculation (n_parallel=1, the draft): (a)
  spec, turns     n_parallel=N, the draft, each request in contexts of its own, rounds in turn
  plain, batched  n_parallel=N, speculation off, batch_requests: plain continuous batching (b)
  spec, batched   n_parallel=N, the draft, batch_requests: every lane's rows in one pass
Each configuration runs twice, the order alternating; the table gives the medians, and how
many requests' texts differ from the first one-at-a-time run's (the default level: near-ties,
where the controller chose other draft lengths; at bitwise none may). Batched configurations
batch only where the level allows the lane difference measured at load (on this CPU: F16 at
rounding; Q4_K_M needs SPECLLAMA_BENCH_EXACT=1.0, otherwise it runs as turns).

Not here: llama-server (the vendored llama.cpp's tools/server is not built by setup.sh).
"""

from __future__ import annotations

import os
import statistics

import pytest

import specllama
from specllama.batch import time_requests

N_THREADS = int(os.environ.get("SPECLLAMA_BENCH_THREADS", "2"))
TARGETS = {"q4": "target", "f16": "target-f16"}
ASKS = ["Write a Python function that merges two sorted lists into one sorted list.",
        "Rename the variable x to total in this code and return the code only:\n\n"
        "def add(values):\n    x = 0\n    for v in values:\n        x += v\n    return x\n",
        "Describe a lighthouse at dawn in a short paragraph.",
        "Give a four-word title for: merging sorted lists in Python"]
N_TOKENS = 96  # the title and the edit end sooner, at their end of turn
COUNTS = (1, 2, 4)
REPEATS = 2


def _targets() -> list[str]:
    return os.environ.get("SPECLLAMA_BENCH_TARGETS", "q4").split(",")


def _run(llm, prompts, together: bool) -> dict:
    level = os.environ.get("SPECLLAMA_BENCH_EXACT", "rounding")
    timings, wall = time_requests(llm, prompts, together, max_tokens=N_TOKENS, exact=level)
    return {"aggregate": sum(t.n_tokens for t in timings) / wall, "wall": wall,
            "ttft": [t.first_token_s for t in timings], "total": [t.total_s for t in timings],
            "texts": [t.text for t in timings]}


@pytest.mark.parametrize("target", _targets())
def test_requests_at_once(bench_models, target):
    path, draft = bench_models[TARGETS[target]], bench_models["draft"]
    settings = dict(n_ctx=2048, n_threads=N_THREADS)
    rows = []
    n_max = max(COUNTS)
    with specllama.load(path, draft, n_parallel=1, **settings) as single, \
            specllama.load(path, draft, n_parallel=n_max, **settings) as turns, \
            specllama.load(path, n_parallel=n_max, batch_requests=True, **settings) as plain, \
            specllama.load(path, draft, n_parallel=n_max, batch_requests=True, **settings) as batched:
        configs = [("one at a time", single, False), ("spec, turns", turns, True), ("plain, batched", plain, True),
                   ("spec, batched", batched, True)]
        for _, llm, _ in configs:
            llm.warm_up()  # measurements before the clock, not inside it
        for n in COUNTS:
            prompts = [turns.chat_tokens([{"role": "user", "content": ASKS[i % len(ASKS)]}]) for i in range(n)]
            runs: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
            for repeat in range(REPEATS):
                for name, llm, together in (configs if repeat % 2 == 0 else configs[::-1]):
                    runs[name].append(_run(llm, prompts, together))
            reference = runs["one at a time"][0]["texts"]
            for name, results in runs.items():
                rows.append({"target": target, "n": n, "config": name,
                             "n_differ": sum(a != b for r in results for a, b in zip(r["texts"], reference)),
                             "aggregate": statistics.median(r["aggregate"] for r in results),
                             "ttft_max": statistics.median(max(r["ttft"]) for r in results),
                             "total_max": statistics.median(max(r["total"]) for r in results)})
    print(f"\n{'target':6} {'n':>2} {'config':14} {'tok/s':>7} {'longest ttft':>12} {'last done':>9} {'differ':>6}")
    for r in rows:
        print(f"{r['target']:6} {r['n']:2} {r['config']:14} {r['aggregate']:7.1f} {r['ttft_max']:11.2f}s "
              f"{r['total_max']:8.2f}s {r['n_differ']:6}")
    if os.environ.get("SPECLLAMA_BENCH_EXACT") == "bitwise":
        assert all(r["n_differ"] == 0 for r in rows if "batched" not in r["config"])
