"""Long runs: resident memory stays flat across generations after warm-up.

CI runs 2 x 100 tokens; SPECLLAMA_SOAK_FULL=1 runs 8 x 500 (4,000 tokens) with n-gram + draft.
"""

from __future__ import annotations

import os

import specllama

from conftest import SETTINGS

FULL = bool(os.environ.get("SPECLLAMA_SOAK_FULL"))
N_RUNS, N_TOKENS = (8, 500) if FULL else (2, 100)


def test_rss_does_not_grow(model_paths):
    with specllama.load(model_paths["target"], model_paths["draft"], lookup=True, **SETTINGS) as llm:
        prompt = "Write a Python module with twenty small utility functions for strings, each with a docstring."
        messages = [{"role": "user", "content": prompt}]
        rss = []
        n_tokens = 0
        for i in range(N_RUNS):
            r = llm.chat(messages, max_tokens=N_TOKENS, temperature=0.7 if i % 2 else 0.0, seed=i)
            n_tokens += len(r.tokens)
            rss.append(r.stats.n_bytes_resident)  # the figure every result reports
        growth = rss[-1] - rss[0]
        print(f"\nsoak: {n_tokens} tokens, RSS after warm-up {rss[0] / 2**20:.0f} MiB, at end "
              f"{rss[-1] / 2**20:.0f} MiB (growth {growth / 2**20:+.1f} MiB)")
        assert growth < 32 * 2**20, [f"{x / 2**20:.0f} MiB" for x in rss]
