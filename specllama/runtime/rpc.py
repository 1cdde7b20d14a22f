"""llama.cpp's RPC backend (ggml-rpc): registering workers, and serving this machine as one."""

from __future__ import annotations

import ctypes
import socket
import threading
from collections.abc import Sequence
from typing import Any, Optional

from ..errors import RpcError
from . import ggml
from .settings import Device, offload_devices

CONNECT_TIMEOUT = 3.0  # seconds a worker has to accept a TCP connection before it counts as unreachable
NO_RPC_BUILD = ("this llama.cpp build has no RPC backend; rebuild it with SPECLLAMA_RPC=1 bash scripts/setup.sh "
                "(or CMAKE_ARGS=-DGGML_RPC=ON pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36)")


def supports_rpc() -> bool:
    """Whether this llama.cpp build has the RPC backend (GGML_RPC=ON)."""
    ggml.init_backend()
    return bool(ggml.reg_by_name(b"RPC"))


def _rpc_function(name: str, restype: Any, *argtypes: Any) -> Any:
    # the RPC functions are reached through the backend registry, as llama.cpp's rpc-server does,
    # which works whether ggml links its backends in or loads them as plugins
    if not supports_rpc():
        raise RpcError(NO_RPC_BUILD)
    address = ggml.reg_proc_address(ggml.reg_by_name(b"RPC"), name.encode())
    if not address:
        raise RpcError(f"this llama.cpp build's RPC backend has no {name}")
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


def add_rpc_workers(endpoints: Sequence[str]) -> None:
    """Register RPC workers' devices, as llama.cpp's --rpc does: models loaded afterwards in this
    process put their offloaded layers on them, ahead of any local GPU.

    ggml-rpc aborts the whole process when a worker cannot be reached or is lost, so only a
    process that may die calls this: remote_host.py's host of one model.
    """
    add = _rpc_function("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)
    for endpoint in endpoints:
        reg = add(endpoint.encode())
        if not reg:
            raise RpcError(f"the RPC worker at {endpoint} reports no devices")
        ggml.register(reg)


def rpc_model_devices(endpoints: Sequence[str]) -> list[int]:
    """Device handles for a model whose layers go to the RPC workers at endpoints (added first)."""
    found = ggml.devices()
    missing = [e for e in endpoints if not any(d.rpc_endpoint == e for d in found)]
    if missing:
        raise RpcError(f"RPC worker {', '.join(missing)} is not connected in this process", tuple(missing))
    handles = {ggml.dev_name(ggml.dev_get(i)).decode("utf-8", "replace"): ggml.dev_get(i)
               for i in range(ggml.dev_count())}
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
    ptrs = [ggml.dev_get(i) for i in range(ggml.dev_count())]
    served = [p for p in ptrs if ggml.device_kind(p) not in ("cpu", "accel")] or \
             [p for p in ptrs if ggml.device_kind(p) == "cpu"][:1]
    listed = {d.name: d for d in ggml.devices()}
    array = (ctypes.c_void_p * len(served))(*served)
    cache = cache_dir.encode() if cache_dir else None
    thread = threading.Thread(target=start, args=(endpoint.encode(), cache, n_threads, len(served), array),
                              name=f"rpc-worker {endpoint}", daemon=True)
    thread.start()
    thread.join(0.5)  # it returns at once only when it could not start
    if not thread.is_alive():
        raise RpcError(f"llama.cpp's RPC server did not start on {endpoint} (its reason is printed above)")
    return [listed[ggml.dev_name(p).decode("utf-8", "replace")] for p in served]


def unreachable(endpoint: str, timeout: float = CONNECT_TIMEOUT) -> Optional[str]:
    """Why a TCP connection to endpoint fails, or None when it is accepted."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return None
    except socket.timeout:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()


def check_reachable(endpoints: Sequence[str]) -> None:
    """RpcError naming each worker that does not accept a connection; ggml-rpc would abort on it,
    or wait minutes on a host that does not answer."""
    down = {endpoint: why for endpoint in endpoints if (why := unreachable(endpoint))}
    if down:
        listed = "; ".join(f"{endpoint} ({why})" for endpoint, why in down.items())
        raise RpcError(f"cannot reach the RPC worker{'s' if len(down) > 1 else ''} {listed}. Start one on each "
                       "machine with `specllama worker --host ADDRESS --port PORT` (or llama.cpp's rpc-server "
                       "of the same version), and check that the port is open", tuple(down))
