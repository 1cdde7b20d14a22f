"""The target on llama.cpp RPC workers (real `specllama worker` processes on 127.0.0.1), the
draft local: same output as the target loaded locally, and a lost worker is a clear error."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
import psutil
import pytest

import specllama
from specllama import runtime
from specllama.measuring.fidelity import top_gap
from specllama.errors import InvalidParameterError, RpcError
from specllama.models.plan import device_shares, make_plan
from specllama.runtime.rpc import check_reachable
from specllama.runtime import Device, ModelSettings, offload_devices, parse_endpoints

from conftest import SETTINGS
from prompts import CODE
from test_long_context import first_difference

pytestmark = pytest.mark.children  # each test waits on a llama.cpp child

needs_rpc = pytest.mark.skipif(not runtime.supports_rpc(), reason=runtime.NO_RPC_BUILD)
N_TOKENS = 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def workers(n: int, ports: list[int] | None = None):
    """n `specllama worker` processes on free 127.0.0.1 ports; yields their endpoints and processes."""
    ports = ports or [free_port() for _ in range(n)]
    procs = [subprocess.Popen([sys.executable, "-m", "specllama", "worker", "--port", str(port), "--threads", "2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for port in ports]
    endpoints = [f"127.0.0.1:{port}" for port in ports]
    try:
        for proc in procs:  # ready once it has said where it listens (in a thread: a mute one would block)
            said = threading.Event()
            threading.Thread(target=_wait_for_line, args=(proc, b"listening on", said), daemon=True).start()
            assert said.wait(60), "the worker said nothing of listening within 60 s"
            assert proc.poll() is None, f"worker exited with {proc.returncode}"
        yield endpoints, procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _wait_for_line(proc: subprocess.Popen, text: bytes, said: threading.Event) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        if text in line:
            said.set()
            return


def interrupted_then_again(llm, prompt):
    """SIGINT this process a moment into a round of a running generation (while the host is
    decoding, most likely), then generate again."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            for i, _ in enumerate(llm.stream(prompt, max_tokens=N_TOKENS, n_draft=0)):
                if i == 2:
                    threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGINT)).start()
                if i > 2:
                    time.sleep(0.5)  # the signal lands during the next round's decode at the latest
    finally:
        signal.signal(signal.SIGINT, previous)
    return llm.generate(prompt, max_tokens=N_TOKENS, exact="bitwise")


# --- pure parts -------------------------------------------------------------------------------

def test_endpoints_are_parsed_and_bad_ones_named():
    assert parse_endpoints("10.0.0.2:50052, 10.0.0.3:50053") == ("10.0.0.2:50052", "10.0.0.3:50053")
    assert parse_endpoints(["h:1"]) == ("h:1",)
    assert ModelSettings(rpc="h:7").rpc == ("h:7",)
    for bad in ("nohost", "h:0", "h:70000", ":50052", "h:port"):
        with pytest.raises(InvalidParameterError, match="host:port"):
            ModelSettings(rpc=bad)
    with pytest.raises(InvalidParameterError, match="tensor_split"):
        ModelSettings(tensor_split="1,-1")
    assert ModelSettings(tensor_split="3,1").tensor_split == (3.0, 1.0)


def test_offload_shares_follow_free_memory_or_the_split():
    gib = 2**30
    found = [Device("CPU", "cpu", "cpu", 20 * gib, 24 * gib),
             Device("RPC0", "a:1", "gpu", 30 * gib, 32 * gib, "a:1"),
             Device("RPC1", "b:2", "gpu", 10 * gib, 32 * gib, "b:2")]
    devs = offload_devices(found, ["b:2", "a:1"])
    assert [d.name for d in devs] == ["RPC1", "RPC0"]  # in the order the workers are named
    devs = offload_devices(found, ["a:1", "b:2"])

    class Model:
        gpu = 8 * gib

    by_free = device_shares(Model, devs, None)
    assert [s.need for s in by_free] == [6 * gib, 2 * gib]
    by_split = device_shares(Model, devs, (1.0, 3.0))
    assert [s.need for s in by_split] == [2 * gib, 6 * gib]


