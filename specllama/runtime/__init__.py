"""The only package that touches llama_cpp. One concern a module:

    settings     ModelSettings, devices as data, RPC endpoints (pure: no llama.cpp)
    ggml         the backend, its log, the device registry, build info
    rpc          llama.cpp's RPC backend: workers, reachability, serving this machine
    handles      model, context and batch handles that null their pointer when freed
    vocab        tokens, pieces, special tokens, chat templates, FIM tokens
    memory       how rejected tokens leave memory: seq_rm, n_rs_seq snapshots, checkpoints
    batches      prefill chunks, and a tree as one multi-sequence batch
    session      prefill on a cached prefix, sync: shared by every model
    state        saved sequence states and a prefill's kept row
    core         Runtime: one model, its context, exactly what its KV cache holds
    loading      loading a Runtime, or borrowing a llama_cpp.Llama
    measure_key  what a measurement of a loaded model depends on
    state_key    what decides a saved state's bits (file content, build, settings): its key on disk
    mtp          a model's MTP layers as a draft
    remote       a model on RPC workers, in a host process (remote_host; host_link: the pipe to it)
    protocols    what the loop, proposers and prompt cache call on a model

Names are imported on first use, so `from specllama.runtime import ModelSettings` (the memory
plan's) loads no llama.cpp.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ModelSettings": "settings", "Device": "settings", "offload_devices": "settings",
    "parse_endpoints": "settings", "cpu_count": "settings", "KV_CACHE_TYPES": "settings", "ROLLBACKS": "settings",
    "N_RS_SEQ": "settings",
    "backends": "ggml", "build_info": "ggml", "devices": "ggml", "supports_gpu_offload": "ggml",
    "resident_bytes": "ggml", "MemoryUse": "ggml",
    "supports_rpc": "rpc", "serve_rpc": "rpc", "add_rpc_workers": "rpc", "NO_RPC_BUILD": "rpc",
    "PrefillRow": "state", "SavedState": "state",
    "chunk_bounds": "batches", "TreeBatch": "batches",
    "common_prefix": "session",
    "Runtime": "core", "open_runtime": "core",
    "MtpHead": "mtp", "MtpUnavailable": "mtp",
    "RemoteRuntime": "remote",
    "Drafter": "protocols", "Model": "protocols", "Vocabulary": "protocols",
    "load_runtime": "loading", "borrow_runtime": "loading", "SlotUnavailable": "protocols",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(_WHERE)


__all__ = sorted(_WHERE)
