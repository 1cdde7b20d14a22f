"""The only module that touches llama_cpp: handles, decode, logit rows, KV truncation.

Each C handle is a small object whose free function is registered on an ExitStack, so a
context is always freed before its model. A Runtime drives one model + context + batch and
tracks exactly which tokens its KV cache holds, so callers can sync to any token sequence
by reusing the longest cached prefix.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import llama_cpp
import numpy as np
import psutil
from gguf import GGMLQuantizationType
from llama_cpp._ggml import libggml

from . import gguf_check
from .errors import ContextFullError, DecodeError, InvalidModelFileError, InvalidParameterError, RpcError

# KV cache element types users may name; values are ggml_type ids (the gguf package's table).
KV_CACHE_TYPES = {name: int(GGMLQuantizationType[name.upper()])
                  for name in ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")}

# Ways to drop the last tokens from a model's memory (see Runtime.rollback):
#   seq_rm      attention KV cache: remove the positions (llama_memory_seq_rm)
#   n_rs_seq    recurrent state snapshots per token of the last batch (llama.cpp's n_rs_seq): a
#               rollback of 1..N_RS_SEQ tokens right after a batch, keeping its first token
#   checkpoint  copy the recurrent state before a batch (llama_state_seq_get_data_ext with
#               PARTIAL_ONLY), restore it and decode the accepted tokens again
ROLLBACKS = ("seq_rm", "n_rs_seq", "checkpoint")
N_RS_SEQ = 16  # snapshots asked for: verify batches are capped at N_RS_SEQ + 1 rows

_FLASH_ATTN = {
    None: llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    True: llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    False: llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


@dataclass(frozen=True)
class ModelSettings:
    """Per-model llama.cpp settings. None means llama.cpp's own default.

    n_gpu_layers=-1 offloads every layer where a GPU backend (Metal, CUDA) is built in and
    is a no-op on CPU-only builds.
    """

    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: Optional[int] = None  # None: the CPUs this process may use
    n_threads_batch: Optional[int] = None
    n_gpu_layers: int = -1
    flash_attn: Optional[bool] = None
    type_k: Optional[str] = None
    type_v: Optional[str] = None
    use_mmap: bool = True
    verbose: bool = False
    # llama.cpp RPC workers ("host:port") that hold the offloaded layers, as llama.cpp's --rpc;
    # a model with workers runs in a child process of its own (see remote.py)
    rpc: tuple[str, ...] = ()
    tensor_split: Optional[tuple[float, ...]] = None  # share of the offloaded layers per device
    rpc_timeout: float = 600.0  # seconds one call on an RPC model may take before it counts as lost
    # how rejected tokens leave a recurrent or hybrid memory (ROLLBACKS); None: the fastest the
    # model supports. Attention-only memory always truncates its KV cache (seq_rm).
    rollback: Optional[str] = None

    def __post_init__(self) -> None:
        # frozen: normalise through object.__setattr__ ("a:1,b:2" and lists become tuples)
        object.__setattr__(self, "rpc", parse_endpoints(self.rpc))
        if self.tensor_split is not None:
            split = self.tensor_split
            if isinstance(split, str):
                split = [s for s in split.split(",") if s.strip()]
            try:
                split = tuple(float(x) for x in split)
            except (TypeError, ValueError):
                split = ()
            if not split or any(x < 0 for x in split) or sum(split) <= 0:
                raise InvalidParameterError("tensor_split", self.tensor_split,
                                            "shares >= 0 per device with a positive sum, e.g. (3, 1) or '3,1'")
            object.__setattr__(self, "tensor_split", split)
        if isinstance(self.rpc_timeout, bool) or not isinstance(self.rpc_timeout, (int, float)) \
                or not self.rpc_timeout > 0:
            raise InvalidParameterError("rpc_timeout", self.rpc_timeout, "a number of seconds > 0")
        for name in ("n_ctx", "n_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 8:
                raise InvalidParameterError(name, value, "an integer >= 8")
        for name in ("n_threads", "n_threads_batch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidParameterError(name, value, "an integer >= 1, or None for llama.cpp's default")
        if isinstance(self.n_gpu_layers, bool) or not isinstance(self.n_gpu_layers, int) or self.n_gpu_layers < -1:
            raise InvalidParameterError("n_gpu_layers", self.n_gpu_layers, "an integer >= -1 (-1 = all)")
        if self.flash_attn not in _FLASH_ATTN:
            raise InvalidParameterError("flash_attn", self.flash_attn, "True, False or None (auto)")
        if self.rollback not in (None, *ROLLBACKS):
            raise InvalidParameterError("rollback", self.rollback, f"one of {', '.join(ROLLBACKS)} or None (the "
                                        "fastest the model's memory supports)")
        for name in ("type_k", "type_v"):
            value = getattr(self, name)
            if value is not None and value not in KV_CACHE_TYPES:
                raise InvalidParameterError(name, value, f"one of {', '.join(KV_CACHE_TYPES)} or None")


def parse_endpoints(value: Any) -> tuple[str, ...]:
    """RPC worker endpoints as a tuple of "host:port", from a comma-separated string or a list."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise InvalidParameterError("rpc", value, 'a list of "host:port" or a comma-separated string of them')
    out = []
    for item in items:
        host, _, port = str(item).strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidParameterError("rpc", value, 'RPC worker endpoints "host:port" with a port in 1..65535, '
                                        'e.g. "192.168.1.20:50052"')
        out.append(f"{host}:{int(port)}")
    return tuple(out)


@dataclass(frozen=True)
class Device:
    """A compute device llama.cpp found, with its memory as the backend reports it."""

    name: str
    description: str
    kind: str  # "cpu", "gpu" (own memory), "igpu" (shares system memory), "accel" or "meta"
    free: int
    total: int
    rpc_endpoint: Optional[str] = None  # "host:port" of the RPC worker that serves this device

    @property
    def discrete(self) -> bool:
        """A GPU with its own memory; on Apple silicon the GPU shares the one pool of RAM."""
        return self.kind == "gpu" and sys.platform != "darwin"


_DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")  # enum ggml_backend_dev_type, in order


def _bind(name: str, restype: Any, *argtypes: Any) -> Any:
    function = getattr(libggml, name)
    function.restype, function.argtypes = restype, list(argtypes)
    return function


