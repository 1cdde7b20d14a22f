"""A TCP relay between a specllama RPC client and a worker that delays every byte by a fixed
one-way latency and counts the traffic: bytes each way and "turns" (the client waiting on a
reply after sending). It turns a loopback worker into one across a network of a chosen round
trip time, so the scaling model in the README can be checked against a measurement.
"""

from __future__ import annotations

import heapq
import socket
import threading
import time
from dataclasses import dataclass


@dataclass
class Traffic:
    sent: int = 0  # client -> worker bytes
    received: int = 0  # worker -> client bytes
    turns: int = 0  # worker -> client bursts that follow client -> worker data: round trips


class Relay:
    """Listen on 127.0.0.1:port and forward each connection to target with one_way seconds of
    latency in each direction (the bandwidth of loopback is kept)."""

    def __init__(self, target: tuple[str, int], one_way: float = 0.0):
        self.target, self.one_way = target, one_way
        self.traffic = Traffic()
        self._last = "received"
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            worker = socket.create_connection(self.target)
            for s in (client, worker):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for src, dst, way in ((client, worker, "sent"), (worker, client, "received")):
                threading.Thread(target=self._pump, args=(src, dst, way), daemon=True).start()

    def _count(self, way: str, n: int) -> None:
        with self._lock:
            setattr(self.traffic, way, getattr(self.traffic, way) + n)
            if way == "received" and self._last == "sent":
                self.traffic.turns += 1
            self._last = way

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        queue: list = []  # (due time, seq, data): sent when due, in order
        ready = threading.Condition()
        closed = []

        def send_when_due() -> None:
            while True:
                with ready:
                    while not queue and not closed:
                        ready.wait()
                    if not queue:  # pass the end on as a half-close: a reader blocked on dst wakes up
                        try:
                            dst.shutdown(socket.SHUT_WR)
                        except OSError:
                            pass
                        return
                    due, _, data = queue[0]
                    wait = due - time.monotonic()
                    if wait > 0:
                        ready.wait(wait)
                        continue
                    heapq.heappop(queue)
                try:
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=send_when_due, daemon=True).start()
        seq = 0
        while True:
            try:
                data = src.recv(1 << 20)
            except OSError:
                data = b""
            with ready:
                if not data:
                    closed.append(True)
                    ready.notify()
                    return
                self._count(way, len(data))
                heapq.heappush(queue, (time.monotonic() + self.one_way, seq, data))
                seq += 1
                ready.notify()

    def reset(self) -> Traffic:
        with self._lock:
            out, self.traffic = self.traffic, Traffic()
            return out

    def close(self) -> None:
        self._server.close()
