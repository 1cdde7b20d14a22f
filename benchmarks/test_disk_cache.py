"""A restart between turns 1 and 2 of the coding chat: turn 2's time to first token from the prompt
cache on disk, against the same turn with the RAM cache warm and against a cold prefill.

    .venv/bin/python -m pytest benchmarks/test_disk_cache.py -s

The chat is test_chat.py's (Python's shlex.py in the system prompt, about 2,900 tokens with the
template), greedy, 2 threads, the draft model and every other setting at its default.
- RAM: one load; turn 1, then turn 2, which reuses turn 1's prompt and answer from the live sequence.
- cold: the same load, turn 2's prompt under another cache_scope, so nothing is reused.
- disk: a load with --prompt-cache-dir on an empty folder runs turn 1 and is closed (its
  conversation goes to disk); a second load (a restarted server) runs turn 2.
The state file is read from the page cache here (the file was just written): a restart after a
reboot reads it from the disk itself, which the printed read time does not include.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

import specllama

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chat import N_CTX, QUESTIONS, TARGETS, system_messages  # noqa: E402

N_TOKENS = 64
N_THREADS = int(os.environ.get("SPECLLAMA_BENCH_THREADS", "2"))


def ask(llm, messages, **options):
    """(text, seconds to the first token, stats)."""
    t0 = time.perf_counter()
    stream = llm.chat_stream(messages, max_tokens=N_TOKENS, **options)
    ttft, pieces = None, []
    for chunk in stream:
        if ttft is None:
            ttft = time.perf_counter() - t0
        pieces.append(chunk.text)
    return "".join(pieces), ttft, stream.result.stats


def turn_two(messages, answer):
    return messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": QUESTIONS[1]}]


@pytest.mark.parametrize("target", list(TARGETS))
def test_turn_two_after_a_restart(bench_models, target, tmp_path):
    paths = (bench_models[TARGETS[target]], bench_models["draft"])
    settings = dict(n_ctx=N_CTX, n_threads=N_THREADS)
    turn_one = system_messages() + [{"role": "user", "content": QUESTIONS[0]}]
    with specllama.load(*paths, **settings) as llm:
        answer, _, _ = ask(llm, turn_one)
        _, ram, ram_stats = ask(llm, turn_two(turn_one, answer))
        _, cold, cold_stats = ask(llm, turn_two(turn_one, answer), cache_scope="cold")
    folder = tmp_path / "prompt-cache"
    t0 = time.perf_counter()
    with specllama.load(*paths, prompt_cache_dir=folder, **settings) as llm:
        t_load_first = time.perf_counter() - t0
        disk_answer, _, _ = ask(llm, turn_one)
        t_close = time.perf_counter()
    t_close = time.perf_counter() - t_close
    files = sorted(folder.glob("*.state"))
    t0 = time.perf_counter()
    with specllama.load(*paths, prompt_cache_dir=folder, **settings) as llm:
        t_load = time.perf_counter() - t0
        _, disk, disk_stats = ask(llm, turn_two(turn_one, disk_answer))
        info = llm.prompt_cache_info()
    print(f"\n  {target}: turn 2 ({ram_stats.n_prompt} tokens), time to first token: RAM {ram:.2f} s "
          f"({ram_stats.n_prompt_cached} cached), disk after a restart {disk:.2f} s ({disk_stats.n_prompt_cached} "
          f"cached, draft {disk_stats.n_draft_prompt_cached}), cold {cold:.2f} s "
          f"({cold_stats.n_prompt_cached} cached)")
    print(f"    disk/RAM {disk / ram:.2f}x, cold/disk {cold / disk:.1f}x; same turn-1 answer: {disk_answer == answer}")
    print(f"    files: {', '.join(f'{f.stat().st_size / 2**20:.1f} MiB' for f in files)}; read {info['disk']['read']} "
          f"states, {info['disk']['bytes_read'] / 2**20:.1f} MiB in {info['disk']['read_seconds']:.3f} s; "
          f"close with writing {t_close:.2f} s; load {t_load:.1f} s (the first, hashing the files: "
          f"{t_load_first:.1f} s)")
    assert disk_stats.prompt_cache == "disk"
    assert disk <= 1.5 * ram, "turn 2 after a restart: over 1.5x the warm RAM cache's time to first token"
    assert cold >= 10 * disk, "turn 2 after a restart: under 10x faster than a cold prefill"
