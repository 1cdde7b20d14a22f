"""Errors as each API shapes them, and the mapping from specllama's typed errors to statuses."""

from __future__ import annotations

import logging
from typing import Any, Optional

from fastapi.responses import JSONResponse

from ..errors import (BusyError, ClosedError, ConstraintError, EmptyPromptError, InvalidParameterError,
                      PromptTooLongError, RpcError, SpecLlamaError)

log = logging.getLogger("specllama")

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


class ApiError(Exception):
    """An error response. OpenAI's shape {"error": {"message", "type", "param", "code"}} (with
    llama-server's n_prompt_tokens and n_ctx for a context overflow), or Anthropic's
    {"type": "error", "error": {"type", "message"}} for the Messages API."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error", headers: Optional[dict[str, str]] = None, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers, self.extra = headers, extra

    def body(self, api: str = "openai") -> dict:
        if api == "anthropic":
            return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                               "message": self.message}}
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code,
                          **self.extra}}

    def response(self, api: str = "openai") -> JSONResponse:
        return JSONResponse(self.body(api), status_code=self.status, headers=self.headers)


def api_of(path: str) -> str:
    """Which API's error shape a path answers in."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def from_library(e: Exception, param: Optional[str] = None) -> ApiError:
    """The ApiError for an error the library raised while a request was checked or started.

    Anything that is not one of specllama's own errors is a bug: a 500, logged."""
    if isinstance(e, PromptTooLongError):
        # 400, as OpenAI and llama-server answer: clients catch BadRequestError to trim the history
        return ApiError(400, str(e), param=param, code="context_length_exceeded",
                        n_prompt_tokens=e.n_prompt_tokens, n_ctx=e.n_ctx)
    if isinstance(e, InvalidParameterError):
        return ApiError(400, str(e), param=e.name, code="invalid_value")
    if isinstance(e, (EmptyPromptError, ConstraintError)):
        return ApiError(400, str(e), param=param, code="invalid_value")
    if isinstance(e, (BusyError, ClosedError)):
        return ApiError(503, str(e), kind="server_error", code="unavailable")
    if isinstance(e, RpcError):  # the model's workers are gone: /health says so until a restart
        return ApiError(503, str(e), kind="server_error", code="model_lost")
    if isinstance(e, SpecLlamaError):
        return ApiError(500, f"{type(e).__name__}: {e}", kind="server_error", code="internal_error")
    log.error("internal error: %s", e, exc_info=e)
    return ApiError(500, f"internal error ({type(e).__name__}); the server log has the traceback",
                    kind="server_error", code="internal_error")
