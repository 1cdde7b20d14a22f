"""Memory planning from GGUF headers, before anything is loaded.

Two models in memory is the cost of speculative decoding, so the plan counts both: weights
(split into what n_gpu_layers offloads and what stays in RAM), the KV caches for n_ctx and the
cache types, and an allowance for compute buffers.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

from . import gguf_check
from ..errors import SpecLlamaError
from ..runtime.settings import N_RS_SEQ, Device, ModelSettings, offload_devices

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
    n_layer: int = 0
    n_offloaded: int = 0  # layers on the GPU; their share of the KV cache and the compute buffers go too
    remote: bool = False  # offloaded to RPC workers, so only `ram` is this machine's

    @property
    def kv_gpu(self) -> int:
        return self.kv * self.n_offloaded // self.n_layer if self.n_layer else 0

    @property
    def ram(self) -> int:
        return self.weights_ram + self.kv - self.kv_gpu + (0 if self.n_offloaded else self.compute)

    @property
    def gpu(self) -> int:
        return self.weights_gpu + self.kv_gpu + (self.compute if self.n_offloaded else 0)

    @property
    def total(self) -> int:
        return self.ram + self.gpu


@dataclass
class DeviceShare:
    """What one device a model offloads to must hold, against the free memory it reports."""

    device: str
    need: int
    free: int

    @property
    def short(self) -> int:
        return max(0, self.need - self.free)


def device_shares(model: ModelPlan, offload: list[Device], split: Optional[tuple[float, ...]]) -> list[DeviceShare]:
    """The model's offloaded bytes spread over its devices as llama.cpp spreads layers: by
    tensor_split where given, else by each device's free memory."""
    weights = list(split or [d.free for d in offload])[:len(offload)]
    weights += [0.0] * (len(offload) - len(weights))
    total = sum(weights) or 1.0
    return [DeviceShare(f"{d.name} ({d.description})", int(model.gpu * w / total), d.free)
            for d, w in zip(offload, weights)]


@dataclass
class MemoryPlan:
    target: ModelPlan
    draft: Optional[ModelPlan]
    available_ram: int
    unified_memory: bool
    # free memory of the discrete GPUs as llama.cpp reports it; None when nothing is offloaded
    available_gpu: Optional[int] = None
    notes: list[str] = field(default_factory=list)
    shares: list[DeviceShare] = field(default_factory=list)  # per device, for models on RPC workers
    prompt_cache: int = 0  # RAM budget for saved prompt-cache states (prompt_cache_mb)

    @property
    def models(self) -> list[ModelPlan]:
        return [m for m in (self.target, self.draft) if m is not None]

    @property
    def needed_ram(self) -> int:
        # on Apple silicon the GPU's share is the same pool of memory, so it is counted here, once
        return sum(m.total if self.unified_memory and not m.remote else m.ram for m in self.models) + self.prompt_cache

    @property
    def needed_gpu(self) -> int:
        return 0 if self.unified_memory else sum(m.gpu for m in self.models if not m.remote)

    @property
    def gpu_short(self) -> int:
        if self.available_gpu is None:
            return 0
        return max(0, self.needed_gpu - self.available_gpu)

    @property
    def fits(self) -> bool:
        return self.needed_ram <= self.available_ram and self.gpu_short == 0 and not any(s.short for s in self.shares)

    def describe(self) -> str:
        lines = []
        for role, m in (("target", self.target), ("draft", self.draft)):
            if m is not None:
                where = " to RPC workers" if m.remote else ""
                lines.append(f"{role} {m.name}: weights {m.weights_ram / GiB:.2f} GiB in RAM + "
                             f"{m.weights_gpu / GiB:.2f} GiB offloaded{where} ({m.n_offloaded}/{m.n_layer} layers), "
                             f"KV cache {m.kv / GiB:.2f} GiB, compute {m.compute / GiB:.2f} GiB")
        for share in self.shares:
            lines.append(f"{share.device}: needs {share.need / GiB:.2f} GiB, reports {share.free / GiB:.2f} GiB free")
        if self.prompt_cache:
            lines.append(f"prompt cache: up to {self.prompt_cache / GiB:.2f} GiB of saved states in RAM")
        both = sum(m.total for m in self.models)
        draft_share = f" (draft {self.draft.total / max(1, both):.0%} of it)" if self.draft else ""
        lines.append(f"needed {self.needed_ram / GiB:.2f} GiB of RAM{draft_share}, available "
                     f"{self.available_ram / GiB:.2f} GiB" + (" (unified memory)" if self.unified_memory else ""))
        if self.needed_gpu:
            free = "unknown" if self.available_gpu is None else f"{self.available_gpu / GiB:.2f} GiB"
            lines.append(f"needed {self.needed_gpu / GiB:.2f} GiB of GPU memory, free {free}")
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
    n_attention, recurrent = _layer_kinds(f, arch, n_layer)
    kv = int(n_attention * n_ctx * n_head_kv * (head_k * KV_BYTES_PER_ELEMENT[settings.type_k or "f16"]
                                               + head_v * KV_BYTES_PER_ELEMENT[settings.type_v or "f16"]))
    kv += recurrent
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
    return ModelPlan(path.name, ram, gpu, kv, compute, n_layer, n_offload)


