"""What a measurement of a loaded model depends on: the key of its cached costs and fidelity.

The same model file under the same kernel-relevant settings and llama.cpp build measures the
same, whoever loaded it (load(), calibrate, doctor, bench): the key holds the file, the
effective threads, batch, offload, flash attention, KV types, RPC placement, rollback and
tree branches, and nothing that only sizes buffers (n_ctx: KV length is measured where it
matters, per KV group)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llama_cpp

from .ggml import system_info
from .settings import ModelSettings


def identity(path: Path, settings: ModelSettings, runtime: Any, mtp: bool) -> str:
    stat = path.stat()
    n_threads, n_threads_batch = settings.threads
    return "|".join([str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns),
                     f"batch={runtime.n_batch}", f"threads={n_threads}/{n_threads_batch}",
                     f"gpu_layers={settings.n_gpu_layers}", f"flash_attn={settings.flash_attn}",
                     f"kv={settings.type_k}/{settings.type_v}", f"rpc={','.join(settings.rpc)}",
                     f"split={settings.tensor_split}", f"rollback={runtime.rollback}",
                     f"branches={runtime.n_branches}", f"mtp={mtp}", llama_cpp.__version__, system_info()])