# llama-cpp-python binds llama.h only; the device registry lives in ggml-backend.h.
_dev_count = _bind("ggml_backend_dev_count", ctypes.c_size_t)
_dev_get = _bind("ggml_backend_dev_get", ctypes.c_void_p, ctypes.c_size_t)
_dev_name = _bind("ggml_backend_dev_name", ctypes.c_char_p, ctypes.c_void_p)
_dev_description = _bind("ggml_backend_dev_description", ctypes.c_char_p, ctypes.c_void_p)
_dev_type = _bind("ggml_backend_dev_type", ctypes.c_int, ctypes.c_void_p)
_dev_memory = _bind("ggml_backend_dev_memory", None, ctypes.c_void_p,
                    ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
_reg_count = _bind("ggml_backend_reg_count", ctypes.c_size_t)
_reg_get = _bind("ggml_backend_reg_get", ctypes.c_void_p, ctypes.c_size_t)
_reg_name = _bind("ggml_backend_reg_name", ctypes.c_char_p, ctypes.c_void_p)
_reg_by_name = _bind("ggml_backend_reg_by_name", ctypes.c_void_p, ctypes.c_char_p)
_reg_proc_address = _bind("ggml_backend_reg_get_proc_address", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
_register = _bind("ggml_backend_register", None, ctypes.c_void_p)
_dev_backend_reg = _bind("ggml_backend_dev_backend_reg", ctypes.c_void_p, ctypes.c_void_p)


def backends() -> list[str]:
    """The ggml backends compiled into this llama.cpp build ("CPU", "CUDA", "Metal", ...)."""
    _init_backend()
    return [(_reg_name(_reg_get(i)) or b"?").decode("utf-8", "replace") for i in range(_reg_count())]


def build_info() -> dict:
    """This llama.cpp build: llama-cpp-python's version and llama.cpp's system info line."""
    return {"llama_cpp_python": llama_cpp.__version__, "system_info": _system_info().strip(" |")}


def devices() -> list[Device]:
    """Every device llama.cpp can use, with free and total memory as its backend reports them
    (CUDA and Metal report what is free right now; the CPU reports physical memory)."""
    _init_backend()
    out = []
    for i in range(_dev_count()):
        dev = _dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        _dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = _dev_type(dev)
        description = (_dev_description(dev) or b"").decode("utf-8", "replace")
        is_rpc = _reg_name(_dev_backend_reg(dev)) == b"RPC"  # an RPC device's description is its endpoint
        out.append(Device(_dev_name(dev).decode("utf-8", "replace"), description,
                          _DEVICE_KINDS[kind] if 0 <= kind < len(_DEVICE_KINDS) else f"type {kind}",
                          free.value, total.value, description if is_rpc else None))
    return out


# --- llama.cpp's RPC backend (ggml-rpc) ------------------------------------------------------

NO_RPC_BUILD = ("this llama.cpp build has no RPC backend; rebuild it with SPECLLAMA_RPC=1 bash scripts/setup.sh "
                "(or CMAKE_ARGS=-DGGML_RPC=ON pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36)")


def supports_rpc() -> bool:
    """Whether this llama.cpp build has the RPC backend (GGML_RPC=ON)."""
    _init_backend()
    return bool(_reg_by_name(b"RPC"))


def _rpc_function(name: str, restype: Any, *argtypes: Any) -> Any:
    # the RPC functions are reached through the backend registry, as llama.cpp's rpc-server does,
    # which works whether ggml links its backends in or loads them as plugins
    if not supports_rpc():
        raise RpcError(NO_RPC_BUILD)
    address = _reg_proc_address(_reg_by_name(b"RPC"), name.encode())
    if not address:
        raise RpcError(f"this llama.cpp build's RPC backend has no {name}")
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


def add_rpc_workers(endpoints: Sequence[str]) -> None:
    """Register RPC workers' devices, as llama.cpp's --rpc does: models loaded afterwards in this
    process put their offloaded layers on them, ahead of any local GPU.

    ggml-rpc aborts the whole process when a worker cannot be reached or is lost, so only a
    process that may die calls this: remote.py's host of one model.
    """
    add = _rpc_function("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)
    for endpoint in endpoints:
        reg = add(endpoint.encode())
        if not reg:
            raise RpcError(f"the RPC worker at {endpoint} reports no devices")
        _register(reg)


def offload_devices(found: Sequence[Device], endpoints: Sequence[str]) -> list[Device]:
    """The devices a model with RPC workers offloads to, in llama.cpp's order: the workers'
    devices in the order named, then local GPUs (integrated ones only without a discrete one)."""
    workers = [d for endpoint in endpoints for d in found if d.rpc_endpoint == endpoint]
    local = [d for d in found if d.rpc_endpoint is None and d.kind == "gpu"] or \
            [d for d in found if d.rpc_endpoint is None and d.kind == "igpu"]
    return workers + local


def rpc_model_devices(endpoints: Sequence[str]) -> list[int]:
    """Device handles for a model whose layers go to the RPC workers at endpoints (added first)."""
    found = devices()
    missing = [e for e in endpoints if not any(d.rpc_endpoint == e for d in found)]
    if missing:
        raise RpcError(f"RPC worker {', '.join(missing)} is not connected in this process", tuple(missing))
    handles = {_dev_name(_dev_get(i)).decode("utf-8", "replace"): _dev_get(i) for i in range(_dev_count())}
    return [handles[d.name] for d in offload_devices(found, endpoints)]


def serve_rpc(endpoint: str, cache_dir: Optional[str], n_threads: int) -> list[Device]:
    """Start llama.cpp's RPC server on endpoint in a daemon thread, serving this machine's
    accelerators, or its CPU when it has none (as llama.cpp's rpc-server chooses).

    Returns the devices served. The server runs until the process ends; RpcError if the
    endpoint cannot be bound.
    """
    start = _rpc_function("ggml_backend_rpc_start_server", None, ctypes.c_char_p, ctypes.c_char_p,
                          ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))
    host, _, port = endpoint.rpartition(":")
    try:  # ggml only prints when it cannot bind; find out first, with a reason
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, int(port)))
    except OSError as exc:
        raise RpcError(f"cannot listen on {endpoint}: {exc.strerror or exc}; choose another --port or --host") from None
    ptrs = [_dev_get(i) for i in range(_dev_count())]
    served = [p for p in ptrs if _DEVICE_KINDS[_dev_type(p)] not in ("cpu", "accel")] or \
             [p for p in ptrs if _DEVICE_KINDS[_dev_type(p)] == "cpu"][:1]
    listed = {d.name: d for d in devices()}
    array = (ctypes.c_void_p * len(served))(*served)
    cache = cache_dir.encode() if cache_dir else None
    thread = threading.Thread(target=start, args=(endpoint.encode(), cache, n_threads, len(served), array),
                              name=f"rpc-worker {endpoint}", daemon=True)
    thread.start()
    thread.join(0.5)  # it returns at once only when it could not start
    if not thread.is_alive():
        raise RpcError(f"llama.cpp's RPC server did not start on {endpoint} (its reason is printed above)")
    return [listed[_dev_name(p).decode("utf-8", "replace")] for p in served]


@dataclass(frozen=True)
class MemoryUse:
    """Memory one model took when it loaded: resident RAM of this process (mapped weights,
    KV cache, buffers) and GPU memory, both measured before and after."""

    ram: int
    gpu: int

    @property
    def total(self) -> int:
        return self.ram + self.gpu


def resident_bytes() -> int:
    """This process's resident memory now."""
    return psutil.Process().memory_info().rss


def _gpu_free() -> int:
    return sum(d.free for d in devices() if d.discrete)


