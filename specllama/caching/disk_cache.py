"""The prompt cache on disk: saved sequence states that outlive the process.

A state on disk is one file, `<key id>-<random>.state`: a header (the full key it was saved
under, the tokens it holds, how many are canonical, its scope, the shape of its prefill row,
a CRC-32 of the rest) followed by the prefill row's float32 bytes and the state's bytes
(llama_state_seq_get_data). A lookup reads only the headers of its own key's files, finds the
longest reusable prefix as the RAM cache does, and reads that one file; a file that is
truncated, corrupt, foreign or gone is skipped with one log line, and the prompt is prefilled
as if it were not there.

Files are written by one background thread per folder user (so the request that produced a
state does not wait for the disk), to a temporary name and renamed into place, so a reader
sees a whole file or none; two processes sharing the folder each write files of their own
names. The folder's size is kept under a byte budget, least recently used (by mtime, touched
on every read) out first.

What is written (prompt_cache.PromptCache decides): a state evicted from the RAM cache, the
live sequences and RAM states at a clean close(), and the prompt of a cold prefill of at least
DISK_MIN_PREFILL tokens (a chat's or an agent's long system prompt, the first time it is seen).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import InvalidParameterError
from ..runtime.state import PrefillRow, SavedState

log = logging.getLogger("specllama")

MAGIC = b"specllama-state\n"
SUFFIX = ".state"
DISK_MB = 10240  # default byte budget of a folder: a few long agent contexts of a 7-8B model
DISK_MIN_PREFILL = 512  # a cold prefill this long is worth a file: redoing it costs more than reading it
_HEAD = struct.Struct("<Q")  # the header's length, after MAGIC


def check(folder: os.PathLike | str, n_mb: float) -> Path:
    """The folder, made if missing (InvalidParameterError where it cannot be written, or n_mb is not > 0);
    temporary files a killed writer left behind an hour ago or more are removed."""
    if isinstance(n_mb, bool) or not isinstance(n_mb, (int, float)) or not n_mb > 0:
        raise InvalidParameterError("prompt_cache_disk_mb", n_mb, "a number of MiB > 0")
    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        tempfile.NamedTemporaryFile(dir=path, prefix=".probe-").close()
    except OSError as e:
        raise InvalidParameterError("prompt_cache_dir", str(folder), f"a folder this process can write ({e})") \
            from None
    for stale in path.glob(".writing-*"):
        try:
            if time.time() - stale.stat().st_mtime > 3600:
                stale.unlink()
        except OSError:
            pass
    return path


def key_id(key: dict) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Entry:
    """One file's header: enough to decide whether it is worth reading."""

    path: Path
    key: dict
    tokens: list[int]
    n_canonical: int
    scope: str
    row: Optional[tuple[int, bool]]  # the prefill row's n_tokens and canonical flag
    n_row: int  # floats in the row
    n_state: int  # bytes of the state
    crc: int
    offset: int  # where the row's bytes begin
    model: str  # the model file's name when written (for `specllama cache`)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def prefill_row(self) -> Optional["RowFacts"]:
        return None if self.row is None else RowFacts(*self.row)


@dataclass(frozen=True)
class RowFacts:
    """What prompt_cache.reusable needs of a prefill row (n_tokens, canonical), without its logits."""

    n_tokens: int
    canonical: bool


