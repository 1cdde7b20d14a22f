"""Memory planning from GGUF headers, before anything is loaded.

Two models in memory is the cost of speculative decoding, so the plan counts both: weights
(split into what n_gpu_layers offloads and what stays in RAM), the KV caches for n_ctx and the
cache types, and an allowance for compute buffers.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from . import gguf_check
from .errors import SpecLlamaError
from .runtime import ModelSettings

KV_BYTES_PER_ELEMENT = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32,
                        "q5_0": 22 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
GiB = 1024 ** 3


class MemoryPlanError(SpecLlamaError):
    """The models do not fit; the message has the breakdown and the ways out, cheapest first."""


@dataclass
class ModelPlan:
    name: str
    weights_ram: int
    weights_gpu: int
    kv: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights_ram + self.weights_gpu + self.kv + self.compute


@dataclass
class MemoryPlan:
    target: ModelPlan
    draft: Optional[ModelPlan]
    available_ram: int
    unified_memory: bool
    notes: list[str] = field(default_factory=list)

    @property
    def models(self) -> list[ModelPlan]:
        return [m for m in (self.target, self.draft) if m is not None]

    @property
    def needed_ram(self) -> int:
        # offloaded weights live in RAM too on Apple silicon (one pool) and are not counted twice
        return sum(m.weights_ram + m.kv + m.compute + (m.weights_gpu if self.unified_memory else 0)
                   for m in self.models)

    @property
    def fits(self) -> bool:
        return self.needed_ram <= self.available_ram

    def describe(self) -> str:
        lines = []
        for role, m in (("target", self.target), ("draft", self.draft)):
            if m is not None:
                lines.append(f"{role} {m.name}: weights {m.weights_ram / GiB:.2f} GiB in RAM + "
                             f"{m.weights_gpu / GiB:.2f} GiB offloaded, KV cache {m.kv / GiB:.2f} GiB, "
                             f"compute {m.compute / GiB:.2f} GiB")
        share = f" (draft {self.draft.total / max(1, self.needed_ram):.0%})" if self.draft else ""
        lines.append(f"needed {self.needed_ram / GiB:.2f} GiB of RAM{share}, available "
                     f"{self.available_ram / GiB:.2f} GiB" + (" (unified memory)" if self.unified_memory else ""))
        return "\n".join(lines + self.notes)


def model_plan(path: Path, settings: ModelSettings, gpu_offload: bool = False) -> ModelPlan:
    """One model's memory with its own context size, cache types, batch and offload."""
    n_ctx, n_batch, n_gpu_layers = settings.n_ctx, settings.n_batch, settings.n_gpu_layers
    header = gguf_check.read_header(path)
    f = header.fields
    arch = f.get("general.architecture", "")
    n_layer = int(f.get(f"{arch}.block_count", 0))
    n_head = int(f.get(f"{arch}.attention.head_count", 1) or 1)
    n_head_kv = f.get(f"{arch}.attention.head_count_kv", n_head)
    n_head_kv = int(n_head_kv if isinstance(n_head_kv, int) else n_head)
    n_embd = int(f.get(f"{arch}.embedding_length", 0))
    head_k = int(f.get(f"{arch}.attention.key_length", n_embd // n_head if n_head else 0))
    head_v = int(f.get(f"{arch}.attention.value_length", head_k))
    kv = int(n_layer * n_ctx * n_head_kv * (head_k * KV_BYTES_PER_ELEMENT[settings.type_k or "f16"]
                                           + head_v * KV_BYTES_PER_ELEMENT[settings.type_v or "f16"]))
    n_offload = 0 if not gpu_offload else (n_layer if n_gpu_layers < 0 else min(n_gpu_layers, n_layer))
    ram = gpu = 0
    for t in header.tensors:
        m = _LAYER_RE.match(t.name)
        on_gpu = (m is not None and int(m.group(1)) >= n_layer - n_offload) or \
                 (m is None and n_offload == n_layer and gpu_offload and t.name.startswith("output"))
        if on_gpu:
            gpu += t.n_bytes
        else:
            ram += t.n_bytes
    n_vocab = len(f.get("tokenizer.ggml.tokens") or [])
    # logits for a batch, attention scores for one micro-batch, and a fixed margin for graph buffers
    compute = n_vocab * n_batch * 4 + n_batch * n_ctx * n_head * 4 + 64 * 1024 ** 2
    return ModelPlan(path.name, ram, gpu, kv, compute)


def available_memory() -> tuple[int, bool]:
    """(bytes of RAM available to us, whether memory is unified with the GPU)."""
    if sys.platform == "darwin":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(total * 0.75), True  # Metal's default working-set limit is about 3/4 of RAM
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, False
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), False


def make_plan(target: Path, draft: Optional[Path], target_settings: ModelSettings,
              draft_settings: Optional[ModelSettings] = None, *, gpu_offload: bool = False,
              available: Optional[int] = None) -> MemoryPlan:
    """The memory plan for a target and optional draft, each with its own settings
    (the draft's default to the target's)."""
    ram, unified = available_memory()
    t = model_plan(target, target_settings, gpu_offload)
    d = model_plan(draft, draft_settings or target_settings, gpu_offload) if draft is not None else None
    return MemoryPlan(t, d, ram if available is None else available, unified)


def ways_out(plan: MemoryPlan, n_ctx: int) -> list[str]:
    """Concrete ways to fit, cheapest first, each with what it saves."""
    short = plan.needed_ram - plan.available_ram
    out = []
    kv = sum(m.kv for m in plan.models)
    if n_ctx > 2048:
        saved = kv * (1 - 2048 / n_ctx)
        out.append(f"a smaller context: n_ctx=2048 saves {saved / GiB:.2f} GiB")
    out.append(f"a q8_0 KV cache: type_k='q8_0', type_v='q8_0', flash_attn=True saves {kv * 0.47 / GiB:.2f} GiB")
    if plan.draft is not None:
        if plan.draft.weights_gpu:
            out.append("the draft on the CPU: draft_n_gpu_layers=0")
        out.append("a smaller draft model")
        out.append(f"no draft model: draft='ngram' (prompt lookup needs no memory) saves {plan.draft.total / GiB:.2f} GiB")
    out.append(f"(short by {short / GiB:.2f} GiB)")
    return out


def check(plan: MemoryPlan, n_ctx: int) -> None:
    if not plan.fits:
        raise MemoryPlanError("the models do not fit in memory:\n" + plan.describe() + "\nways out:\n  "
                              + "\n  ".join(ways_out(plan, n_ctx)))
