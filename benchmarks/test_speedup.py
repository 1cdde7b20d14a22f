"""Speculative vs plain decoding on real models: one command, ratios measured in one run.

    .venv/bin/python -m pytest benchmarks/test_speedup.py

Each case runs plain decoding and then the configuration on the same chat prompt (greedy,
128 tokens, 2 threads by default), so machine drift cancels in the ratio. Targets: the
Qwen2.5-Coder 1.5B in Q4_K_M (compute-bound on a small CPU) and in F16 (memory-bound, like big
models on a Mac Studio or an RTX card), drafted by the 0.5B Q4_K_M.

The F16 target runs with exact=False: on our CPUs its logits for any batch of 2+ tokens differ
from single-token decoding in the third decimal, so exact mode would never draft (identity of
each output with plain decoding is still reported in the "same" column).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import specllama

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import record  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

N_TOKENS = int(os.environ.get("SPECLLAMA_BENCH_TOKENS", "128"))
N_THREADS = int(os.environ.get("SPECLLAMA_BENCH_THREADS", "2"))
CONFIGS = {  # name: (draft, n_draft, lookup)
    "draft k=2": ("draft", 2, False),
    "draft k=4": ("draft", 4, False),
    "draft k=8": ("draft", 8, False),
    "auto": ("draft", "auto", False),
    "ngram": ("ngram", "auto", False),
    "ngram+draft": ("draft", "auto", True),
}
TARGETS = {"q4": ("target", True), "f16": ("target-f16", False)}  # model, exact

_loaded: dict = {}


def model(bench_models, target: str, draft: str | None, lookup: bool):
    key = (target, draft, lookup)
    if key not in _loaded:
        name, exact = TARGETS[target]
        draft_arg = {"draft": bench_models["draft"], "ngram": "ngram", None: None}[draft]
        _loaded[key] = specllama.load(bench_models[name], draft_arg, exact=exact, lookup=lookup,
                                      n_ctx=4096, n_threads=N_THREADS)
    return _loaded[key]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("target", list(TARGETS))
def test_speedup(benchmark, bench_models, target, workload, config):
    draft, n_draft, lookup = CONFIGS[config]
    messages = [{"role": "user", "content": WORKLOADS[workload]}]
    plain = model(bench_models, target, None, False)
    llm = model(bench_models, target, draft, lookup)
    base = plain.chat(messages, max_tokens=N_TOKENS)
    result = benchmark.pedantic(lambda: llm.chat(messages, max_tokens=N_TOKENS, n_draft=n_draft),
                                rounds=1, iterations=1)
    s = result.stats
    row = {
        "target": target, "workload": workload, "config": config,
        "tokens_per_s": s.decode_tokens_per_second,
        "plain_tokens_per_s": base.stats.decode_tokens_per_second,
        "speedup": s.decode_tokens_per_second / base.stats.decode_tokens_per_second,
        "acceptance": s.acceptance_rate, "tokens_per_round": s.tokens_per_round,
        "overhead_share": s.t_other / s.t_decode if s.t_decode else 0.0,
        "draft_share": s.t_draft / s.t_decode if s.t_decode else 0.0,
        "n_draft_max": s.n_draft_max, "n_plain_rounds": s.n_plain_rounds, "n_rounds": s.n_rounds,
        "identical": result.tokens == base.tokens,
    }
    benchmark.extra_info.update(row)
    record(row)
    assert result.tokens == base.tokens or target == "f16", "greedy output changed in exact mode"