class _LogSink:
    """Routes llama.cpp's process-wide log callback; silent unless a runtime asked for verbose."""

    def __init__(self) -> None:
        self.verbose = False
        self._callback = llama_cpp.llama_log_callback(self._write)
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    def _write(self, level: int, text: bytes, user_data: Any) -> None:
        if self.verbose:
            sys.stderr.write(text.decode("utf-8", errors="replace"))


# llama.cpp keeps one log callback per process, so its Python side is one object too.
_LOG_SINK = _LogSink()
_BACKEND_ONCE = threading.Lock()
_backend_ready = False


def _init_backend() -> None:
    global _backend_ready
    with _BACKEND_ONCE:
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            _backend_ready = True


@dataclass(frozen=True)
class PrefillRow:
    """The logits of the last prompt token of a prefill, kept so that the same prompt asked
    again needs no decode at all; canonical: the prefill started on a canonical prefix, so
    the row is bit for bit a fresh prefill's."""

    n_tokens: int
    logits: np.ndarray
    canonical: bool


@dataclass
class SavedState:
    """One sequence's memory copied out of a context (llama_state_seq_get_data), with the tokens
    it holds, how many of them are canonical (see Runtime.n_canonical) and its PrefillRow."""

    tokens: list[int]
    n_canonical: int
    data: bytearray
    prefill_row: Optional[PrefillRow] = None

    @property
    def n_bytes(self) -> int:
        return len(self.data)


class _Model:
    def __init__(self, path: Path, settings: ModelSettings, stack: ExitStack, mtp: bool = False):
        params = llama_cpp.llama_model_default_params()
        params.load_mtp = mtp  # the MTP (nextn) layers are skipped unless asked for
        params.n_gpu_layers = settings.n_gpu_layers  # -1: all layers, llama.cpp's own meaning
        if settings.rpc:
            # llama.cpp's default choice of devices leaves registered RPC workers out here, so
            # they are named: the workers first, as llama.cpp's --rpc orders them
            chosen = rpc_model_devices(settings.rpc)
            self._devices = (ctypes.c_void_p * (len(chosen) + 1))(*chosen, None)
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        if settings.tensor_split is not None:
            n_max = llama_cpp.llama_max_devices()
            if len(settings.tensor_split) > n_max:
                raise InvalidParameterError("tensor_split", settings.tensor_split, f"at most {n_max} shares")
            self._split = (ctypes.c_float * n_max)(*settings.tensor_split)  # lives as long as the model
            params.tensor_split = self._split
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP if settings.use_mmap else llama_cpp.LLAMA_LOAD_MODE_NONE
        self.ptr = llama_cpp.llama_model_load_from_file(str(path).encode("utf-8"), params)
        if not self.ptr:
            raise InvalidModelFileError(
                f"llama.cpp could not load {path}: the file is not a model this llama.cpp supports "
                "(run with verbose=True to see llama.cpp's reason)"
            )
        stack.callback(llama_cpp.llama_model_free, self.ptr)


class _Context:
    def __init__(self, model_ptr: Any, settings: ModelSettings, stack: ExitStack, mtp: bool = False,
                 n_seq: int = 1):
        params = llama_cpp.llama_context_default_params()
        if mtp:  # a context that runs the model's MTP layers on the target's hidden states
            params.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        recurrent = llama_cpp.llama_model_is_recurrent(model_ptr) or llama_cpp.llama_model_is_hybrid(model_ptr)
        if n_seq > 1 and not recurrent and not mtp:
            # tree verify batches: one sequence per branch, all in one KV buffer (unified), so
            # each sequence has the whole context and a shared prefix is stored once
            params.n_seq_max, params.kv_unified = n_seq, True
        params.n_ctx = settings.n_ctx
        params.n_batch = settings.n_batch
        params.n_ubatch = settings.n_batch
        # llama.cpp's own default is 4 threads whatever the machine; 4 on 2 cores halves speed
        n_threads = settings.n_threads or cpu_count()
        params.n_threads = n_threads
        params.n_threads_batch = settings.n_threads_batch or n_threads
        params.flash_attn_type = _FLASH_ATTN[settings.flash_attn]
        if settings.type_k is not None:
            params.type_k = KV_CACHE_TYPES[settings.type_k]
        if settings.type_v is not None:
            params.type_v = KV_CACHE_TYPES[settings.type_v]
        params.no_perf = True
        if recurrent and settings.rollback in (None, "n_rs_seq") and not mtp:
            params.n_rs_seq = N_RS_SEQ  # llama.cpp grants 0 to architectures without snapshots
        self.ptr = llama_cpp.llama_init_from_model(model_ptr, params)
        if not self.ptr:
            raise InvalidParameterError(
                "model settings", settings, "settings llama.cpp can create a context with "
                "(a quantized V cache needs flash_attn; run with verbose=True for the reason)"
            )
        stack.callback(llama_cpp.llama_free, self.ptr)


class _Batch:
    def __init__(self, n_tokens: int, stack: ExitStack, n_seq: int = 1):
        self.capacity = n_tokens
        self.c = llama_cpp.llama_batch_init(n_tokens, 0, n_seq)
        stack.callback(llama_cpp.llama_batch_free, self.c)

    def fill(self, tokens: Sequence[int], pos0: int, n_logits: int) -> None:
        c, n = self.c, len(tokens)
        for i, token in enumerate(tokens):
            c.token[i] = token
            c.pos[i] = pos0 + i
            c.n_seq_id[i] = 1
            c.seq_id[i][0] = 0
            c.logits[i] = i >= n - n_logits
        c.n_tokens = n

    def fill_tree(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[Sequence[int]],
                  n_no_logits: int = 0) -> None:
        """A tree batch: token i at positions[i], in sequences seqs[i], logits kept for every
        row after the first n_no_logits."""
        c = self.c
        for i, (token, pos, seq_ids) in enumerate(zip(tokens, positions, seqs)):
            c.token[i], c.pos[i], c.n_seq_id[i], c.logits[i] = token, pos, len(seq_ids), i >= n_no_logits
            for j, seq in enumerate(seq_ids):
                c.seq_id[i][j] = seq
        c.n_tokens = len(tokens)


def _mtp_api() -> Any:
    """llama-cpp-python's bindings of llama.cpp's staging MTP functions (llama-ext.h)."""
    try:
        from llama_cpp import llama_cpp_ext
    except (ImportError, AttributeError) as exc:
        raise MtpUnavailable(f"this llama.cpp build lacks the MTP staging functions ({exc})") from None
    return llama_cpp_ext


class MtpUnavailable(DecodeError):
    """The llama.cpp build cannot run MTP layers (its staging functions are missing)."""


