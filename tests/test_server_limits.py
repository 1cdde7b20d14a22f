"""One hostile or careless client cannot freeze, flood or read through a real `specllama serve`:
bounded parsing, bounded bodies and queues, streams that end when nobody reads them, keys and
Host names checked, a prompt cache scoped per key, and a 4xx for every bad input.

The servers serve the tiny random-weight model (scripts/tiny_models.py, Qwen's vocabulary and
chat template): what is tested is the server's handling, which no model's quality changes, and
a tiny model generates thousands of tokens in seconds."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from serving import metric, post, serve
from specllama.runtime import supports_rpc
from specllama.server.app import create_app
from specllama.server.limits import ServerLimits
from specllama.surfaces.tools import ToolFormat

pytestmark = pytest.mark.children

LIMITS = ("--limit", "body_mb=1", "--limit", "queue=4", "--limit", "stop=4", "--limit", "stop_chars=16",
          "--limit", "messages=8", "--limit", "tools=2", "--limit", "input_extra=2", "--limit", "grammar_kb=1",
          "--limit", "prompts=4", "--limit", "choices=8")
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tiny(tiny_paths):
    return tiny_paths["attention-draft"]


@pytest.fixture(scope="module")
def limited(tiny, tmp_path_factory):
    """A keyless loopback server, one slot, small limits."""
    log = tmp_path_factory.mktemp("limited") / "serve.log"
    with serve(tiny, log, "--draft", "none", "--parallel", "1", *LIMITS) as (base, _):
        yield base


def test_an_unclosed_json_fence_is_parsed_in_linear_time():
    # the fence regex this replaced took ~3 s at 2,000 newlines, ~10 s at 3,000 (cubic)
    fmt = ToolFormat("hermes", "<tool_call>", "</tool_call>", names=("f",))
    for text in ("```json" + "\n" * 3000, "```json" + "\n" * 3000 + "{", "```" + " " * 3000 + "```"):
        t0 = time.perf_counter()
        assert fmt.parse(text) == (text, [])
        assert time.perf_counter() - t0 < 0.1
    assert fmt.parse('```json\n{"name": "f", "arguments": {"x": 1}}\n```')[1][0]["function"]["name"] == "f"


def test_a_reply_of_8000_newlines_in_an_open_fence_never_stalls_health(limited):
    body = {"messages": [{"role": "user", "content": "call f"}], "max_tokens": 8000, "temperature": 0,
            "tools": TOOLS, "grammar": 'root ::= "```json" [\\n]{8000} "{"'}  # the "{": text past the
    # newlines, so a parser that strips the reply still sees them all (c17f7cb: 1,500 held /health 1.0 s)
    gaps: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            httpx.get(f"{limited}/health", timeout=60)
            gaps.append(time.perf_counter() - t0)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    t0 = time.perf_counter()
    try:
        r = post(limited, "/v1/chat/completions", body)
    finally:
        done.set()
        prober.join(60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].count("\n") == 8000
    assert time.perf_counter() - t0 < 60
    assert gaps and max(gaps) < 0.5, max(gaps)


def test_a_foreign_host_name_is_refused_by_a_keyless_loopback_server(limited):
    port = limited.rsplit(":", 1)[1]
    r = httpx.get(f"{limited}/v1/models", headers={"Host": "rebind.attacker.example"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    for name in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert httpx.get(f"{limited}/v1/models", headers={"Host": name}).status_code == 200, name


def test_a_body_over_the_limit_gets_413_and_streams_keep_moving(limited):
    gaps: list[float] = []

    def stream() -> None:
        body = {**CHAT, "max_tokens": 1500, "temperature": 1.0, "stream": True}
        with httpx.stream("POST", f"{limited}/v1/chat/completions", json=body, timeout=60) as r:
            last = time.perf_counter()
            for _ in r.iter_lines():
                gaps.append(time.perf_counter() - last)
                last = time.perf_counter()

    streamer = threading.Thread(target=stream)
    streamer.start()
    time.sleep(0.3)
    big = json.dumps({"content": "a" * (50 * 2**20)}).encode()
    r = post(limited, "/tokenize", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    # without Content-Length (chunked): counted as it arrives
    chunked = httpx.post(f"{limited}/tokenize", content=iter([big[:2**20], big[2**20:2**21 + 10]]),
                         headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413, chunked.text
    streamer.join(60)
    assert len(gaps) > 100 and max(gaps) < 1.0, max(gaps)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": ["a"] * 5, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 5, "max_tokens": 1, "temperature": 1}, "n"),
    ("/v1/chat/completions", {**CHAT, "stop": ["x1", "x2", "x3", "x4", "x5"]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": ["y" * 17]}, "stop.0"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a"}] * 9}, "messages"),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS * 3}, "tools"),
    ("/v1/chat/completions", {**CHAT, "grammar": 'root ::= "' + "a" * 2000 + '"'}, "grammar"),
    ("/v1/chat/completions", {**CHAT, "json_schema": {"enum": ["a" * 2000]}}, "json_schema"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 4,
                      "stop_sequences": ["1", "2", "3", "4", "5"]}, "stop_sequences"),
    ("/v1/responses", {"input": [{"role": "user", "content": "a"}] * 9}, "input"),
    ("/infill", {"input_prefix": "a", "input_extra": [{"filename": "f", "text": "t"}] * 3, "n_predict": 2},
     "input_extra"),
])
def test_each_count_and_size_past_its_limit_is_a_400_naming_it(limited, path, body, param):
    r = post(limited, path, body)
    assert r.status_code == 400, r.text
    if path == "/v1/messages":
        assert r.json()["error"]["type"] == "invalid_request_error" and param in r.json()["error"]["message"]
    else:
        error = r.json()["error"]
        assert error["code"] == "limit_exceeded" and error["param"] == param, error
        assert "--limit" in error["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": "f"}},
     "tool_choice"),
    ("/v1/responses", {"input": [{"role": ["user"], "content": "hi"}]}, "input.0.role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi \ud800"}]}, "messages.0.content"),
    ("/infill", {"input_prefix": "a\ud800", "input_suffix": "b", "n_predict": 2}, "input_prefix"),
    ("/tokenize", {"content": "\udfff"}, "content"),
])
def test_inputs_that_were_500s_are_400s_naming_the_field(limited, path, body, param):
    r = post(limited, path, json.dumps(body))  # json.dumps writes the lone surrogate as its \\u escape
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert post(limited, "/v1/chat/completions", CHAT).status_code == 200  # and the server goes on


def test_requests_past_the_queue_limit_get_503_with_retry_after(limited):
    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {**CHAT, "max_tokens": 300, "temperature": 1.0}
            return await asyncio.gather(*(client.post(f"{limited}/v1/chat/completions", json=body)
                                          for _ in range(30)))

    responses = asyncio.run(flood())
    statuses = [r.status_code for r in responses]
    refused = [r for r in responses if r.status_code == 503]
    # at once, before any leaves the queue: the 4 it holds are served, the rest refused at once
    assert set(statuses) == {200, 503} and statuses.count(200) >= 4 and len(refused) >= 20, statuses
    assert refused and all(r.headers.get("retry-after") and r.json()["error"]["code"] == "queue_full"
                           for r in refused)
    assert metric(limited, 'specllama_requests_refused_total{reason="queue"}') >= len(refused)
    assert httpx.get(f"{limited}/health").json()["requests_queued"] == 0


@pytest.fixture(scope="module")
def streaming(tiny, tmp_path_factory):
    """Two slots, a send timeout of 2 s."""
    log = tmp_path_factory.mktemp("streaming") / "serve.log"
    with serve(tiny, log, "--draft", "none", "--parallel", "2", "--limit", "send_timeout=2",
               "--limit", "queue=16") as (base, _):
        yield base


def test_streams_nobody_reads_are_cancelled_and_their_memory_freed(streaming):
    port = int(streaming.rsplit(":", 1)[1])
    server = next(p for p in psutil.process_iter(["cmdline"]) if f"{port}" in (p.info["cmdline"] or [])
                  and "serve" in (p.info["cmdline"] or []))
    rss_start = server.memory_info().rss
    # each chunk carries 20 alternatives' logprobs: the stream outgrows the sockets' buffers
    body = json.dumps({**CHAT, "max_tokens": 1800, "temperature": 1.0, "stream": True, "logprobs": True,
                       "top_logprobs": 20}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    sockets = []
    n_streams = 3  # the two slots' wave and one queued behind it, which runs when a slot frees
    try:
        for _ in range(n_streams):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(request)
            sockets.append(s)  # and never read
        deadline, peak = time.monotonic() + 240, rss_start
        while time.monotonic() < deadline:
            peak = max(peak, server.memory_info().rss)
            health = httpx.get(f"{streaming}/health").json()
            if metric(streaming, 'specllama_requests_refused_total{reason="send_timeout"}') >= n_streams and \
                    health["requests_active"] == health["requests_queued"] == 0:
                break
            time.sleep(0.5)
        assert health["requests_active"] == 0 and health["requests_queued"] == 0, health
        assert metric(streaming, 'specllama_requests_refused_total{reason="send_timeout"}') == n_streams
        assert peak - rss_start < 200 * 2**20 and server.memory_info().rss - rss_start < 200 * 2**20
    finally:
        for s in sockets:
            s.close()
    assert post(streaming, "/v1/chat/completions", CHAT).status_code == 200


def test_a_blank_api_key_is_refused_before_anything_loads(tiny):
    for args, env in ((["--api-key", ""], {}), (["--api-key", "k", "--api-key", " "], {}),
                      ([], {"SPECLLAMA_API_KEY": "  "})):
        done = subprocess.run([sys.executable, "-m", "specllama", "serve", str(tiny), *args], capture_output=True,
                              text=True, timeout=60, env={**_environ(), **env})
        assert done.returncode == 2 and "API key is empty or blank" in done.stderr, (args, env, done.stderr)
    with pytest.raises(ValueError, match="empty or blank"):
        create_app(lambda: None, "m", api_key=["ok", ""])
    with pytest.raises(ValueError, match="--limit 'queue=0'"):
        ServerLimits.parse(["queue=0"])
    with pytest.raises(ValueError, match="NAME one of body_mb"):
        ServerLimits.parse(["bodymb=3"])


def _environ() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "SPECLLAMA_API_KEY"}


def test_one_key_s_cached_prompt_never_shows_in_another_key_s_cached_tokens(tiny, tmp_path_factory):
    log = tmp_path_factory.mktemp("keyed") / "serve.log"
    body = {"messages": [{"role": "system", "content": "a private system prompt " * 30},
                         {"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    with serve(tiny, log, "--draft", "none", "--api-key", "alpha", "--api-key", "beta") as (base, _):
        cached = {}
        for key in ("alpha", "beta", "alpha", "beta"):
            r = post(base, "/v1/chat/completions", body, key=key)
            assert r.status_code == 200, r.text
            cached.setdefault(key, []).append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached["alpha"][0] == 0 and cached["beta"][0] == 0  # alpha's prompt did not serve beta
        assert cached["alpha"][1] > 100 and cached["beta"][1] > 100  # each key's own prompt comes back
        assert httpx.get(f"{base}/v1/models", headers={"Host": "any.example",
                                                       "Authorization": "Bearer beta"}).status_code == 200
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer gamma"}).status_code == 401


@pytest.mark.skipif(not supports_rpc(), reason="this llama.cpp build has no RPC backend")
def test_health_reports_a_lost_rpc_worker_until_a_restart(tiny, tmp_path):
    from test_rpc import workers

    with workers(1) as (endpoints, procs), serve(tiny, tmp_path / "serve.log", "--draft", "none",
                                                 "--rpc", endpoints[0]) as (base, _):
        assert post(base, "/v1/chat/completions", CHAT).status_code == 200
        procs[0].kill()
        procs[0].wait()
        r = post(base, "/v1/chat/completions", CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_lost", r.text
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and endpoints[0] in health.json()["error"], health.text
        again = post(base, "/v1/chat/completions", CHAT)  # refused at once, not tried on a dead host
        assert again.status_code == 503 and again.json()["error"]["code"] == "model_lost"