def test_the_plan_checks_each_worker(model_paths):
    gib = 2**30
    small = [Device("RPC0", "a:1", "gpu", gib // 4, gib, "a:1"), Device("RPC1", "b:2", "gpu", 8 * gib, 8 * gib, "b:2")]
    settings = ModelSettings(n_ctx=2048, rpc=("a:1", "b:2"), tensor_split=(1.0, 1.0))
    memory = make_plan(model_paths["target"], model_paths["draft"], settings, ModelSettings(n_ctx=2048),
                       target_devices=small, available=64 * gib)
    assert not memory.fits
    assert "RPC0 (a:1)" in memory.describe() and memory.shares[0].short > 0 and memory.shares[1].short == 0
    # by free memory instead, the small worker takes a small share and it fits
    memory = make_plan(model_paths["target"], None, ModelSettings(n_ctx=2048, rpc=("a:1", "b:2")),
                       target_devices=small, available=64 * gib)
    assert memory.fits
    # the target's offloaded weights are not counted against this machine's RAM
    assert memory.target.remote and memory.needed_ram < memory.target.total / 2


def test_an_unreachable_worker_is_named_at_once():
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(RpcError, match=f"127.0.0.1:{port}.*specllama worker") as info:
        check_reachable([f"127.0.0.1:{port}"])
    assert info.value.endpoints == (f"127.0.0.1:{port}",)
    assert time.monotonic() - t0 < 5


# --- real workers -----------------------------------------------------------------------------

@needs_rpc
def test_target_on_two_workers_matches_the_local_target(model_paths):
    """SmolLM2 drafting for itself: how a target's layers go to workers and come back in step does
    not depend on the pair (the Qwen target's 1.1 GB over loopback, and its verify-limit probe on
    the workers, were 13 s of the suite)."""
    smol = model_paths["smollm2"]
    with specllama.load(smol, exact="bitwise", **SETTINGS) as local_llm:
        prompt = local_llm.tokenize(CODE)
        local = local_llm.generate(prompt, max_tokens=N_TOKENS)
        local_target = local_llm.target
        with workers(2) as (endpoints, procs):
            rss_workers = sum(psutil.Process(p.pid).memory_info().rss for p in procs)
            with specllama.load(smol, smol, n_draft=4, rpc=endpoints, **SETTINGS) as llm:
                assert [d.rpc_endpoint for d in llm.target.devices if d.rpc_endpoint] == endpoints
                # the weights went to the workers: their memory grew by more than half the model's
                # bytes (155 MB for 97 here, KV included; the host's own growth says little for a
                # 135M model, whose token embeddings and buffers stay on the host: 51 MB)
                grown = sum(psutil.Process(p.pid).memory_info().rss for p in procs) - rss_workers
                assert grown > llm.target.model_bytes / 2, (grown, llm.target.model_bytes)
                assert llm.draft.__class__.__name__ == "Runtime"  # the draft stayed in this process
                plain = llm.generate(prompt, max_tokens=N_TOKENS, n_draft=0)
                spec = llm.generate(prompt, max_tokens=N_TOKENS, exact="bitwise")
                # a Ctrl-C while the host decodes leaves this process and the host in step
                after = interrupted_then_again(llm, prompt)
                # and that is the local target's output, up to the kernels. Not bitwise when quantized:
                # weights in RPC buffers are not repacked, so another kernel runs (F16 rows are
                # bitwise equal). Where the two first differ, the local row's top two logits must
                # be closer than twice what the two backends' rows for the same tokens differ by
                # there, on this machine (on one Intel CPU no choice of this prompt was that close;
                # on an AVX-512 EPYC the 11th token was)
                first = first_difference(plain.tokens, local.tokens)
                if first is not None:
                    seq = prompt + local.tokens[:first]
                    llm.target.sync(seq)
                    remote_row = llm.target.logits(0).copy()
                    local_target.sync(seq)
                    local_row = local_target.logits(0).copy()
                    d = float(np.max(np.abs(remote_row - local_row)))
                    assert top_gap(local_row) <= 2 * d, (first, top_gap(local_row), d)
        # fidelity is to the target as it runs here, on the workers: bitwise its own plain decoding
        assert spec.tokens == plain.tokens and after.tokens == plain.tokens
        assert spec.stats.n_drafted > 0


@needs_rpc
def test_unreachable_worker_fails_load_with_its_name(model_paths):
    dead = f"127.0.0.1:{free_port()}"
    with workers(1) as (endpoints, _):
        t0 = time.monotonic()
        with pytest.raises(RpcError, match=dead):
            specllama.load(model_paths["target"], rpc=[endpoints[0], dead], **SETTINGS)
        assert time.monotonic() - t0 < 10


@needs_rpc
def test_a_killed_worker_is_a_clear_error_and_a_fresh_load_works(tiny_paths):
    # the tiny attention model as target and draft: the fault is the worker's, not the model's
    prompt, tiny = "def fibonacci(n):", tiny_paths["attention-draft"]
    with workers(2) as (endpoints, procs):
        llm = specllama.load(tiny, tiny, rpc=endpoints, **SETTINGS)
        first = llm.generate(prompt, max_tokens=8)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        t0 = time.monotonic()
        with pytest.raises(RpcError, match=endpoints[1]) as info:
            llm.generate(prompt, max_tokens=64)
        assert time.monotonic() - t0 < 10
        assert endpoints[1] in info.value.endpoints and endpoints[0] not in info.value.endpoints
        with pytest.raises(RpcError, match="load"):  # closed, and says so at once
            llm.generate(prompt, max_tokens=8)
        llm.close()
    with workers(2) as (endpoints, _):
        with specllama.load(tiny, tiny, rpc=endpoints, **SETTINGS) as llm:
            again = llm.generate(prompt, max_tokens=8)
    assert again.tokens == first.tokens


@needs_rpc
def test_worker_on_a_busy_port_says_so():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "specllama", "worker", "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr


@needs_rpc
def test_worker_warns_off_loopback():
    # 192.0.2.1 is a documentation address no machine has: the warning, then a clean failure
    out = subprocess.run([sys.executable, "-m", "specllama", "worker", "--host", "192.0.2.1", "--port", "50052"],
                         capture_output=True, text=True, timeout=60)
    assert "no authentication" in out.stderr
    assert out.returncode != 0 and "cannot listen on 192.0.2.1:50052" in out.stderr


@needs_rpc
def test_the_draft_on_a_worker_of_its_own(model_paths, pair):
    prompt = pair.tokenize(CODE)
    local = pair.generate(prompt, max_tokens=24, n_draft=4)
    with workers(1) as (endpoints, _):
        with specllama.load(model_paths["target"], model_paths["draft"], n_draft=4, draft_rpc=endpoints,
                            **SETTINGS) as llm:
            assert llm.draft.endpoints == tuple(endpoints) and not hasattr(llm.target, "endpoints")
            out = llm.generate(prompt, max_tokens=24)
    assert out.tokens == local.tokens and out.stats.n_drafted == local.stats.n_drafted