class MtpHead:
    """A model's MTP (nextn) layers as a draft: a second context on the same weights.

    Entry p of its KV cache pairs token x_p with the target's hidden state h_(p-1), which it
    gets from every decode of the target (follow); a draft step feeds the newest token with the
    last h, then each drafted token with the head's own output state. It has a draft model's
    runtime interface (sync, decode, logits, truncate), so the draft-model proposer drives it.
    Where the target's h is unknown (a restored prompt-cache state), entries get zeros: drafts
    there are worse, the output is the same.
    """

    RECENT = 256  # target hidden states kept per position, for rollbacks and restores

    def __init__(self, target: "Runtime", settings: ModelSettings, stack: ExitStack):
        api = _mtp_api()
        if target.n_nextn <= 0:
            raise InvalidParameterError("draft", "mtp", f"a target whose GGUF has MTP (nextn) layers; {target.name} "
                                        "has none")
        self.target, self.name = target, f"{target.name} (MTP)"
        self.identity = target.identity + "|mtp"
        self._api = api
        self.ptr = _Context(target._model, settings, stack, mtp=True).ptr
        self._mem = llama_cpp.llama_get_memory(self.ptr)
        api.llama_set_embeddings_nextn(target._ctx, True, False)  # h for every token the target decodes
        api.llama_set_embeddings_nextn(self.ptr, True, True)  # and for the head's output rows
        self.n_ctx, self.n_vocab, self.n_embd = target.n_ctx, target.n_vocab, target.n_embd
        self.n_batch = int(llama_cpp.llama_n_batch(self.ptr))
        self._batch = llama_cpp.llama_batch_init(self.n_batch, self.n_embd, 1)
        self._tokens = (llama_cpp.llama_token * self.n_batch)()  # an embd batch has no token array of its own
        self._batch.token = self._tokens
        stack.callback(self._free_batch)
        self._embd = np.ctypeslib.as_array(self._batch.embd, shape=(self.n_batch, self.n_embd))
        self.n_cached = 0  # entries at positions 0..n_cached-1
        self._h: dict[int, np.ndarray] = {}  # position -> the target's h there (recent ones)
        self._h_out: Optional[np.ndarray] = None  # the head's output state of its last row
        self._n_rows = 0
        self.memory_use: Optional[MemoryUse] = None  # part of the target's
        llama_cpp.llama_memory_clear(self._mem, True)

    def _free_batch(self) -> None:
        self._batch.token = ctypes.POINTER(llama_cpp.llama_token)()  # ours, not llama.cpp's to free
        llama_cpp.llama_batch_free(self._batch)

    def follow(self, target_tokens: Sequence[int], pos0: int) -> None:
        """The target just decoded target_tokens[pos0:]: enter them, each with the h before it."""
        h = self.target.hidden_states(len(target_tokens) - pos0)
        self.truncate(pos0)
        for i in range(len(h)):
            self._h[pos0 + i] = h[i].copy()
        for p in [p for p in self._h if p < len(target_tokens) - self.RECENT]:
            del self._h[p]
        self._enter(target_tokens[self.n_cached:], logits=False)

    def _enter(self, tokens: Sequence[int], logits: bool, h_first: Optional[np.ndarray] = None) -> None:
        """Decode entries for tokens at n_cached.., each paired with the target's h before it."""
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            c = self._batch
            for i, token in enumerate(chunk):
                pos = self.n_cached + i
                h = h_first if h_first is not None and start + i == 0 else self._h.get(pos - 1)
                c.token[i], c.pos[i], c.n_seq_id[i], c.seq_id[i][0] = token, pos, 1, 0
                c.logits[i] = logits and start + i == len(tokens) - 1
                self._embd[i] = 0.0 if h is None else h
            c.n_tokens = len(chunk)
            status = llama_cpp.llama_decode(self.ptr, c)
            if status != 0:
                llama_cpp.llama_memory_seq_rm(self._mem, 0, self.n_cached, -1)
                raise DecodeError(f"{self.name}: llama_decode failed with status {status}")
            self.n_cached += len(chunk)
        self._n_rows = 1 if logits else 0
        if logits:
            self._h_out = np.ctypeslib.as_array(self._api.llama_get_embeddings_nextn_ith(self.ptr, -1),
                                                shape=(self.n_embd,)).copy()

    # --- a draft runtime's interface ---------------------------------------------------------

    def truncate(self, n_keep: int) -> None:
        if n_keep < self.n_cached:
            llama_cpp.llama_memory_seq_rm(self._mem, 0, n_keep, -1)
            self.n_cached = n_keep
        self._n_rows = 0

    def sync(self, tokens: Sequence[int]) -> None:
        """Enter tokens[-1] after the target's entries for tokens[:-1], logits for it."""
        n_past = len(tokens) - 1
        self.truncate(n_past)  # the last round's drafts
        self._enter(tokens[self.n_cached:], logits=True)

    def decode(self, tokens: Sequence[int], *, n_logits: int = 1, aligned: bool = False) -> None:
        """Drafted tokens: the first pairs with the head's own last output state."""
        self._enter(tokens, logits=True, h_first=self._h_out)

    def logits(self, row: int) -> np.ndarray:
        if row != 0 or not self._n_rows:
            raise IndexError(f"{self.name}: logit row {row} was not requested by the last decode")
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ptr, -1), shape=(self.n_vocab,))

    def close(self) -> None:
        """Freed with its target."""


