"""Per-model settings and the plain facts the memory plan needs, without loading llama.cpp.

Everything here is pure Python (plan.py imports it to plan memory before anything loads).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from gguf import GGMLQuantizationType

from ..errors import InvalidParameterError
from ..decoding.limits import MAX_DRAFT

# KV cache element types users may name; values are ggml_type ids (the gguf package's table).
KV_CACHE_TYPES = {name: int(GGMLQuantizationType[name.upper()])
                  for name in ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")}

# Ways to drop the last tokens from a model's memory (see memory.py):
#   seq_rm      attention KV cache: remove the positions (llama_memory_seq_rm)
#   n_rs_seq    recurrent state snapshots per token of the last batch (llama.cpp's n_rs_seq): a
#               rollback of 1..N_RS_SEQ tokens right after a batch, keeping its first token
#   checkpoint  copy the recurrent state before a batch (llama_state_seq_get_data_ext with
#               PARTIAL_ONLY), restore it and decode the accepted tokens again
ROLLBACKS = ("seq_rm", "n_rs_seq", "checkpoint")
N_RS_SEQ = MAX_DRAFT  # snapshots asked for: a verify batch of the longest draft rolls back whole


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
            object.__setattr__(self, "tensor_split", _parse_split(self.tensor_split))
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
        if self.flash_attn not in (None, True, False):
            raise InvalidParameterError("flash_attn", self.flash_attn, "True, False or None (auto)")
        if self.rollback not in (None, *ROLLBACKS):
            raise InvalidParameterError("rollback", self.rollback, f"one of {', '.join(ROLLBACKS)} or None (the "
                                        "fastest the model's memory supports)")
        for name in ("type_k", "type_v"):
            value = getattr(self, name)
            if value is not None and value not in KV_CACHE_TYPES:
                raise InvalidParameterError(name, value, f"one of {', '.join(KV_CACHE_TYPES)} or None")

    @property
    def threads(self) -> tuple[int, int]:
        """(n_threads, n_threads_batch) as the context gets them."""
        n = self.n_threads or cpu_count()  # llama.cpp's own default is 4 whatever the machine
        return n, self.n_threads_batch or n


def _parse_split(split: Any) -> tuple[float, ...]:
    if isinstance(split, str):
        split = [s for s in split.split(",") if s.strip()]
    try:
        out = tuple(float(x) for x in split)
    except (TypeError, ValueError):
        out = ()
    if not out or any(x < 0 for x in out) or sum(out) <= 0:
        raise InvalidParameterError("tensor_split", split, "shares >= 0 per device with a positive sum, e.g. (3, 1) "
                                    "or '3,1'")
    return out


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


def offload_devices(found: Sequence[Device], endpoints: Sequence[str]) -> list[Device]:
    """The devices a model with RPC workers offloads to, in llama.cpp's order: the workers'
    devices in the order named, then local GPUs (integrated ones only without a discrete one)."""
    workers = [d for endpoint in endpoints for d in found if d.rpc_endpoint == endpoint]
    local = [d for d in found if d.rpc_endpoint is None and d.kind == "gpu"] or \
            [d for d in found if d.rpc_endpoint is None and d.kind == "igpu"]
    return workers + local


def cpu_count() -> int:
    """The CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may use (containers, taskset)
    except AttributeError:  # macOS
        return os.cpu_count() or 4
