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
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import numpy as np

from ..errors import InvalidParameterError, RpcError
from ..decoding.limits import MAX_ROWS
from ..decoding.tree import Tree
from . import session
from .ggml import MemoryUse
from .host_link import Host
from .protocols import Beside, Pass, Progress, SlotUnavailable
from .settings import Device, ModelSettings
from .state import PrefillRow, SavedState

HANDSHAKE_TIMEOUT = 30.0  # seconds for the workers to answer llama.cpp's hello and report their devices


T = TypeVar("T")


class RemoteRuntime:
    """A protocols.Model for a model loaded in a host process, its layers on RPC workers.

    Build with RemoteRuntime(settings), which checks the workers and connects the host to them
    (`devices` then lists what they report, for the memory plan), then load(path).
    """

    n_branches = 1  # the host verifies chains: tree batches stay on local models
    n_pending = 0
    mtp_head = None
    n_seq = 1  # one sequence a context: chains only
    path: Optional[Path] = None  # the GGUF file, once loaded
    mtp_note = "a model on RPC workers cannot load its MTP layers here"
    follows_target = False
    t_waited_total = 0.0  # one context in the host: no lanes to wait for

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
        self._host = Host(settings, on_shut=self._drop_rows)
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
        self.path = Path(path)
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

    @property
    def why_no_sibling(self) -> str:
        return f"{self.name} is hosted by another process (RPC), which serves one context"

    def passing_turns(self, beside: Optional[Beside], n_piece: int = 0) -> AbstractContextManager[None]:
        return nullcontext()  # the host decodes every batch in one call: nothing to pass the turn between

    def drafting(self, steps: Callable[..., T], *args: Any) -> T:
        return steps(*args)  # the host decodes in its own process: no hand-off here to spare

    def sibling(self) -> "RemoteRuntime":
        raise SlotUnavailable(self.why_no_sibling)

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

    def decode_tree(self, root: int, tokens: Sequence[int], tree: Tree, cap: Optional[int] = None) -> Pass:
        raise ValueError("a model on RPC workers verifies chains: n_branches is 1")

    def revisit(self) -> None:
        """The host's runtime keeps its own checkpoints; tell it decoding may come back here."""
        if self.memory != "attention":
            self._call("call", "revisit", (), {})

    def sync(self, tokens: Sequence[int]) -> None:
        session.sync(self, tokens)

    def prefill(self, tokens: Sequence[int], n_reuse: int, progress: Optional[Progress] = None) -> int:
        return session.prefill(self, tokens, n_reuse, progress)

    def pin(self, row: np.ndarray) -> None:
        self._n_rows, self._pinned = 1, row

    def decode(self, tokens: Sequence[int], *, n_logits: int = 1, aligned: bool = False,
               progress: Optional[Progress] = None, cap: Optional[int] = None) -> Pass:
        """As Runtime.decode; the rows land in the shared file (progress is told once, at the end:
        the host decodes every batch in one call, in a context of its own: cap does not apply,
        and its last pass is taken to hold the decode's last n_batch tokens or fewer)."""
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
        if progress is not None:
            progress(len(self.cached))
        return Pass(min(len(tokens), self.n_batch))

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