class Runtime:
    """One model, its context and a batch; knows which tokens its KV cache holds.

    Build with Runtime.load(path, settings) or Runtime.borrow(llama) for a llama_cpp.Llama the
    caller owns. Close with close() or a with-block.
    """

    def __init__(self, model_ptr: Any, ctx_ptr: Any, name: str, stack: ExitStack, identity: str = "",
                 rollback: Optional[str] = None, n_seq: int = 1):
        self._stack = stack
        self.name = name
        # what a measurement of this runtime depends on: file, settings, llama.cpp build
        self.identity = identity
        self._model = model_ptr
        self._ctx = ctx_ptr
        self._vocab = llama_cpp.llama_model_get_vocab(model_ptr)
        self._mem = llama_cpp.llama_get_memory(ctx_ptr)
        self.n_ctx = int(llama_cpp.llama_n_ctx(ctx_ptr))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        # llama.cpp may clamp the requested batch size (to n_ctx), so ask the context
        self.n_batch = int(llama_cpp.llama_n_batch(ctx_ptr))
        self.n_rs_seq = int(llama_cpp.llama_n_rs_seq(ctx_ptr))  # recurrent-state snapshots per token granted
        self.memory, self.rollback = _memory_kind(model_ptr, self.n_rs_seq, name, rollback)
        # the most branches a tree verify batch may have (1: chains only); the context was
        # made with this many sequences in a unified KV buffer
        self.n_branches = min(n_seq, int(llama_cpp.llama_n_seq_max(ctx_ptr))) if self.memory == "attention" else 1
        self._batch = _Batch(self.n_batch, stack, self.n_branches)
        # after a tree decode: (the root's position, each token's parent, the first-children
        # branch, the number of sequences); each token's batch row
        self._tree: Optional[tuple[int, list[int], set[int], int]] = None
        self._row_of: Optional[list[int]] = None
        self._n_pending = 0  # the last cached tokens, not in the KV cache yet (see _settle)
        self._n_rows = 0  # logit rows requested by the last decode
        self._pieces: dict[int, bytes] = {}
        self._grammar_tokenizer: Any = None
        self.cached: list[int] = []  # exactly the tokens at positions 0.. of the KV cache
        # the first n_canonical cached tokens hold exactly what a fresh prefill of them computes:
        # they were prefilled in chunks of n_batch aligned to position 0, on a canonical prefix
        self.n_canonical = 0
        self.prefill_row: Optional[PrefillRow] = None
        self._pinned: Optional[np.ndarray] = None  # logits(0) when it comes from prefill_row
        # measured by load(); None for a borrowed model, whose loading we did not see
        self.memory_use: Optional[MemoryUse] = None
        self._window: Optional[tuple[int, int]] = None  # n_rs_seq: the last batch's positions, until used
        self._checkpoint: Optional[tuple[int, bytearray]] = None  # (position, recurrent state there)
        # a rollback or sync since the last decode: the next decode keeps a checkpoint (as does
        # any batch of more than one token), since decoding may come back to that point
        self._revisit = True
        # what rolling back cost so far: tokens decoded again after a restore, and seconds
        self.n_replayed = 0
        self.t_rollback = 0.0
        self.mtp_head: Optional[MtpHead] = None  # the model's MTP layers, when loaded with mtp=True
        self.mtp_note = ""  # why they could not be loaded
        llama_cpp.llama_memory_clear(self._mem, True)

    @classmethod
    def load(cls, path: Union[str, os.PathLike], settings: ModelSettings = ModelSettings(),
             mtp: bool = False, n_branches: int = 1) -> "Runtime":
        """Load a GGUF file; the header is validated in Python before llama.cpp sees it.

        mtp=True also loads the model's MTP (nextn) layers, in a second context that follows
        every decode of this one (runtime.mtp_head); InvalidParameterError if it has none.
        n_branches > 1 lets decode_tree verify trees of up to that many branches (attention
        memory without MTP layers; others keep chains: runtime.n_branches says which).
        """
        path = gguf_check.validate(path)
        _init_backend()
        _LOG_SINK.verbose = settings.verbose
        stack = ExitStack()
        try:
            ram0, gpu_free0 = resident_bytes(), _gpu_free()
            model = _Model(path, settings, stack, mtp)
            ctx = _Context(model.ptr, settings, stack, mtp=False, n_seq=1 if mtp else n_branches)
            stat = path.stat()
            identity = "|".join([str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns), repr(settings),
                                 f"branches={1 if mtp else n_branches}",
                                 llama_cpp.__version__, _system_info()])
            runtime = cls(model.ptr, ctx.ptr, path.name, stack, identity, settings.rollback,
                          n_seq=1 if mtp else n_branches)
            if mtp:
                try:
                    runtime.mtp_head = MtpHead(runtime, settings, stack)
                except MtpUnavailable as exc:  # the caller decodes without it, and says why
                    runtime.mtp_note = str(exc)
            runtime.memory_use = MemoryUse(max(0, resident_bytes() - ram0), max(0, gpu_free0 - _gpu_free()))
            return runtime
        except BaseException:
            stack.close()
            raise

    @classmethod
    def borrow(cls, llama: "llama_cpp.Llama") -> "Runtime":
        """Drive an existing llama_cpp.Llama (its Metal/CUDA settings kept); the caller frees it.

        Its KV cache is cleared; do not use the Llama object directly while this runtime works.
        """
        path = Path(getattr(llama, "model_path", "model") or "model")
        identity = "|".join([str(path), repr(llama.model_params.n_gpu_layers), repr(llama.context_params.n_threads),
                             repr(llama.context_params.flash_attn_type), repr(llama.context_params.type_k),
                             repr(llama.context_params.n_ubatch), llama_cpp.__version__, _system_info()])
        return cls(llama.model, llama.ctx, path.name, ExitStack(), identity)

    def close(self) -> None:
        self._stack.close()

    def __del__(self) -> None:
        self._stack.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- vocabulary -------------------------------------------------------------------------

    def tokenize(self, text: Union[str, bytes], *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        n_max = len(data) + 8
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            raise DecodeError(f"tokenization of {len(data)} bytes needed {-n} tokens, more than expected")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes token stands for; control tokens render as nothing."""
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
            cached = self._pieces[token] = buf.raw[:n]
        return cached

    def grammar_tokenizer(self) -> Any:
        """This vocabulary as an llguidance tokenizer (built once: about a second for 150k
        tokens), with every end-of-generation token as its EOS."""
        if self._grammar_tokenizer is None:
            import llguidance.llamacpp

            eog = [t for t in range(self.n_vocab) if self.is_eog(t)] or [self.eos]
            with warnings.catch_warnings():  # it reads token attributes with a deprecated binding
                warnings.simplefilter("ignore", DeprecationWarning)
                self._grammar_tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(self._vocab, eos_token=eog)
        return self._grammar_tokenizer

    def token_text(self, token: int) -> bytes:
        return llama_cpp.llama_vocab_get_text(self._vocab, token) or b""

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    @property
    def vocab_type(self) -> int:
        return int(llama_cpp.llama_vocab_type(self._vocab))

    @property
    def bos(self) -> int:
        return int(llama_cpp.llama_vocab_bos(self._vocab))

    @property
    def eos(self) -> int:
        return int(llama_cpp.llama_vocab_eos(self._vocab))

    @property
    def add_bos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))

    @property
    def add_eos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_eos(self._vocab))

    def chat_template(self) -> Optional[str]:
        template = llama_cpp.llama_model_chat_template(self._model, None)
        return template.decode("utf-8") if template else None

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None) -> str:
        """Render messages (and tools, as the template's `tools` variable) with the chat template
        stored in the GGUF (jinja, as transformers does)."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        template = self.chat_template()
        if template is None:
            raise InvalidParameterError("messages", "...", "used with a model whose GGUF has a chat template; "
                                        "this one has none, so pass a plain prompt to generate()")
        formatter = Jinja2ChatFormatter(
            template=template,
            eos_token=self.token_text(self.eos).decode("utf-8", errors="replace"),
            bos_token=self.token_text(self.bos).decode("utf-8", errors="replace"),
            add_generation_prompt=add_generation_prompt,
        )
        import jinja2

        try:
            return formatter(messages=messages, tools=tools).prompt
        except jinja2.TemplateError as e:  # a template's raise_exception(): roles out of order, ...
            raise InvalidParameterError("messages", "...", f"messages the chat template of {self.name} accepts; "
                                        f"it says: {e}") from None

    def meta(self, key: str) -> Optional[str]:
        buf = ctypes.create_string_buffer(512)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, 512)
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else None

    @property
    def n_params(self) -> int:
        return int(llama_cpp.llama_model_n_params(self._model))

    @property
    def model_bytes(self) -> int:
        return int(llama_cpp.llama_model_size(self._model))

    # --- decoding ---------------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], *, n_logits: int = 1, aligned: bool = False) -> None:
        """Append tokens to the KV cache at positions len(cached)..; keep logits for the last n_logits.

        Tokens go to llama.cpp in chunks of at most n_batch; aligned chunks end at multiples of
        n_batch (position 0 being the first), as a prefill from an empty cache does.
        Raises ContextFullError (nothing appended) when they do not fit; on any failure or
        interruption the cache is rolled back to where it was (a recurrent memory with no
        checkpoint there: to an earlier point, as discard() does).
        """
        self._settle()
        if not tokens:
            raise ValueError("decode needs at least one token")
        if self._n_pending:  # they go first, in the same batch
            tokens = [*self.cached[-self._n_pending:], *tokens]
            del self.cached[-self._n_pending:]
            self._n_pending = 0
        n_past = len(self.cached)
        if n_past + len(tokens) > self.n_ctx:
            raise ContextFullError(
                f"{self.name}: {n_past} cached + {len(tokens)} new tokens exceed the context of "
                f"{self.n_ctx} tokens; raise n_ctx or shorten the prompt"
            )
        if not 0 < n_logits <= min(len(tokens), self.n_batch):
            raise ValueError(f"n_logits={n_logits} must be in 1..{min(len(tokens), self.n_batch)}")
        self._pinned, self._row_of = None, None
        if self.rollback != "seq_rm" and (self._revisit or len(tokens) > 1):
            self._save_checkpoint()
        self._revisit, self._window = False, None
        try:
            for start, end in chunk_bounds(n_past, len(tokens), self.n_batch, aligned):
                chunk = tokens[start:end]
                # logits are only kept for the final chunk; all requested rows must be in it
                n_chunk_logits = n_logits - (len(tokens) - end)
                self._batch.fill(chunk, n_past + start, max(0, n_chunk_logits))
                self._check(llama_cpp.llama_decode(self._ctx, self._batch.c), n_past + start, len(chunk))
                self.cached.extend(chunk)
                if self.mtp_head is not None:
                    self.mtp_head.follow(self.cached, n_past + start)
            self._n_rows = n_logits
            self._n_last_chunk = len(chunk)
            if self.rollback == "n_rs_seq":
                self._window = (n_past + start, n_past + end)
        except BaseException:
            self._n_rows = 0
            self.discard(n_past)
            raise

    def decode_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> None:
        """Decode a tree in one pass, keeping every row's logits (logits(i) is tokens[i]'s):
        tokens[0] follows the cache (parents[0] == -1), each later token follows
        tokens[parents[i]], an earlier one.

        Each branch (root to leaf) is a sequence of its own and a token is in every sequence
        through it, so a shared prefix is computed once and no branch sees another. Until
        truncate(n_keep, path) keeps one path, cached holds the tokens in tree order.
        """
        self._settle()
        n = len(tokens)
        if len(parents) != n or not n or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents[1:], 1)):
            raise ValueError("a tree is tokens[0] (parent -1), then tokens whose parents come before them")
        n_leaves = n - len(set(parents[1:]))
        # tokens kept from an earlier tree but not yet in the KV cache go first, as its trunk
        pending = self.cached[len(self.cached) - self._n_pending:]
        n_pre, n_kv = len(pending), len(self.cached) - self._n_pending
        if n_leaves > self.n_branches or n_pre + n > self.n_batch:
            raise ValueError(f"a tree of {n} tokens and {n_leaves} branches exceeds this context's "
                             f"{self.n_branches} branches or batch of {self.n_batch}")
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        if n_kv + n_pre + n > self.n_ctx:
            raise ContextFullError(f"{self.name}: {len(self.cached)} cached + a tree of {n} tokens exceed the "
                                   f"context of {self.n_ctx} tokens; raise n_ctx or shorten the prompt")
        # the branch of first children (sequence 0, what the cache keeps of the tree) comes
        # first in the batch, so its cells precede every other branch's: whatever is dropped
        # afterwards, the cells kept stay in position order, as a chain's are, and later
        # tokens fill the cells right after them (attention sums over cells in cell order)
        chain, node = [0], 0
        children = [[] for _ in range(n)]
        for i in range(1, n):
            children[parents[i]].append(i)
        while children[node]:
            node = children[node][0]
            chain.append(node)
        order = chain + [i for i in range(n) if i not in set(chain)]
        leaves = [i for i in order if not children[i]]  # sequence k: the k-th leaf, sequence 0 the chain's
        seqs: list[list[int]] = [[] for _ in range(n)]
        for seq, leaf in enumerate(leaves):
            node = leaf
            while node != -1:
                seqs[node].append(seq)
                node = parents[node]
        self._pinned, self._window = None, None
        for seq in range(1, len(leaves)):  # each branch sees the cached prefix
            llama_cpp.llama_memory_seq_cp(self._mem, 0, seq, -1, -1)
        every = list(range(len(leaves)))
        self._batch.fill_tree([*pending, *(tokens[i] for i in order)],
                              [*range(n_kv, n_kv + n_pre), *(n_kv + n_pre + depth[i] for i in order)],
                              [*([every] * n_pre), *(seqs[i] for i in order)], n_pre)
        try:
            self._check(llama_cpp.llama_decode(self._ctx, self._batch.c), n_kv, n_pre + n)
        except BaseException:
            for seq in range(1, len(leaves)):
                llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
            llama_cpp.llama_memory_seq_rm(self._mem, 0, n_kv, -1)
            del self.cached[n_kv:]  # the pending tokens too: as discard() would
            self._n_pending, self._n_rows = 0, 0
            raise
        self.cached.extend(tokens)
        self._n_pending = 0
        self._tree = (len(self.cached) - n, list(parents), set(chain), len(leaves))
        self._row_of = [0] * n
        for index, i in enumerate(order):
            self._row_of[i] = n_pre + index
        self._n_rows = self._n_last_chunk = n

    def _settle(self, path: Optional[Sequence[int]] = None) -> None:
        """After a tree decode, keep one root-to-node path (tree indices; None: the branch of
        first children) as what the cache holds. The KV cache keeps the path's part on that
        branch; the tokens after it that left the branch are kept pending, decoded in front
        of the next batch (a few rows more in it, in order like any chain)."""
        if self._tree is None:
            return
        n_root, parents, chain, n_seqs = self._tree
        if path is None:
            path = sorted(chain)
        if list(path[:1]) != [0] or any(not 0 <= b < len(parents) or parents[b] != a for a, b in zip(path, path[1:])):
            raise ValueError(f"{list(path)} is not a path from the tree's root")  # the tree stays as it was
        self._tree, self._row_of = None, None
        for seq in range(1, n_seqs):
            llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
        n_on_chain = next((k for k, i in enumerate(path) if i not in chain), len(path))
        tree_tokens = self.cached[n_root:]
        self.cached[n_root:] = [tree_tokens[i] for i in path]
        llama_cpp.llama_memory_seq_rm(self._mem, 0, n_root + n_on_chain, -1)
        self._n_pending = len(path) - n_on_chain

    @property
    def n_pending(self) -> int:
        """Cached tokens not in the KV cache yet: they go in front of the next decode's batch."""
        return self._n_pending

    def flush_pending(self) -> None:
        """Decode the pending tokens one at a time (rows bitwise a single token's)."""
        self._settle()
        pending = self.cached[len(self.cached) - self._n_pending:]
        del self.cached[len(self.cached) - self._n_pending:]
        self._n_pending = 0
        for token in pending:
            self.decode([token])

    def _check(self, status: int, pos: int, n_tokens: int) -> None:
        if status == 0:
            return
        if status == 1:
            raise ContextFullError(
                f"{self.name}: no KV cache slot for {n_tokens} tokens at position {pos}; "
                "raise n_ctx or shorten the prompt"
            )
        if status == 2:
            raise DecodeError(f"{self.name}: llama_decode was aborted")
        raise DecodeError(f"{self.name}: llama_decode failed with status {status}")

    def logits(self, row: int) -> np.ndarray:
        """Zero-copy view of logit row `row` (0-based among the rows the last decode kept).

        The view is only valid until the next decode.
        """
        if not 0 <= row < self._n_rows:
            raise IndexError(f"logit row {row} was not requested by the last decode ({self._n_rows} rows)")
        if self._pinned is not None:
            return self._pinned
        index = self._row_of[row] if self._row_of is not None else self._n_last_chunk - self._n_rows + row
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, index)
        if not ptr:
            raise DecodeError(f"{self.name}: llama.cpp returned no logits for batch row {index}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def truncate(self, n_keep: int, path: Optional[Sequence[int]] = None) -> None:
        """Drop every cached token at position >= n_keep: the cache then holds cached[:n_keep].

        Where the memory cannot drop them (a recurrent state restored to an earlier
        checkpoint), the tokens from there to n_keep are decoded again. After decode_tree,
        path (batch indices from the root) is the branch kept first; n_keep cuts it.
        """
        self._settle(path)
        if n_keep >= len(self.cached):
            return
        kept = self.cached[:n_keep]
        t0 = time.perf_counter()
        try:
            self.discard(n_keep)
            if len(self.cached) < n_keep:
                replay = kept[len(self.cached):]
                self.decode(replay)
                self.n_replayed += len(replay)
        finally:
            self.t_rollback += time.perf_counter() - t0
        self._revisit = True

    def discard(self, n_keep: int) -> None:
        """Drop the cached tokens at position >= n_keep, and more where the memory cannot stop
        there without decoding again: afterwards cached is a prefix of cached[:n_keep]."""
        self._settle()
        if n_keep >= len(self.cached):
            return
        n_in_kv = len(self.cached) - self._n_pending
        if n_keep >= n_in_kv:  # only pending tokens go: the KV cache is as it was
            n_to = n_keep
            self._n_pending = n_keep - n_in_kv
        else:
            self._n_pending = 0
            n_to = self._drop_to(n_keep)
        del self.cached[n_to:]
        if self.mtp_head is not None:
            self.mtp_head.truncate(n_to)
        self.n_canonical = min(self.n_canonical, n_to)
        if self.prefill_row is not None and n_to < self.prefill_row.n_tokens:
            self.prefill_row = None
        self._n_rows, self._pinned, self._window = 0, None, None
        if self._checkpoint is not None and self._checkpoint[0] > n_to:
            self._checkpoint = None
        self._revisit = True

    def n_reachable(self, n_keep: int) -> int:
        """How many of the first n_keep cached tokens discard(n_keep) keeps."""
        self._settle()
        if n_keep >= len(self.cached):
            return len(self.cached)
        return {"seq_rm": n_keep, "checkpoint": self._checkpoint[0] if self._checkpoint else 0,
                None: 0}[self._way_back(n_keep)]

    def _way_back(self, n_keep: int) -> Optional[str]:
        """How the memory can drop positions >= n_keep: "seq_rm" (at n_keep), "checkpoint"
        (at the checkpoint, before n_keep) or None (only by starting over)."""
        if self.rollback == "seq_rm":
            return "seq_rm"
        if self._window is not None:
            # snapshots exist for the last batch only, once, and never for the state before it
            start, end = self._window
            if start < n_keep < end and end - n_keep <= self.n_rs_seq:
                return "seq_rm"
        if self._checkpoint is not None and self._checkpoint[0] <= n_keep:
            return "checkpoint"
        return None

    def _drop_to(self, n_keep: int) -> int:
        """Remove positions >= n_reachable(n_keep) from the memory; that number."""
        way = self._way_back(n_keep)
        if way == "seq_rm":
            if llama_cpp.llama_memory_seq_rm(self._mem, 0, n_keep, -1):
                return n_keep
        elif way == "checkpoint":
            n_at, data = self._checkpoint  # its recurrent state first, then the KV cache after it
            buf = (ctypes.c_uint8 * len(data)).from_buffer(data)
            if llama_cpp.llama_state_seq_set_data_ext(self._ctx, buf, len(data), 0, _CHECKPOINT) \
                    and llama_cpp.llama_memory_seq_rm(self._mem, 0, n_at, -1):
                return n_at
        llama_cpp.llama_memory_seq_rm(self._mem, 0, -1, -1)  # nothing to go back to: start over
        self._checkpoint = None
        return 0

    def _save_checkpoint(self) -> None:
        """Copy the recurrent state at len(cached), unless the checkpoint already holds it."""
        n_at = len(self.cached)
        if self._checkpoint is not None and self._checkpoint[0] == n_at:
            return
        size = llama_cpp.llama_state_seq_get_size_ext(self._ctx, 0, _CHECKPOINT)
        data = self._checkpoint[1] if self._checkpoint is not None and len(self._checkpoint[1]) == size \
            else bytearray(size)
        self._checkpoint = None
        buf = (ctypes.c_uint8 * size).from_buffer(data)
        if llama_cpp.llama_state_seq_get_data_ext(self._ctx, buf, size, 0, _CHECKPOINT) != size:
            raise DecodeError(f"{self.name}: llama.cpp could not copy the recurrent state at {n_at} tokens")
        self._checkpoint = (n_at, data)

    @property
    def n_nextn(self) -> int:
        """MTP (nextn) layers in the model's GGUF, loaded or not."""
        return int(llama_cpp.llama_model_n_layer_nextn(self._model))

    def hidden_states(self, n_rows: int) -> np.ndarray:
        """The hidden state of each token of the last decode call, (n_rows, n_embd): what MTP
        layers predict from. Valid until the next decode."""
        ptr = _mtp_api().llama_get_embeddings_nextn(self._ctx)
        if not ptr:
            raise DecodeError(f"{self.name}: llama.cpp returned no hidden states for the MTP layers")
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_embd))

    @property
    def n_embd(self) -> int:
        return int(llama_cpp.llama_model_n_embd_out(self._model)) or int(llama_cpp.llama_model_n_embd(self._model))

    @property
    def max_verify(self) -> int:
        """The largest batch whose tokens can all be rolled back but the first."""
        return min(self.n_batch, self.n_rs_seq + 1) if self.rollback == "n_rs_seq" else self.n_batch

    @property
    def checkpoint_bytes(self) -> int:
        """Size of one checkpoint of this sequence's recurrent state (0 for attention memory)."""
        if self.memory == "attention":
            return 0
        return int(llama_cpp.llama_state_seq_get_size_ext(self._ctx, 0, _PARTIAL))

    def prefill(self, tokens: Sequence[int], n_reuse: int) -> int:
        """Make the cache hold tokens, with logits for the last one, keeping its first n_reuse
        (which must be tokens[:n_reuse]) and computing the rest in aligned chunks.

        Started from a canonical prefix that ends on a chunk boundary, the result is canonical
        up to the last whole chunk: a later prompt that extends tokens reuses that bit for bit.
        n_reuse == len(tokens) takes the last row from prefill_row, which must be this prompt's.
        Returns the tokens reused: fewer than n_reuse where a recurrent memory could only go
        back to an earlier checkpoint.
        """
        tokens = list(tokens)
        self._settle()
        if not 0 <= n_reuse <= len(tokens) or self.cached[:n_reuse] != tokens[:n_reuse]:
            raise ValueError(f"cannot reuse {n_reuse} cached tokens for a prompt of {len(tokens)}")
        if n_reuse == len(tokens):
            if self.prefill_row is None or self.prefill_row.n_tokens != len(tokens):
                raise ValueError("the whole prompt can be reused only with the row its own prefill kept")
            self.truncate(n_reuse)
            self._pinned, self._n_rows = self.prefill_row.logits, 1
            return n_reuse
        self.discard(n_reuse)  # a recurrent memory may have to start from an earlier checkpoint
        n_reuse = len(self.cached)
        canonical_start = n_reuse <= self.n_canonical and n_reuse % self.n_batch == 0
        self.decode(tokens[n_reuse:], n_logits=1, aligned=True)
        if canonical_start:
            self.n_canonical = len(tokens) // self.n_batch * self.n_batch
        self.prefill_row = PrefillRow(len(tokens), self.logits(0).copy(), canonical_start)
        return n_reuse

    def save_state(self) -> SavedState:
        """A copy of this sequence's memory, to restore_state() later (llama_state_seq_get_data)."""
        self._settle()
        if self._n_pending:  # the state is the KV cache's: put the pending tokens in it first
            last = self.cached.pop()
            self._n_pending -= 1
            self.decode([last])
        size = llama_cpp.llama_state_seq_get_size(self._ctx, 0)
        data = bytearray(size)
        n = llama_cpp.llama_state_seq_get_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(data), size, 0)
        if n != size:
            raise DecodeError(f"{self.name}: llama.cpp copied {n} of the {size} bytes of the sequence state")
        return SavedState(list(self.cached), self.n_canonical, data, self.prefill_row)

    def restore_state(self, saved: SavedState) -> None:
        """Put a saved_state() back: the cache then holds saved.tokens exactly as they were."""
        self._n_rows, self._pinned = 0, None
        self._tree, self._row_of, self._n_pending = None, None, 0
        self._checkpoint, self._window, self._revisit = None, None, True
        if self.mtp_head is not None:  # its entries were for the sequence replaced here
            self.mtp_head.truncate(0)
        buf = (ctypes.c_uint8 * saved.n_bytes).from_buffer(saved.data)
        if not llama_cpp.llama_state_seq_set_data(self._ctx, buf, saved.n_bytes, 0):
            llama_cpp.llama_memory_seq_rm(self._mem, 0, -1, -1)
            self.cached, self.n_canonical, self.prefill_row = [], 0, None
            raise DecodeError(f"{self.name}: llama.cpp could not restore a saved sequence state "
                              f"of {len(saved.tokens)} tokens")
        self.cached, self.n_canonical, self.prefill_row = list(saved.tokens), saved.n_canonical, saved.prefill_row

    def sync(self, tokens: Sequence[int]) -> None:
        """Make the cache hold tokens[:-1] + tokens[-1] with logits for the last one.

        Reuses the longest cached prefix and decodes only the rest (always at least one token).
        """
        self._settle()
        n_common = common_prefix(self.cached, tokens)
        self.discard(min(n_common, len(tokens) - 1))  # what a checkpoint restore drops is decoded here
        self._revisit = True  # a draft comes back here after drafting: keep a checkpoint
        self.decode(tokens[len(self.cached):], n_logits=1)


_PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
# checkpoints stay in the backend's own buffers (one per sequence, kept by the context): on a
# GPU a host round trip of the state can cost more than speculation saves (llama.cpp #28118);
# the host gets a few bytes of bookkeeping. Same bits as a host copy (tests/test_hybrid.py).
_CHECKPOINT = _PARTIAL | llama_cpp.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE


def _memory_kind(model_ptr: Any, granted: int, name: str, requested: Optional[str]) -> tuple[str, str]:
    """(memory type, rollback): "attention", "hybrid" or "recurrent", and one of ROLLBACKS."""
    if llama_cpp.llama_model_is_hybrid(model_ptr):
        memory = "hybrid"
    elif llama_cpp.llama_model_is_recurrent(model_ptr):
        memory = "recurrent"
    else:
        memory = "attention"
    if memory == "attention":
        return memory, "seq_rm"
    if requested == "seq_rm":
        raise InvalidParameterError("rollback", requested, f"n_rs_seq, checkpoint or None for {name}: its {memory} "
                                    "memory keeps no state per position, so seq_rm cannot drop tokens from it")
    if requested == "n_rs_seq" and not granted:
        raise InvalidParameterError("rollback", requested, f"checkpoint or None for {name}: llama.cpp keeps no "
                                    "per-token snapshots for this architecture")
    return memory, requested or ("n_rs_seq" if granted else "checkpoint")