def read_header(path: Path) -> Entry:
    """The header of a state file; ValueError (or OSError) when it is not one."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a specllama state file")
        (n_head,) = _HEAD.unpack(f.read(_HEAD.size))
        if n_head > 1 << 28:
            raise ValueError("header length out of range")
        head = json.loads(f.read(n_head))
    row = head["row"]
    return Entry(path, head["key"], [int(t) for t in head["tokens"]], int(head["n_canonical"]), str(head["scope"]),
                 None if row is None else (int(row[0]), bool(row[1])), int(head["n_row"]), int(head["n_state"]),
                 int(head["crc"]), len(MAGIC) + _HEAD.size + n_head, str(head.get("model", "")))


@dataclass
class Counters:
    n_written: int = 0
    n_read: int = 0
    n_skipped: int = 0  # files found unreadable, corrupt or foreign
    n_bytes_written: int = 0
    n_bytes_read: int = 0
    t_read: float = 0.0
    t_write: float = 0.0
    n_evicted: int = 0


class DiskCache:
    """A folder of saved states under a byte budget, with a thread that writes them."""

    def __init__(self, folder: os.PathLike | str, n_mb: float):
        self.folder = check(folder, n_mb)
        self.n_bytes = int(n_mb * 2**20)
        self.counters = Counters()
        self._lock = threading.Lock()
        # file name: (size, header; None: unreadable); guarded by _lock, as the counters are
        self._headers: dict[str, tuple[int, Optional[Entry]]] = {}
        self._queue: "queue.Queue[Optional[tuple[dict, str, SavedState]]]" = queue.Queue()
        self._writer: Optional[threading.Thread] = None

    # --- finding and reading -----------------------------------------------------------------

    def entries(self, key: dict) -> list[Entry]:
        """The files saved under key, as their headers say (read once per file version)."""
        prefix = key_id(key) + "-"
        found = []
        try:
            listing = list(os.scandir(self.folder))
        except OSError:
            return []
        with self._lock:
            for item in listing:
                if not (item.name.startswith(prefix) and item.name.endswith(SUFFIX)):
                    continue
                try:
                    stat = item.stat()
                except OSError:
                    continue
                known = self._headers.get(item.name)
                if known is None or known[0] != stat.st_size:  # files are written once, under new names
                    known = (stat.st_size, self._header(Path(item.path)))
                    self._headers[item.name] = known
                if known[1] is not None and known[1].key == key:  # not another key whose id begins the same
                    found.append(known[1])
        return found

    def _header(self, path: Path) -> Optional[Entry]:
        try:
            entry = read_header(path)
            if path.stat().st_size != entry.offset + 4 * entry.n_row + entry.n_state:
                raise ValueError("truncated")
            return entry
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            self.counters.n_skipped += 1
            log.warning("prompt cache: skipping %s (%s)", path.name, e)
            return None

    def read(self, entry: Entry) -> Optional[SavedState]:
        """The state in entry's file, or None (logged) if it is gone, cut short or corrupt."""
        t0 = time.perf_counter()
        try:
            with open(entry.path, "rb") as f:
                f.seek(entry.offset)
                row = f.read(4 * entry.n_row)
                data = bytearray(entry.n_state)
                n = f.readinto(data)
            if len(row) != 4 * entry.n_row or n != entry.n_state:
                raise ValueError("truncated")
            if zlib.crc32(data, zlib.crc32(row)) != entry.crc:
                raise ValueError("its checksum does not match: corrupt")
            os.utime(entry.path)  # recently used: the last to go
        except (OSError, ValueError) as e:
            with self._lock:
                self.counters.n_skipped += 1
                self._headers.pop(entry.path.name, None)
            log.warning("prompt cache: skipping %s (%s); prefilling instead", entry.path.name, e)
            return None
        prefill_row = None
        if entry.row is not None:
            prefill_row = PrefillRow(entry.row[0], np.frombuffer(row, dtype=np.float32).copy(), entry.row[1])
        with self._lock:
            self.counters.n_read += 1
            self.counters.n_bytes_read += entry.n_state
            self.counters.t_read += time.perf_counter() - t0
        return SavedState(list(entry.tokens), entry.n_canonical, data, prefill_row, entry.scope)

    # --- writing -----------------------------------------------------------------------------

    def put(self, key: dict, model: str, state: SavedState) -> None:
        """Write state under key, in the background (its bytes are not changed after this)."""
        with self._lock:
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_all, name="specllama-disk-cache", daemon=True)
                self._writer.start()
        self._queue.put((key, model, state))

    def flush(self) -> None:
        """Wait until every state put so far is on disk."""
        self._queue.join()

    def close(self) -> None:
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._writer = None

    def _write_all(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as e:  # a full disk or a vanished folder: the cache is an optimization
                log.warning("prompt cache: could not write a state to %s (%s)", self.folder, e)
            finally:
                self._queue.task_done()

    def _write(self, key: dict, model: str, state: SavedState) -> None:
        t0 = time.perf_counter()
        kept = self.entries(key)
        if any(_covers(e, state) for e in kept):
            return  # a file already holds all of it
        row = b"" if state.prefill_row is None else np.ascontiguousarray(state.prefill_row.logits, np.float32).tobytes()
        head = json.dumps({
            "key": key, "model": model, "tokens": state.tokens, "n_canonical": state.n_canonical,
            "scope": state.scope, "written": time.time(), "n_row": len(row) // 4, "n_state": state.n_bytes,
            "row": None if state.prefill_row is None else [state.prefill_row.n_tokens, state.prefill_row.canonical],
            "crc": zlib.crc32(state.data, zlib.crc32(row)),
        }).encode()
        n_total = len(MAGIC) + _HEAD.size + len(head) + len(row) + state.n_bytes
        if n_total > self.n_bytes:
            log.info("prompt cache: a state of %.0f MiB is over the disk budget of %.0f MiB; not kept",
                     n_total / 2**20, self.n_bytes / 2**20)
            return
        fd, tmp = tempfile.mkstemp(prefix=".writing-", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + _HEAD.pack(len(head)) + head)
                f.write(row)
                f.write(state.data)
            final = self.folder / f"{key_id(key)}-{os.urandom(8).hex()}{SUFFIX}"
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        for e in kept:  # files the new one holds everything of
            if _covers_state(state, e):
                e.path.unlink(missing_ok=True)
        with self._lock:
            self.counters.n_written += 1
            self.counters.n_bytes_written += n_total
            self.counters.t_write += time.perf_counter() - t0
        self._evict()

    def _evict(self) -> None:
        """Oldest used files out until the folder is within its budget (other processes' too)."""
        files = []
        for item in os.scandir(self.folder):
            if item.name.endswith(SUFFIX):
                try:
                    stat = item.stat()
                except OSError:
                    continue
                files.append((stat.st_mtime_ns, stat.st_size, Path(item.path)))
        n_used = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if n_used <= self.n_bytes:
                break
            path.unlink(missing_ok=True)
            n_used -= size
            with self._lock:
                self.counters.n_evicted += 1

    def as_dict(self) -> dict:
        c = self.counters
        return {"folder": str(self.folder), "budget_bytes": self.n_bytes, "written": c.n_written,
                "read": c.n_read, "skipped": c.n_skipped, "evicted": c.n_evicted,
                "bytes_written": c.n_bytes_written, "bytes_read": c.n_bytes_read,
                "read_seconds": round(c.t_read, 3), "write_seconds": round(c.t_write, 3)}


def _covers(entry: Entry, state: SavedState) -> bool:
    """Whether the file holds everything the state does (its tokens extend the state's)."""
    return entry.scope == state.scope and entry.tokens[:len(state.tokens)] == state.tokens \
        and entry.n_canonical >= state.n_canonical and (state.prefill_row is None or entry.row == (
            state.prefill_row.n_tokens, state.prefill_row.canonical))


def _covers_state(state: SavedState, entry: Entry) -> bool:
    row = state.prefill_row
    return entry.scope == state.scope and state.tokens[:len(entry.tokens)] == entry.tokens \
        and state.n_canonical >= entry.n_canonical and len(state.tokens) > len(entry.tokens) \
        and (entry.row is None or (row is not None and entry.row == (row.n_tokens, row.canonical)))


@dataclass
class Shelf:
    """One model's part of a DiskCache: its states, under its key."""

    disk: DiskCache
    key: dict
    model: str

    def entries(self) -> list[Entry]:
        return self.disk.entries(self.key)

    def put(self, state: SavedState) -> None:
        self.disk.put(self.key, self.model, state)


def listing(folder: Path) -> list[Entry]:
    """Every state file in folder whose header reads, whatever its key (for `specllama cache`)."""
    out = []
    for path in sorted(folder.glob(f"*{SUFFIX}")) if folder.is_dir() else []:
        try:
            out.append(read_header(path))
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
    return out
