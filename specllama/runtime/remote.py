"""A model whose layers live on llama.cpp RPC workers, hosted in a child process of its own.

ggml-rpc ends the process it runs in when a worker cannot be reached or stops answering
(GGML_ABORT in ggml-rpc.cpp), and waits without limit on a silent network. So a model with
RPC workers is loaded by a host process, and RemoteRuntime drives it with Runtime's
interface: a lost worker ends the host, not the caller, and becomes an RpcError that names
the worker. Logit rows come back through a memory-mapped file both processes share, so a
verify batch costs one copy of its rows, not a pickle.

The host is a Python process running remote_host.host_main(FD); it runs Runtime's own code,
so this module calls no llama_cpp function itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Pipe
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np

from ..errors import InvalidParameterError, RpcError
from ..limits import MAX_ROWS
from ..tree import Tree
from . import session
from .ggml import MemoryUse
from .rpc import check_reachable, unreachable
from .settings import Device, ModelSettings
from .state import PrefillRow, SavedState

HANDSHAKE_TIMEOUT = 30.0  # seconds for the workers to answer llama.cpp's hello and report their devices
_POLL_SECONDS = 0.1


class RemoteRuntime:
    """A protocols.Model for a model loaded in a host process, its layers on RPC workers.

    Build with RemoteRuntime(settings), which checks the workers and connects the host to them
    (`devices` then lists what they report, for the memory plan), then load(path).
    """

    n_branches = 1  # the host verifies chains: tree batches stay on local models
    n_pending = 0
    mtp_head = None
    mtp_note = "a model on RPC workers cannot load its MTP layers here"
    follows_target = False
    batch_cap = 1  # one context in the host: no lanes
    n_batch_rows = 0  # unknown: the round's own rows
    n_batch_lanes = 1
    t_waited = 0.0
    t_waited_total = 0.0
    n_lanes_active = 1
    n_room = 1

    def __init__(self, settings: ModelSettings):
        self.settings = settings
        self.n_threads = settings.threads[0]  # the host's (the layers decode on the workers' own)
        self.endpoints = settings.rpc
        self.name = "model"
        self.cached: list[int] = []
        self.n_canonical = 0
        self.prefill_row: Optional[PrefillRow] = None
        self._pinned: Optional[np.ndarray] = None
        self._n_rows = 0
        self._rows: Optional[np.memmap] = None
        self._rows_path: Optional[str] = None
        self._pieces: dict[int, bytes] = {}
        self._texts: Optional[list[bytes]] = None
        self._eog: dict[int, bool] = {}
        self.n_replayed, self.t_rollback = 0, 0.0  # the host's own; not reported here
        # facts the host sends once the model is loaded
        self.identity, self.n_ctx, self.n_vocab, self.n_batch = "", 0, 0, 0
        self.memory_use: Optional[MemoryUse] = None
        self.memory, self.rollback, self.max_verify = "attention", "seq_rm", 0
        self.vocab_type, self.bos, self.eos, self.add_bos, self.add_eos = 0, -1, -1, False, False
        self._chat_template: Optional[str] = None
        self._host = _Host(settings, on_shut=self._drop_rows)
        self._call = self._host.call
        try:
            self.devices: list[Device] = self._call("connect", self.endpoints, timeout=HANDSHAKE_TIMEOUT)
        except RpcError as exc:
            self.close()
            if "no answer within" in str(exc):  # reachable, yet silent: a worker serves one client at a time
                raise RpcError(f"the RPC workers {', '.join(self.endpoints)} accept connections but did not answer "
                               f"llama.cpp's handshake within {HANDSHAKE_TIMEOUT:g} s. A worker serves one client "
                               "at a time: is another process using one of them? Stop it, or start another worker",
                               self.endpoints) from None
            raise
        except BaseException:
            self.close()
            raise

    def load(self, path: Union[str, os.PathLike]) -> "RemoteRuntime":
        """Load the model in the host; its offloaded layers go to the workers."""
        self.name = self._host.name = Path(path).name
        try:
            facts = self._call("load", str(path), self.settings)
        except BaseException:
            self.close()
            raise
        self._chat_template = facts.pop("chat_template")
        for key, value in facts.items():  # remote_host._FACTS: what Runtime knows of its model
            setattr(self, key, value)
        return self

    def _drop_rows(self) -> None:
        self._rows = None
        if self._rows_path is not None:
            Path(self._rows_path).unlink(missing_ok=True)
            self._rows_path = None

    def close(self) -> None:
        self._host.close()

    @property
    def _closed(self) -> Optional[str]:
        return self._host.closed

    def __enter__(self) -> "RemoteRuntime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- protocols.Model ------------------------------------------------------------------------

    def flush_pending(self) -> None:
        pass  # no trees here: the cache always holds one sequence

    def pending_rows(self, n_max: int) -> int:
        return 0

    def decode_tree(self, root: int, tokens: Sequence[int], tree: Tree) -> None:
        raise ValueError("a model on RPC workers verifies chains: n_branches is 1")

    def revisit(self) -> None:
        """The host's runtime keeps its own checkpoints; tell it decoding may come back here."""
        if self.memory != "attention":
            self._call("call", "revisit", (), {})

    def sync(self, tokens: Sequence[int]) -> None:
        session.sync(self, tokens)

    def prefill(self, tokens: Sequence[int], n_reuse: int) -> int:
        return session.prefill(self, tokens, n_reuse)

    def pin(self, row: np.ndarray) -> None:
        self._n_rows, self._pinned = 1, row

    def decode(self, tokens: Sequence[int], *, n_logits: int = 1, aligned: bool = False) -> None:
        """As Runtime.decode; the rows land in the shared file."""
        n_past = len(self.cached)
        if not tokens:
            raise ValueError("decode needs at least one token")
        self._n_rows, self._pinned = 0, None
        capacity = self._ensure_rows(n_logits)
        try:
            self._call("decode", list(tokens), n_logits, self._rows_path, capacity, aligned)
        except BaseException:
            if self._closed is None:  # the host may have decoded before the interruption: undo it
                self._call("truncate", n_past)
            raise
        self._n_rows = n_logits
        self.cached.extend(tokens)

    def _ensure_rows(self, n_rows: int) -> int:
        if self._rows is None or self._rows.shape[0] < n_rows:
            capacity = max(n_rows, MAX_ROWS)  # a verify batch with a tree's siblings
            shm = "/dev/shm"
            fd, path = tempfile.mkstemp(prefix="specllama-rows-", dir=shm if os.path.isdir(shm) else None)
            os.ftruncate(fd, capacity * self.n_vocab * 4)
            os.close(fd)
            if self._rows_path is not None:
                Path(self._rows_path).unlink(missing_ok=True)
            self._rows = np.memmap(path, np.float32, "r+", shape=(capacity, self.n_vocab))
            self._rows_path = path
        return self._rows.shape[0]

    def logits(self, row: int) -> np.ndarray:
        """View of logit row `row` of the last decode; valid until the next decode."""
        if not 0 <= row < self._n_rows:
            raise IndexError(f"logit row {row} was not requested by the last decode ({self._n_rows} rows)")
        if self._pinned is not None:
            return self._pinned
        assert self._rows is not None  # a decode with rows ran
        return self._rows[row]

    def truncate(self, n_keep: int, path: Optional[Sequence[int]] = None) -> None:
        if path is not None:
            raise ValueError("a model on RPC workers verifies chains: there is no tree path to keep")
        if n_keep >= len(self.cached):
            return
        self._call("truncate", n_keep)
        self._kept(n_keep)

    def n_reachable(self, n_keep: int) -> int:
        if self.memory == "attention" or n_keep >= len(self.cached):
            return min(n_keep, len(self.cached))
        return self._call("call", "n_reachable", (n_keep,), {})

    def discard(self, n_keep: int) -> None:
        """As Runtime.discard: the host says how many tokens its memory kept."""
        if n_keep < len(self.cached):
            self._kept(self._call("discard", n_keep))

    def _kept(self, n_keep: int) -> None:
        del self.cached[n_keep:]
        self.n_canonical = min(self.n_canonical, n_keep)
        if self.prefill_row is not None and n_keep < self.prefill_row.n_tokens:
            self.prefill_row = None
        self._n_rows = 0

    def save_state(self) -> SavedState:
        """As Runtime.save_state: the bytes come over from the host; the bookkeeping is ours,
        since prefills run here (Runtime.prefill over this class's decode)."""
        saved = self._call("call", "save_state", (), {})
        saved.n_canonical, saved.prefill_row = self.n_canonical, self.prefill_row
        return saved

    def restore_state(self, saved: SavedState) -> None:
        self._n_rows, self._pinned = 0, None
        try:
            self._call("call", "restore_state", (saved,), {})
        except BaseException:
            self.cached, self.n_canonical, self.prefill_row = [], 0, None  # the host cleared its sequence
            raise
        self.cached, self.n_canonical, self.prefill_row = list(saved.tokens), saved.n_canonical, saved.prefill_row

    def tokenize(self, text: Union[str, bytes], *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self._call("call", "tokenize", (text,), {"add_special": add_special, "parse_special": parse_special})

    def piece(self, token: int) -> bytes:
        if token not in self._pieces:
            self._pieces[token] = self._call("call", "piece", (token,), {})
        return self._pieces[token]

    def token_text(self, token: int) -> bytes:
        if self._texts is None:  # one call for the whole vocabulary: the draft check reads it all
            self._texts = self._call("token_texts")
        return self._texts[token] if 0 <= token < len(self._texts) else b""

    def is_eog(self, token: int) -> bool:
        if token not in self._eog:
            self._eog[token] = self._call("call", "is_eog", (token,), {})
        return self._eog[token]

    def chat_template(self) -> Optional[str]:
        return self._chat_template

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None) -> str:
        return self._call("call", "apply_chat_template", (messages,),
                          {"add_generation_prompt": add_generation_prompt, "tools": tools})

    def grammar_tokenizer(self) -> Any:
        """Grammars need the vocabulary in this process (llguidance reads llama.cpp's tokenizer)."""
        raise InvalidParameterError("grammar", "...", "used with a target on this machine; a target on RPC "
                                    "workers takes no grammar, JSON schema or required tool call yet")

    def fim_tokens(self) -> dict[str, int]:
        return self._call("call", "fim_tokens", (), {})


class _Host:
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