def cpu_count() -> int:
    """The CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may use (containers, taskset)
    except AttributeError:  # macOS
        return os.cpu_count() or 4


def _system_info() -> str:
    info = llama_cpp.llama_print_system_info()
    return info.decode("utf-8", "replace") if info else ""


def chunk_bounds(n_past: int, n_tokens: int, n_batch: int, aligned: bool) -> list[tuple[int, int]]:
    """(start, end) of each chunk of n_tokens tokens appended at position n_past, as offsets into
    them; aligned chunks end at multiples of n_batch counted from position 0."""
    bounds, start = [], 0
    while start < n_tokens:
        room = n_batch - (n_past + start) % n_batch if aligned else n_batch
        end = min(n_tokens, start + room)
        bounds.append((start, end))
        start = end
    return bounds


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0])


def supports_gpu_offload() -> bool:
    """Whether llama.cpp has a local GPU to offload to (Metal, CUDA, ...). Not
    llama_supports_gpu_offload(), which is also true for any build with the RPC backend."""
    return any(d.kind in ("gpu", "igpu") and d.rpc_endpoint is None for d in devices())


def open_runtime(model: Any, settings: ModelSettings, mtp: bool = False, n_branches: int = 1) -> Runtime:
    """A Runtime for a GGUF path or a borrowed llama_cpp.Llama."""
    if isinstance(model, llama_cpp.Llama):
        return Runtime.borrow(model)
    if isinstance(model, (str, os.PathLike)):
        return Runtime.load(model, settings, mtp=mtp, n_branches=n_branches)
    raise InvalidParameterError("model", model, "a .gguf path or a llama_cpp.Llama")
