"""llama.cpp's process-wide parts: the backend, its log, the ggml device registry, build info.

llama-cpp-python binds llama.h only; the device registry lives in ggml-backend.h, so the few
functions needed are bound here with ctypes.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import llama_cpp
import psutil
from llama_cpp._ggml import libggml

from .settings import Device

_DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")  # enum ggml_backend_dev_type, in order


def bind(name: str, restype: Any, *argtypes: Any) -> Any:
    function = getattr(libggml, name)
    function.restype, function.argtypes = restype, list(argtypes)
    return function


dev_count = bind("ggml_backend_dev_count", ctypes.c_size_t)
dev_get = bind("ggml_backend_dev_get", ctypes.c_void_p, ctypes.c_size_t)
dev_name = bind("ggml_backend_dev_name", ctypes.c_char_p, ctypes.c_void_p)
dev_type = bind("ggml_backend_dev_type", ctypes.c_int, ctypes.c_void_p)
_dev_description = bind("ggml_backend_dev_description", ctypes.c_char_p, ctypes.c_void_p)
_dev_memory = bind("ggml_backend_dev_memory", None, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
reg_count = bind("ggml_backend_reg_count", ctypes.c_size_t)
reg_get = bind("ggml_backend_reg_get", ctypes.c_void_p, ctypes.c_size_t)
reg_name = bind("ggml_backend_reg_name", ctypes.c_char_p, ctypes.c_void_p)
reg_by_name = bind("ggml_backend_reg_by_name", ctypes.c_void_p, ctypes.c_char_p)
reg_proc_address = bind("ggml_backend_reg_get_proc_address", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
register = bind("ggml_backend_register", None, ctypes.c_void_p)
_dev_backend_reg = bind("ggml_backend_dev_backend_reg", ctypes.c_void_p, ctypes.c_void_p)


LOG_ERROR, LOG_CONT = 4, 5  # ggml_log_level: an error, the rest of the previous message


class _LogSink:
    """Routes llama.cpp's process-wide log callback; silent unless a runtime asked for verbose.

    A Ctrl-C that arrives while llama.cpp works (loading a model) is raised by Python inside
    this callback, where ctypes would print and swallow it: it is kept instead, and llama.cpp's
    progress callback then stops the load, so the interrupt reaches the caller (raise_interrupt)."""

    def __init__(self) -> None:
        self.verbose = False
        self.interrupt: Optional[BaseException] = None
        self._local = threading.local()  # errors: the list a caller collects this thread's errors in
        self._callback = llama_cpp.llama_log_callback(self._write)
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    def _write(self, level: int, text: bytes, user_data: Any) -> None:
        try:
            if self.verbose:
                sys.stderr.write(text.decode("utf-8", errors="replace"))
            errors = getattr(self._local, "errors", None)
            if errors is not None:
                error = level == LOG_ERROR or (level == LOG_CONT and getattr(self._local, "in_error", False))
                self._local.in_error = error
                if error:
                    errors.append(text.decode("utf-8", errors="replace"))
        except BaseException as e:  # KeyboardInterrupt, raised here by Python's signal handler
            self.interrupt = e

    @contextmanager
    def errors(self) -> Iterator[list[str]]:
        """The error lines llama.cpp logs in this thread meanwhile (a failed llama_decode says why
        only in its log: a status of -1 is any invalid batch), whether or not verbose is on."""
        self._local.errors, self._local.in_error = [], False
        try:
            yield self._local.errors
        finally:
            self._local.errors = None

    def keep_loading(self, fraction: float, user_data: Any) -> bool:
        """llama.cpp's progress callback for a model load: False (stop) once Ctrl-C was pressed."""
        try:
            return self.interrupt is None
        except BaseException as e:  # the interrupt may land here too
            self.interrupt = e
            return False

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """Around a long llama.cpp call (in the main thread): Ctrl-C is only noted, by a handler
        that raises nothing, since a KeyboardInterrupt raised as a callback starts, before its
        try, is printed and dropped by ctypes (a Ctrl-C at 1.5 s into a load was lost that way);
        the progress callback then stops the load and raise_interrupt() raises it."""
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield
            return
        previous = signal.signal(signal.SIGINT, lambda signum, frame: setattr(self, "interrupt", KeyboardInterrupt()))
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def raise_interrupt(self) -> None:
        """Raise a Ctrl-C that arrived inside a llama.cpp call, once that call has returned."""
        interrupt, self.interrupt = self.interrupt, None
        if interrupt is not None:
            raise interrupt


# llama.cpp keeps one log callback per process, so its Python side is one object too.
LOG_SINK = _LogSink()
_BACKEND_ONCE = threading.Lock()
_backend_ready = False


def init_backend() -> None:
    global _backend_ready
    with _BACKEND_ONCE:
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            _backend_ready = True


def system_info() -> str:
    info = llama_cpp.llama_print_system_info()
    return info.decode("utf-8", "replace") if info else ""


def backends() -> list[str]:
    """The ggml backends compiled into this llama.cpp build ("CPU", "CUDA", "Metal", ...)."""
    init_backend()
    return [(reg_name(reg_get(i)) or b"?").decode("utf-8", "replace") for i in range(reg_count())]


def build_info() -> dict:
    """This llama.cpp build: llama-cpp-python's version and llama.cpp's system info line."""
    return {"llama_cpp_python": llama_cpp.__version__, "system_info": system_info().strip(" |")}


def devices() -> list[Device]:
    """Every device llama.cpp can use, with free and total memory as its backend reports them
    (CUDA and Metal report what is free right now; the CPU reports physical memory)."""
    init_backend()
    out = []
    for i in range(dev_count()):
        dev = dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        _dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = dev_type(dev)
        description = (_dev_description(dev) or b"").decode("utf-8", "replace")
        is_rpc = reg_name(_dev_backend_reg(dev)) == b"RPC"  # an RPC device's description is its endpoint
        out.append(Device(dev_name(dev).decode("utf-8", "replace"), description,
                          _DEVICE_KINDS[kind] if 0 <= kind < len(_DEVICE_KINDS) else f"type {kind}",
                          free.value, total.value, description if is_rpc else None))
    return out


def device_kind(dev: int) -> str:
    kind = dev_type(dev)
    return _DEVICE_KINDS[kind] if 0 <= kind < len(_DEVICE_KINDS) else f"type {kind}"


def supports_gpu_offload() -> bool:
    """Whether llama.cpp has a local GPU to offload to (Metal, CUDA, ...). Not
    llama_supports_gpu_offload(), which is also true for any build with the RPC backend."""
    return any(d.kind in ("gpu", "igpu") and d.rpc_endpoint is None for d in devices())


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


def gpu_free() -> int:
    return sum(d.free for d in devices() if d.discrete)
