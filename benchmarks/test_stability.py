"""The same greedy request, repeated on freshly loaded objects in one process: how far each
run's speed is from the best run's. What the controller chooses must not depend on what it
happened to try first (4 runs on each of 3 objects, F16 target with the 0.5B draft).

    .venv/bin/python -m pytest benchmarks/test_stability.py -s
"""

from __future__ import annotations

import os

import pytest

import specllama

N_TOKENS = 128
N_THREADS = int(os.environ.get("SPECLLAMA_BENCH_THREADS", "2"))
PROMPTS = {
    "code": "Write a Python class implementing a binary search tree with insert, search and delete methods, with "
            "docstrings.",
    "edit": "Rewrite this code, renaming the parameter `records` to `rows` everywhere. Output only the code.\n\n"
            "```python\ndef summarize(records):\n    totals = {}\n    for record in records:\n        key = record["
            "\"region\"]\n        totals[key] = totals.get(key, 0) + record[\"amount\"]\n    return totals\n```",
}


@pytest.mark.parametrize("workload", list(PROMPTS))
def test_runs_are_within_ten_percent_of_the_best(bench_models, workload):
    messages = [{"role": "user", "content": PROMPTS[workload]}]
    rates = []
    for obj in range(3):
        with specllama.load(bench_models["target-f16"], bench_models["draft"], n_ctx=4096, n_threads=N_THREADS,
                            idle_work=False) as llm:
            llm.warm_up()
            llm.chat(messages, max_tokens=8, n_draft=2)  # the draft has read the prompt, as from the second request on
            for _ in range(4):
                s = llm.chat(messages, max_tokens=N_TOKENS).stats
                rates.append((obj, (s.n_generated - 1) / (s.t_decode + s.t_draft_prefill), s.n_plain_rounds,
                              s.n_lookup_rounds, s.n_rounds))
    best = max(r for _, r, _, _, _ in rates)
    print(f"\n{workload}: tok/s per run (object, rate, plain rounds, lookup rounds, rounds), best {best:.2f}")
    for obj, rate, n_plain, n_lookup, n_rounds in rates:
        print(f"  object {obj}: {rate:.2f} tok/s ({rate / best:.0%} of the best), {n_plain} plain and {n_lookup} "
              f"lookup rounds of {n_rounds}")
    worst = min(r for _, r, _, _, _ in rates)
    print(f"  worst run {worst / best:.0%} of the best (goal: at least 90%)")
