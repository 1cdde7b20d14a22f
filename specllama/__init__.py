"""specllama: lossless speculative decoding for GGUF models on llama.cpp.

    import specllama
    with specllama.load("target.gguf", draft="draft.gguf") as llm:
        print(llm.generate("def fib(n):", max_tokens=64).text)
"""

from .engine import Chunk, Result, SpecLlama, Stream, load
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
    SpecLlamaError,
)
from .plan import MemoryPlanError
from .sampling import SamplingSettings
from .stats import Stats

__version__ = "0.1.0"

__all__ = [
    "BusyError", "Chunk", "ConstraintError", "ContextFullError", "DecodeError", "EmptyPromptError",
    "IncompatibleDraftError", "InvalidModelFileError", "InvalidParameterError", "MemoryPlanError",
    "ModelNotFoundError", "PromptTooLongError", "Result", "SamplingSettings", "SpecLlama",
    "SpecLlamaError", "Stats", "Stream", "load",
]
