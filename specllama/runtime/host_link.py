"""The parent's end of a RemoteRuntime's host process: starting it, one call and its reply at a
time over a pipe, and telling a lost RPC worker (the host ended) from an error the host raised
(rebuilt here as the same type)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Pipe
from typing import Any, Callable, Optional

from ..errors import RpcError
from .rpc import check_reachable, unreachable
from .settings import ModelSettings

_POLL_SECONDS = 0.1


class Host:
    """The process hosting a RemoteRuntime's model, and the pipe to it. A lost worker ends that
    process (ggml-rpc aborts), not this one: its calls then raise RpcError naming the worker."""

    def __init__(self, settings: ModelSettings, on_shut: Callable[[], None]):
        self.endpoints, self.timeout, self.on_shut = settings.rpc, settings.rpc_timeout, on_shut
        self.name = "model"
        self.closed: Optional[str] = None  # why, once closed
        check_reachable(self.endpoints)
        self._log = tempfile.TemporaryFile()  # the host's output: llama.cpp's last words if it dies
        parent, child = Pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # its own session: a Ctrl-C meant for the caller reaches the caller, who then rolls back
        entry = "import sys; from specllama.runtime.remote_host import host_main; host_main(int(sys.argv[1]))"
        self._proc = subprocess.Popen([sys.executable, "-c", entry, str(child.fileno())],
                                      pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=self._log, start_new_session=True, env=env)
        child.close()
        self._conn = parent
        # one request and its reply at a time: tokenize() from a request's thread must not
        # interleave on the pipe with the idle thread's probe
        self._turn = threading.RLock()

    def call(self, op: str, *args: Any, timeout: Optional[float] = None) -> Any:
        with self._turn:
            return self._call(op, *args, timeout=timeout)

    def _call(self, op: str, *args: Any, timeout: Optional[float] = None) -> Any:
        if self.closed is not None:
            raise RpcError(self.closed, self.endpoints)
        try:
            self._conn.send((op, *args))
        except OSError:
            raise self._lost() from None
        try:
            reply = self._reply(timeout or self.timeout)
        except RpcError:
            raise
        except BaseException:
            # interrupted while the host works: let it finish, so the next call is answered in turn
            try:
                self._reply(self.timeout)
            except BaseException:
                self._shut(kill=True, reason=f"{self.name} was closed: interrupted while its host was busy")
            raise
        if reply[0] == "error":
            raise rebuild(*reply[1:])
        return reply[1]

    def _reply(self, timeout: float) -> tuple:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(_POLL_SECONDS):
            if self._proc.poll() is not None:
                break  # its end of the pipe is closed; recv says so
            if time.monotonic() > deadline:
                raise self._lost(f"no answer within {timeout:g} s (rpc_timeout)")
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise self._lost() from None

    def _lost(self, reason: Optional[str] = None) -> RpcError:
        self._shut(kill=True)
        status = self._proc.returncode
        down = {endpoint: why for endpoint in self.endpoints if (why := unreachable(endpoint, 1.0))}
        if down:
            message = (f"lost the RPC worker{'s' if len(down) > 1 else ''} "
                       + ", ".join(f"{endpoint} ({why})" for endpoint, why in down.items())
                       + f" holding {self.name}'s layers")
        else:
            message = (f"the process hosting {self.name} (workers {', '.join(self.endpoints)}) "
                       f"ended with status {status}")
        if reason:
            message += f": {reason}"
        said = self._last_words()
        if said:
            message += f"; llama.cpp said: {said}"
        message += f". {self.name} is closed: start the worker again and load() again"
        self.closed = message
        return RpcError(message, tuple(down) or self.endpoints)

    def _last_words(self) -> str:
        try:
            self._log.seek(0, os.SEEK_END)
            self._log.seek(max(0, self._log.tell() - 4096))
            lines = [ln.strip() for ln in self._log.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except (OSError, ValueError):
            return ""
        return " | ".join(lines[-3:])[-600:]

    def _shut(self, *, kill: bool, reason: str = "") -> None:
        if self.closed is None:
            self.closed = reason or f"{self.name} was closed"
        if self._proc.poll() is None:
            if not kill:
                try:
                    self._conn.send(("close",))
                    self._proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
        self._conn.close()
        self.on_shut()

    def close(self) -> None:
        if self.closed is None:
            self._shut(kill=False)
        self._log.close()

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None and getattr(self, "_closed", "") is None:
            try:
                self._shut(kill=True)
            except Exception:  # at interpreter exit the modules it needs may be gone already
                pass


def rebuild(module: str, qualname: str, message: str) -> BaseException:
    """The host's exception, as the same type where it is importable here."""
    cls: Any = sys.modules.get(module)
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return RuntimeError(f"{qualname}: {message}")
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error
