"""Typed errors. Library code raises these; the CLI formats them as one line."""

from __future__ import annotations

import sys
from typing import NoReturn


class SpecLlamaError(Exception):
    """Base class of every error specllama raises on purpose."""


class InvalidParameterError(SpecLlamaError, ValueError):
    """A public parameter is outside its allowed range."""

    def __init__(self, name: str, value: object, allowed: str):
        self.name, self.value, self.allowed = name, value, allowed
        super().__init__(f"{name}={value!r} is invalid: {name} must be {allowed}")


class EmptyPromptError(SpecLlamaError, ValueError):
    """The prompt has no tokens to condition on."""


class ModelNotFoundError(SpecLlamaError, FileNotFoundError):
    """A model path does not exist."""


class InvalidModelFileError(SpecLlamaError):
    """A file exists but is not a loadable GGUF model (wrong magic, truncated, corrupt)."""


class IncompatibleDraftError(SpecLlamaError):
    """The draft model's vocabulary differs from the target's, so its tokens mean something else."""


class ContextFullError(SpecLlamaError):
    """The KV cache has no room for the tokens being decoded."""


class PromptTooLongError(ContextFullError, ValueError):
    """The prompt alone does not fit in the context window."""

    def __init__(self, message: str, n_prompt_tokens: int = 0, n_ctx: int = 0):
        super().__init__(message)
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx


class DecodeError(SpecLlamaError):
    """llama_decode failed for a reason other than a full context."""


class BusyError(SpecLlamaError):
    """A second generation was started while one is still running on the same object."""


class ClosedError(SpecLlamaError):
    """The object was closed: its models are freed."""


class RpcError(SpecLlamaError):
    """An RPC worker cannot be reached, was lost, or this llama.cpp build has no RPC backend."""

    endpoints: tuple[str, ...] = ()

    def __init__(self, message: str, endpoints: tuple[str, ...] = ()):
        super().__init__(message)
        self.endpoints = endpoints  # the workers the error is about, where known


class ConstraintError(SpecLlamaError):
    """A grammar reached a state it cannot leave (a token it forbids was forced on it)."""


def exit_interrupted() -> NoReturn:
    """Ends the CLI after a Ctrl-C with status 130 and one line, however deep the interrupt landed.

    Under `python -m`, CPython remembers a KeyboardInterrupt that left any code run from a source
    string (dataclasses and namedtuple build their methods that way while modules import) and, at
    exit, kills the process with SIGINT even though the interrupt was caught. Running a string that
    finishes clears that memory, so the status stays the 130 a shell expects."""
    sys.stderr.write("\ninterrupted\n")
    sys.stderr.flush()
    exec("None")  # noqa: S102 (a constant: resets CPython's unhandled-interrupt flag, see above)
    raise SystemExit(130)
