"""The target split across two RPC workers on this machine, the draft local: plain against
speculative decoding in the same process, directly and through a relay that adds a 1 ms and a
10 ms round trip; plus the paper model of the same configuration (README, scaling).

    .venv/bin/python -m pytest benchmarks/test_rpc.py -s      # about 6 minutes
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specllama
from specllama import runtime

sys.path.insert(0, str(Path(__file__).parent))
from rpc_relay import Relay  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

N_TOKENS = 96
RTTS_MS = (0.0, 1.0, 10.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_workers():
    ports = [_free_port(), _free_port()]
    procs = [subprocess.Popen([sys.executable, "-m", "specllama", "worker", "--port", str(p), "--threads", "2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for p in ports]
    try:
        for proc in procs:
            for line in proc.stderr:
                if b"listening on" in line:
                    break
        relays = [Relay(("127.0.0.1", p)) for p in ports]
        yield relays
    finally:
        for proc in procs:
            proc.kill()


def per_decode(target, relays, n_tokens: int, n_repeats: int = 8) -> dict:
    """Median ms of one target decode of n_tokens rows, and its traffic per worker."""
    base = len(target.cached)
    times = []
    for relay in relays:
        relay.reset()
    for _ in range(n_repeats):
        t0 = time.perf_counter()
        target.decode([16] * n_tokens, n_logits=n_tokens)
        times.append(time.perf_counter() - t0)
        target.truncate(base)
    traffic = [relay.reset() for relay in relays]
    return {"ms": 1000 * sorted(times)[len(times) // 2],
            "turns": [t.turns / n_repeats for t in traffic],
            "kb_to_workers": [round(t.sent / n_repeats / 1024, 1) for t in traffic],
            "kb_from_workers": [round(t.received / n_repeats / 1024, 1) for t in traffic]}


def run(llm, tokens, n_draft) -> dict:
    r = llm.generate(tokens, max_tokens=N_TOKENS, n_draft=n_draft)
    s = r.stats
    return {"tokens": r.tokens, "tok_s": s.decode_tokens_per_second,
            # target decodes per generated token: one per round after the prompt
            "decodes_per_token": s.n_rounds / max(1, s.n_generated - 1), "acceptance": s.acceptance_rate,
            "n_generated": s.n_generated, "n_rounds": s.n_rounds, "n_drafted": s.n_drafted,
            "t_draft": s.t_draft, "t_verify": s.t_verify}


def modelled_speedup(plain: dict, spec: dict, rtt: float, bandwidth: float, n_workers: int, row_bytes: int) -> float:
    """The README's scaling model: both runs' measured time at loopback, plus per target decode
    one round trip per worker and the logit rows it returns at the link's bandwidth."""
    def network(n_decodes: int, n_rows: int) -> float:
        return n_decodes * n_workers * rtt + n_rows * row_bytes / bandwidth

    t_plain = plain["t_draft"] + plain["t_verify"] + network(plain["n_rounds"], plain["n_rounds"])
    n_spec_rows = spec["n_rounds"] + spec["n_drafted"]  # each round verifies its drafts plus one
    t_spec = spec["t_draft"] + spec["t_verify"] + network(spec["n_rounds"], n_spec_rows)
    return (spec["n_generated"] / t_spec) / (plain["n_generated"] / t_plain)


@pytest.mark.skipif(not runtime.supports_rpc(), reason=runtime.NO_RPC_BUILD)
def test_rpc_plain_vs_speculative(two_workers, bench_models):
    relays = two_workers
    models = (bench_models["target-f16"], bench_models["draft"])
    settings = dict(n_ctx=2048, n_threads=2)
    rows = []
    with specllama.load(*models, **settings, idle_work=False) as local:
        local.warm_up()  # the costs auto decides from, untimed
        tokens = local.chat_tokens([{"role": "user", "content": WORKLOADS["code"]}])
        local_plain, local_spec = run(local, tokens, 0), run(local, tokens, "auto")
    with specllama.load(*models, rpc=[r.endpoint for r in relays], **settings) as llm:
        target = llm.target
        target.truncate(0)
        target.decode(tokens)
        costs = {n: per_decode(target, relays, n) for n in (1, 4, 8)}
        for rtt in RTTS_MS:
            for relay in relays:
                relay.one_way = rtt / 2000
            plain, spec = run(llm, tokens, 0), run(llm, tokens, "auto")
            assert plain["tokens"] == local_plain["tokens"]  # the split target is the local target
            rows.append({"rtt_ms": rtt, "plain": plain, "spec": spec})
    print(f"\nlocal: plain {local_plain['tok_s']:.2f} tok/s, speculative {local_spec['tok_s']:.2f} tok/s "
          f"({local_spec['tok_s'] / local_plain['tok_s']:.2f}x)")
    for n, c in costs.items():
        print(f"RPC decode of {n} rows: {c['ms']:.0f} ms, round trips per worker {c['turns']}, "
              f"KiB to workers {c['kb_to_workers']}, from workers {c['kb_from_workers']}")
    row_bytes = 4 * llm.target.n_vocab  # one float32 logit row
    base = rows[0]
    for rtt in (0.001, 0.010):
        for gbit in (1, 10, None):
            bandwidth = float("inf") if gbit is None else gbit * 1e9 / 8
            x = modelled_speedup(base["plain"], base["spec"], rtt, bandwidth, len(relays), row_bytes)
            print(f"model: RTT {rtt * 1000:g} ms, {f'{gbit} Gb/s' if gbit else 'unlimited bandwidth'}: "
                  f"speculative {x:.2f}x plain")
    for row in rows:
        p, s = row["plain"], row["spec"]
        print(f"RPC, 2 workers, RTT {row['rtt_ms']:g} ms: plain {p['tok_s']:.2f} tok/s "
              f"({p['decodes_per_token']:.2f} target decodes/token), speculative {s['tok_s']:.2f} tok/s "
              f"({s['decodes_per_token']:.2f} decodes/token, acceptance {s['acceptance']:.0%}): "
              f"{s['tok_s'] / p['tok_s']:.2f}x, same output as plain: {s['tokens'] == p['tokens']}")
