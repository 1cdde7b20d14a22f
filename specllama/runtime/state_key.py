"""What decides the bits of a saved sequence state: the key a state on disk is kept under.

A state holds K and V (or recurrent state) as one llama.cpp build computed them for one model
file under one set of context settings; restored anywhere else it would be silently wrong. The
key holds the model file's content (SHA-256 of its bytes, not its path: a file of the same name
with other weights, or another quantization, has another key), the build (llama-cpp-python's
version, the SHA-256 of its libraries, llama.cpp's system info line, the devices), and every
context setting that picks kernels or lays out the cache: n_batch (= n_ubatch), K and V types,
flash attention, offload, RPC placement, memory kind and rollback, sequences per context.
Threads and n_ctx are left out: they change neither a state's bytes nor the rows computed on
it (measure_key says the same of the measurements).

Hashing a model file reads it once (about 1 s a GiB here); the digest is remembered per file
(path, size, mtime, ctime, inode) in the folder the states live in, so later loads read nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import llama_cpp

from .ggml import devices, system_info

FORMAT = 1  # of the files disk_cache writes; part of the key, so an older layout is never read
_DIGESTS = "file-digests.json"


def file_digest(path: Path, memo_dir: Path) -> str:
    """The SHA-256 of a file's bytes, remembered in memo_dir by the file's path, size, times and inode."""
    stat = path.stat()
    # ctime too: a copy that kept the size and mtime (rsync -t) still changed it
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|{stat.st_ino}"
    memo = memo_dir / _DIGESTS
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    digest = known.get(ident)
    if isinstance(digest, str):
        return digest
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    known[ident] = digest
    fd, tmp = tempfile.mkstemp(prefix=".digests-", dir=memo_dir)
    with os.fdopen(fd, "w") as f:  # another process may write its own at once: the last rename wins
        json.dump(known, f)
    os.replace(tmp, memo)
    return digest


def build_digest(memo_dir: Path) -> str:
    """llama-cpp-python's version and the SHA-256 of its shared libraries, as one digest."""
    lib = Path(llama_cpp.__file__).parent / "lib"
    parts = [llama_cpp.__version__]
    for path in sorted(lib.glob("*")) if lib.is_dir() else []:
        if path.is_file() and not path.is_symlink():
            parts.append(f"{path.name}:{file_digest(path, memo_dir)}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def state_key(runtime: Any, memo_dir: Path) -> tuple[Optional[dict], str]:
    """(the key of runtime's saved states, ""), or (None, why none can be kept on disk)."""
    settings, path = runtime.settings, runtime.path
    if settings is None or path is None:
        return None, "a llama_cpp.Llama the caller built: its file and settings are not known here"
    return {
        "format": FORMAT,
        "model": file_digest(Path(path), memo_dir),
        "build": build_digest(memo_dir),
        "system": system_info(),
        "devices": [f"{d.name}:{d.description}" for d in devices() if d.rpc_endpoint is None],
        "n_batch": runtime.n_batch,
        "type_k": settings.type_k, "type_v": settings.type_v, "flash_attn": settings.flash_attn,
        "n_gpu_layers": settings.n_gpu_layers, "rpc": list(settings.rpc),
        "tensor_split": list(settings.tensor_split) if settings.tensor_split else None,
        "memory": runtime.memory, "rollback": runtime.rollback, "n_seq": runtime.n_seq,
        "mtp": runtime.mtp_head is not None,
    }, ""
