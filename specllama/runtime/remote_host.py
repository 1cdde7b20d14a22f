"""The host process of a RemoteRuntime: it loads one model with its layers on RPC workers and
runs Runtime's own code on it, answering the caller over a pipe. ggml-rpc may end this process
(a lost worker); the caller then reports which worker went."""

from __future__ import annotations

import signal
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .core import Runtime
from .ggml import devices
from .rpc import add_rpc_workers


_FACTS = ("name", "identity", "n_ctx", "n_vocab", "n_batch", "memory_use", "vocab_type", "bos", "eos",
          "add_bos", "add_eos", "n_params", "model_bytes", "memory", "rollback", "max_verify")


def _serve(conn: Connection) -> None:
    runtime: Any = None  # the model, once loaded
    rows: Any = None  # the logit rows file the caller reads
    rows_path = None
    while True:
        try:
            op, *args = conn.recv()
        except (EOFError, OSError):
            return  # the caller is gone
        try:
            value: Any = None
            if op == "connect":
                add_rpc_workers(args[0])
                value = devices()
            elif op == "load":
                runtime = Runtime.load(args[0], args[1])
                value = {key: getattr(runtime, key) for key in _FACTS}
                value["chat_template"] = runtime.chat_template()
            elif op == "decode":
                tokens, n_logits, path, capacity, aligned = args
                if path != rows_path:
                    rows, rows_path = np.memmap(path, np.float32, "r+", shape=(capacity, runtime.n_vocab)), path
                runtime.decode(tokens, n_logits=n_logits, aligned=aligned)
                for i in range(n_logits):
                    rows[i] = runtime.logits(i)
            elif op == "truncate":
                runtime.truncate(args[0])
            elif op == "discard":
                runtime.discard(args[0])
                value = len(runtime.cached)
            elif op == "token_texts":
                value = [runtime.token_text(i) for i in range(runtime.n_vocab)]
            elif op == "call":
                name, call_args, call_kwargs = args
                value = getattr(runtime, name)(*call_args, **call_kwargs)
            elif op == "close":
                if runtime is not None:
                    runtime.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown host operation {op!r}")
        except Exception as exc:  # every failure goes back to the caller, typed
            conn.send(("error", type(exc).__module__, type(exc).__qualname__, str(exc)))
        else:
            conn.send(("ok", value))


def host_main(fd: int) -> None:
    """The host process: serve one model over the connection on fd until told to close."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller decides when to stop
    _serve(Connection(fd))