def _layer_kinds(f: dict, arch: str, n_layer: int) -> tuple[int, int]:
    """(layers with an attention KV cache, bytes of recurrent state) of a model.

    Hybrids in llama.cpp's qwen35 family name every full_attention_interval-th layer
    attention and the rest gated delta nets, whose state (f32, one sequence) is kept
    1 + N_RS_SEQ times for per-token rollback; MTP (nextn) layers are attention
    layers, in a second context when loaded. Other architectures count as attention-only.
    """
    interval = int(f.get(f"{arch}.full_attention_interval", 0) or 0)
    d_state = int(f.get(f"{arch}.ssm.state_size", 0) or 0)
    if not interval or not d_state:
        return n_layer, 0
    n_nextn = int(f.get(f"{arch}.nextn_predict_layers", 0) or 0)
    n_trunk = n_layer - n_nextn
    n_recurrent = n_trunk - n_trunk // interval
    n_v_heads = int(f.get(f"{arch}.ssm.time_step_rank", 0) or 0)
    n_groups = int(f.get(f"{arch}.ssm.group_count", 0) or 0)
    conv_dim = int(f.get(f"{arch}.ssm.inner_size", 0) or 0) + 2 * n_groups * d_state
    per_layer = 4 * (n_v_heads * d_state * d_state + (int(f.get(f"{arch}.ssm.conv_kernel", 4) or 4) - 1) * conv_dim)
    return n_layer - n_recurrent, n_recurrent * per_layer * (1 + N_RS_SEQ)


def available_memory() -> tuple[int, bool]:
    """(bytes of RAM available now, whether memory is unified with the GPU: Apple silicon)."""
    return psutil.virtual_memory().available, sys.platform == "darwin"


def gpu_memory() -> tuple[Optional[int], Optional[int], list[str]]:
    """(free bytes of the discrete GPUs, free bytes of an integrated/unified GPU, their names),
    as llama.cpp's backends report them; None where there is no such device."""
    from ..runtime.ggml import devices  # loads llama.cpp: only when a plan needs the devices

    found = [d for d in devices() if d.kind in ("gpu", "igpu")]
    discrete = [d.free for d in found if d.discrete]
    unified = [d.free for d in found if not d.discrete]
    return (sum(discrete) if discrete else None, min(unified) if unified else None,
            [f"{d.name} ({d.description})" for d in found])


def make_plan(target: Path, draft: Optional[Path], target_settings: ModelSettings,
              draft_settings: Optional[ModelSettings] = None, *, gpu_offload: bool = False,
              available: Optional[int] = None, available_gpu: Optional[int] = None,
              target_devices: Optional[list[Device]] = None,
              draft_devices: Optional[list[Device]] = None, prompt_cache: int = 0, n_lanes: int = 0) -> MemoryPlan:
    """The memory plan for a target and optional draft, each with its own settings
    (the draft's default to the target's).

    Args:
        gpu_offload: whether llama.cpp has a GPU backend, so n_gpu_layers takes effect.
        available, available_gpu: free RAM and discrete-GPU memory to plan against; by default
            what the system and llama.cpp's GPU backends report now.
        target_devices, draft_devices: for a model on RPC workers, the devices its host
            reports (remote.RemoteRuntime.devices); its offloaded part is checked against
            each device's free memory instead of this machine's.
        n_lanes: with batch_requests, the lanes of the shared contexts beside the first ones
            (sharing.py): KV caches for n_lanes x n_ctx more tokens, and their compute buffers.
    """
    ram, unified = available_memory()
    notes = []
    draft_settings = draft_settings or target_settings
    t = model_plan(target, target_settings, gpu_offload or target_devices is not None)
    d = model_plan(draft, draft_settings, gpu_offload or draft_devices is not None) if draft is not None else None
    for m in (t, d) if n_lanes else ():
        if m is not None:
            m.kv, m.compute = m.kv * (1 + n_lanes), m.compute * 2
    shares = []
    for m, found, settings in ((t, target_devices, target_settings), (d, draft_devices, draft_settings)):
        if m is not None and found is not None:
            m.remote = True
            shares += device_shares(m, offload_devices(found, settings.rpc), settings.tensor_split)
    if gpu_offload and available_gpu is None:
        discrete, shared, names = gpu_memory()
        if shared is not None:  # Metal's free working set bounds what the GPU may take of the one pool
            ram, unified = min(ram, shared), True
        available_gpu = discrete
        notes.append("GPU: " + (", ".join(names) or "none reported by llama.cpp"))
    return MemoryPlan(t, d, ram if available is None else available, unified,
                      available_gpu if gpu_offload else None, notes, shares, prompt_cache)


