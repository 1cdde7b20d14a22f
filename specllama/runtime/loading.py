"""Loading a Runtime from a GGUF file, or borrowing a llama_cpp.Llama the caller built."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Union

import llama_cpp

from ..models import gguf_check
from .ggml import LOG_SINK, MemoryUse, gpu_free, init_backend, resident_bytes, system_info
from .handles import Handle, load_model, new_context
from .measure_key import identity
from .mtp import MtpHead, MtpUnavailable
from .protocols import SlotUnavailable
from .settings import ModelSettings


def load_runtime(cls: Any, path: Union[str, os.PathLike], settings: ModelSettings, mtp: bool = False,
                 n_branches: int = 1) -> Any:
    """Load a GGUF file as a Runtime (cls); the header is validated in Python first.

    mtp=True also loads the model's MTP (nextn) layers, in a second context that follows
    every decode of this one (runtime.mtp_head); InvalidParameterError if it has none.
    n_branches > 1 lets decode_tree verify trees of up to that many branches (attention
    memory without MTP layers; others keep chains: runtime.n_branches says which).
    """
    path = gguf_check.validate(path)
    init_backend()
    LOG_SINK.verbose = settings.verbose
    stack = ExitStack()
    try:
        ram0, gpu_free0 = resident_bytes(), gpu_free()
        model = load_model(path, settings, stack, mtp)
        n_seq = 1 if mtp else n_branches
        runtime = _on_new_context(cls, model, settings, stack, path.name, "", n_seq)
        runtime.identity = identity(path, settings, runtime, mtp)
        runtime.path = path
        if mtp:
            try:
                runtime.mtp_head = MtpHead(runtime, settings, stack)
            except MtpUnavailable as exc:  # the caller decodes without it, and says why
                runtime.mtp_note = str(exc)
        runtime.memory_use = MemoryUse(max(0, resident_bytes() - ram0), max(0, gpu_free0 - gpu_free()))
        return runtime
    except BaseException:
        stack.close()
        raise


def sibling_runtime(runtime: Any) -> Any:
    """A second context on runtime's model, with its settings: a slot for a request decoded
    beside another one. The weights are shared, not loaded again; only the context's KV cache
    and compute buffers are new. Close it before the runtime it came from (which frees the
    model). Raises SlotUnavailable where a second context cannot be made here."""
    why = why_no_sibling(runtime)
    if why:
        raise SlotUnavailable(why)
    stack = ExitStack()
    try:
        ram0, gpu_free0 = resident_bytes(), gpu_free()
        model = runtime.handles[0].view()  # the original frees it
        twin = _on_new_context(type(runtime), model, runtime.settings, stack, runtime.name, runtime.identity,
                               runtime.n_seq)
        twin.path = runtime.path
        twin.memory_use = MemoryUse(max(0, resident_bytes() - ram0), max(0, gpu_free0 - gpu_free()))
        return twin
    except BaseException:
        stack.close()
        raise


def why_no_sibling(runtime: Any) -> str:
    """Why no second context can be made on runtime's model ("" where one can)."""
    if runtime.settings is None:
        return f"{runtime.name} is a llama_cpp.Llama the caller built, with one context"
    if runtime.mtp_head is not None:
        return "the target's MTP layers follow one target context"
    return ""


def _on_new_context(cls: Any, model: Handle, settings: ModelSettings, stack: ExitStack, name: str, key: str,
                    n_seq: int) -> Any:
    """A Runtime (cls) on a new context of model, made with settings for n_seq sequences."""
    ctx = new_context(model, settings, stack, n_seq=n_seq, name=name)
    runtime = cls(model, ctx, name, stack, key, settings.rollback, n_seq=n_seq)
    runtime.settings = settings
    return runtime


def borrow_runtime(cls: Any, llama: "llama_cpp.Llama") -> Any:
    """A Runtime (cls) on an existing llama_cpp.Llama (its Metal/CUDA settings kept); the caller
    frees it. Its KV cache is cleared; do not use the Llama object directly while the runtime works."""
    path = Path(getattr(llama, "model_path", "model") or "model")
    key = "|".join([str(path), repr(llama.model_params.n_gpu_layers), repr(llama.context_params.n_threads),
                    repr(llama.context_params.flash_attn_type), repr(llama.context_params.type_k),
                    repr(llama.context_params.n_ubatch), llama_cpp.__version__, system_info()])
    model = Handle(llama.model, None, f"the model {path.name}", None)
    ctx = Handle(llama.ctx, None, f"the context of {path.name}", None)
    return cls(model, ctx, path.name, ExitStack(), key)
