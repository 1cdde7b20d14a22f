"""specllama: lossless speculative decoding for GGUF models on llama.cpp.

    import specllama
    with specllama.load("target.gguf", draft="draft.gguf") as llm:
        print(llm.generate("def fib(n):", max_tokens=64).text)

load, SpecLlama and the stream types are imported on first use, so modules that need no model
(specllama.models.plan, the errors) load no llama.cpp.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    BusyError,
    ClosedError,
    ConstraintError,
    ContextFullError,
    DecodeError,
    EmptyPromptError,
    IncompatibleDraftError,
    InvalidModelFileError,
    InvalidParameterError,
    ModelNotFoundError,
    PromptTooLongError,
    RpcError,
    SpecLlamaError,
)
from .options import GenerateOptions
from .models.plan import MemoryPlanError
from .decoding.sampling import SamplingSettings
from .decoding.stats import Stats

__version__ = "0.1.0"

_LAZY = {"load": "loader", "SpecLlama": "engine", "Chunk": "streams", "Result": "streams", "Stream": "streams"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "BusyError", "Chunk", "ClosedError", "ConstraintError", "ContextFullError", "DecodeError", "EmptyPromptError",
    "GenerateOptions", "IncompatibleDraftError", "InvalidModelFileError", "InvalidParameterError",
    "MemoryPlanError", "ModelNotFoundError", "PromptTooLongError", "Result", "RpcError", "SamplingSettings",
    "SpecLlama", "SpecLlamaError", "Stats", "Stream", "load",
]