def ways_out(plan: MemoryPlan, n_ctx: int) -> list[str]:
    """Concrete ways to fit, cheapest first, each with what it saves."""
    out = []
    kv = sum(m.kv for m in plan.models)
    if n_ctx > 2048:
        saved = kv * (1 - 2048 / n_ctx)
        out.append(f"a smaller context: n_ctx=2048 saves {saved / GiB:.2f} GiB")
    out.append(f"a q8_0 KV cache: type_k='q8_0', type_v='q8_0', flash_attn=True saves {kv * 0.47 / GiB:.2f} GiB")
    if plan.draft is not None and plan.draft.n_offloaded and not plan.unified_memory:
        out.append(f"the draft on the CPU: draft_n_gpu_layers=0 frees {plan.draft.gpu / GiB:.2f} GiB of GPU memory")
    if plan.gpu_short:
        n_layers = _target_layers_that_fit(plan)
        out.append(f"fewer target layers on the GPU: n_gpu_layers={n_layers} (of {plan.target.n_layer}) fits; "
                   "the rest run on the CPU, slower")
    for share in plan.shares:
        if share.short:
            out.append(f"another RPC worker, or a tensor_split that gives {share.device} less "
                       f"(it is short by {share.short / GiB:.2f} GiB)")
    if plan.prompt_cache and plan.needed_ram > plan.available_ram:
        out.append(f"a smaller prompt cache: prompt_cache_mb=0 saves {plan.prompt_cache / GiB:.2f} GiB "
                   "(the live conversation is still reused)")
    if plan.draft is not None:
        out.append("a smaller draft model")
        out.append("no draft model: draft='ngram' (prompt lookup needs no memory) saves "
                   f"{plan.draft.total / GiB:.2f} GiB")
    short = []
    if plan.needed_ram > plan.available_ram:
        short.append(f"{(plan.needed_ram - plan.available_ram) / GiB:.2f} GiB of RAM")
    if plan.gpu_short:
        short.append(f"{plan.gpu_short / GiB:.2f} GiB of GPU memory")
    short += [f"{s.short / GiB:.2f} GiB on {s.device}" for s in plan.shares if s.short]
    out.append(f"(short by {' and '.join(short)})")
    return out


def _target_layers_that_fit(plan: MemoryPlan) -> int:
    """The most target layers the GPU holds beside everything else planned for it."""
    t = plan.target
    per_layer = (t.weights_gpu + t.kv_gpu) / max(1, t.n_offloaded)
    return max(0, t.n_offloaded - math.ceil(plan.gpu_short / per_layer)) if per_layer else 0


def plan_lanes(plan: Callable[[int], MemoryPlan], n_lanes: int, required: bool) -> tuple[MemoryPlan, int]:
    """The memory plan with n_lanes of shared contexts (batch_requests) and the lanes it holds:
    where lanes are not required and do not fit, the plan without them (0 lanes)."""
    with_lanes = plan(n_lanes)
    if required or not n_lanes or with_lanes.fits:
        return with_lanes, n_lanes
    return plan(0), 0


def check(plan: MemoryPlan, n_ctx: int) -> None:
    if not plan.fits:
        raise MemoryPlanError("the models do not fit in memory:\n" + plan.describe() + "\nways out:\n  "
                              + "\n  ".join(ways_out(plan, n_ctx)))
