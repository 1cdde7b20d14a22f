"""What each memory type's rollback and each draft source cost per round, on this machine.

    .venv/bin/python -m pytest benchmarks/test_memory.py -s

On the tiny random-weight models of scripts/tiny_models.py (qwen35 hybrid with an MTP layer,
qwen3 attention-only; n_embd 64, the Qwen2.5 vocabulary): a round verifies 5 tokens and keeps
3, as a speculative round with 4 drafts and 2 accepted does, then the rollback runs. Medians
of N_ROUNDS rounds in one process. The figures are this machine's and these shapes': a real
hybrid's recurrent state is megabytes, not kilobytes, and its verify pass far costlier.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

import fetch_models
import tiny_models
from specllama.runtime import ModelSettings, Runtime

ROOT = Path(__file__).resolve().parent.parent
N_ROUNDS = int(os.environ.get("SPECLLAMA_BENCH_ROUNDS", "200"))
N_THREADS = int(os.environ.get("SPECLLAMA_BENCH_THREADS", "2"))


def _tiny() -> dict[str, Path]:
    version = hashlib.sha1((ROOT / "scripts" / "tiny_models.py").read_bytes()).hexdigest()[:10]
    return tiny_models.write_set(fetch_models.path_of("draft"), fetch_models.cache_dir() / f"tiny-{version}")


def _rounds(rt: Runtime, n_verify: int = 5, n_keep: int = 3) -> dict:
    rng = np.random.default_rng(0)
    rt.truncate(0)
    rt.decode(rt.tokenize("The state of a long conversation, " * 8, add_special=False))
    verify, rollback = [], []
    for _ in range(N_ROUNDS):
        batch = [int(t) for t in rng.integers(0, rt.n_vocab, n_verify)]
        t0 = time.perf_counter()
        rt.decode(batch, n_logits=n_verify)
        t1 = time.perf_counter()
        rt.truncate(len(rt.cached) - n_verify + n_keep)
        verify.append(t1 - t0)
        rollback.append(time.perf_counter() - t1)
        if len(rt.cached) > rt.n_ctx - 2 * n_verify:
            rt.truncate(64)
    return {"verify_ms": statistics.median(verify) * 1e3, "rollback_ms": statistics.median(rollback) * 1e3,
            "checkpoint_kib": rt.checkpoint_bytes / 1024}


def _checkpoint_copy_ms(rt: Runtime) -> float:
    times = []
    for _ in range(N_ROUNDS):
        rt._checkpoint = None  # force a fresh copy
        t0 = time.perf_counter()
        rt._save_checkpoint()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _token_ms(decode_one) -> float:
    times = []
    for i in range(N_ROUNDS):
        t0 = time.perf_counter()
        decode_one(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def test_rollback_and_draft_costs_per_round():
    tiny = _tiny()
    settings = dict(n_ctx=1024, n_threads=N_THREADS)
    rows = {}
    with Runtime.load(tiny["attention-draft"], ModelSettings(**settings)) as rt:
        rows["seq_rm (attention)"] = _rounds(rt)
    for rollback in ("n_rs_seq", "checkpoint"):
        with Runtime.load(tiny["hybrid-target"], ModelSettings(**settings, rollback=rollback)) as rt:
            rows[f"{rollback} (hybrid)"] = {**_rounds(rt), "checkpoint_copy_ms": _checkpoint_copy_ms(rt)}
    print(f"\n{'rollback':22} {'verify 5 ms':>11} {'rollback ms':>11} {'state KiB':>9} {'copy ms':>8}")
    for name, r in rows.items():
        print(f"{name:22} {r['verify_ms']:11.3f} {r['rollback_ms']:11.3f} {r['checkpoint_kib']:9.1f} "
              f"{r.get('checkpoint_copy_ms', 0.0):8.3f}")

    # a draft token: the target's MTP layer against a second (hybrid) model of the same size,
    # in rounds of 4 (the draft model's checkpoint and rollback included)
    with Runtime.load(tiny["hybrid-target"], ModelSettings(**settings), mtp=True) as target, \
            Runtime.load(tiny["hybrid-draft"], ModelSettings(**settings, rollback="checkpoint")) as draft:
        context = target.tokenize("The state of a long conversation, " * 8, add_special=False)
        target.decode(context)
        head = target.mtp_head
        head.sync(context + [11])
        draft.decode(context)

        def drafting(runtime):  # a round of 4 drafts, one token at a time, then back
            def step(i: int) -> None:
                for j in range(4):
                    runtime.decode([100 + (i + j) % 50])
                runtime.truncate(len(context))
            return step

        def target_step(i: int) -> None:
            target.decode([100 + i % 50])
            target.truncate(len(context))

        tokens = {"mtp draft token": _token_ms(drafting(head)) / 4,
                  "draft-model token": _token_ms(drafting(draft)) / 4,
                  "target token (MTP following)": _token_ms(target_step)}
    for name, ms in tokens.items():
        print(f"{name:30} {ms:7.3f} ms")
    out = ROOT / ".benchmarks" / "memory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rollback": rows, "token_ms": tokens, "rounds": N_ROUNDS}, indent=1))
    assert all(r["rollback_ms"] >= 0 for r in rows.values())
