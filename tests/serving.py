"""Start a real `specllama serve` on a free 127.0.0.1 port for a test module, and stop it."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import httpx

from conftest import SETTINGS
from specllama.measuring.idle import PROCESS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(target: Path, log: Path, *args: str, timeout: float = 180,
          started: Optional[list] = None) -> Iterator[tuple[str, list[int]]]:
    """The server process with these extra arguments; yields (base url, /health statuses seen
    while it started); its Popen is appended to `started` if given. Always stopped at the end
    (SIGTERM, then SIGKILL after 15 s), also when the test fails."""
    port = free_port()
    cmd = [sys.executable, "-m", "specllama", "serve", str(target), "--ctx", str(SETTINGS["n_ctx"]),
           "--threads", str(SETTINGS["n_threads"]), "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    if started is not None:
        started.append(proc)
    base, seen = f"http://127.0.0.1:{port}", []
    try:
        with PROCESS.busy():  # this process's idle work waits while the server loads and measures
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()
                try:
                    seen.append(httpx.get(f"{base}/health", timeout=5).status_code)
                except httpx.TransportError:
                    pass
                if seen and seen[-1] == 200:
                    break
                time.sleep(0.05)
        assert seen and seen[-1] == 200, log.read_text()
        yield base, seen
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def post(base: str, path: str, body: Any, key: Optional[str] = None, timeout: float = 120,
         headers: Optional[dict] = None) -> httpx.Response:
    """POST a body as given: a dict as JSON, a str or bytes as they are (malformed on purpose)."""
    sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
            **(headers or {})}
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{base}{path}", content=data, headers=sent, timeout=timeout)


def metric(base: str, name: str, key: Optional[str] = None) -> float:
    """One value from /metrics (0 when the series does not exist yet)."""
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    return 0.0
