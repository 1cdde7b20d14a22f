"""Who may ask the server anything: the Host header (a keyless server on loopback answers only
loopback names, so a web page that rebinds its DNS name to 127.0.0.1 cannot drive it), the API
keys (each key its own prompt-cache scope), and the body size, all checked before a handler
runs. Every request is counted by endpoint and status on its way out."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import ApiError, api_of
from .metrics import Metrics

OPEN_PATHS = ("/health", "/")  # answered without an API key: load balancers and clients probe them
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def access(api_key: Union[None, str, Sequence[str]], allowed_hosts: Optional[Sequence[str]],
           cache_scope: Optional[str]) -> tuple[list[str], list[str], str]:
    """(keys, Host names served, cache scope) from create_app's arguments and their defaults;
    ValueError for an empty key (it would look like protection and be none) or an unknown scope."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if any(not key.strip() for key in keys):
        raise ValueError("an API key is empty or blank: give a non-empty key, or none to serve without one")
    cache_scope = cache_scope or ("key" if keys else "shared")
    if cache_scope not in ("key", "shared"):
        raise ValueError(f"cache_scope {cache_scope!r}: 'key' or 'shared'")
    hosts = list(allowed_hosts) if allowed_hosts is not None else ["*"] if keys else list(LOOPBACK_HOSTS)
    return keys, hosts, cache_scope


class Guard:
    """Checks the Host header and the API key, caps the request body and counts requests by
    endpoint and status. A plain ASGI middleware, so a handler still sees its client's disconnect."""

    def __init__(self, app: Any, keys: Sequence[str], hosts: Sequence[str], max_body: int, metrics: Metrics):
        self.app, self.metrics, self.max_body = app, metrics, max_body
        self.keys = [(f"Bearer {key}".encode(), key.encode()) for key in keys]
        self.hosts = None if "*" in hosts else {host.lower().strip("[]") for host in hosts}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = self.metrics.endpoint(path)
        error = self._refusal(scope, path)
        if error is not None:
            self.metrics.requests.labels(endpoint, str(error.status)).inc()
            return await error.response(api_of(path))(scope, receive, send)
        status = {"code": 500}

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        n_body = 0

        async def capped_receive() -> dict:
            nonlocal n_body
            message = await receive()
            n_body += len(message.get("body", b""))
            if n_body > self.max_body:  # a body sent without Content-Length
                raise StarletteHTTPException(413, _too_large(self.max_body))
            return message

        try:
            await self.app(scope, capped_receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()

    def _refusal(self, scope: dict, path: str) -> Optional[ApiError]:
        """The error a request gets before it reaches a handler, if any."""
        headers = dict(scope["headers"])
        if self.hosts is not None and _host_name(headers.get(b"host", b"")) not in self.hosts:
            return ApiError(400, f"this server answers only requests addressed to it as "
                            f"{', '.join(sorted(self.hosts))} (the Host header): start it with --allowed-hosts "
                            "NAME,... (or --api-key) to serve other names", code="invalid_host")
        if self.keys and path not in OPEN_PATHS:
            given = next((i for i, (bearer, key) in enumerate(self.keys)
                          if secrets.compare_digest(headers.get(b"authorization", b""), bearer)
                          or secrets.compare_digest(headers.get(b"x-api-key", b""), key)), None)
            if given is None:
                return ApiError(401, "missing or wrong API key: send Authorization: Bearer <key> (or x-api-key: "
                                "<key>)", code="invalid_api_key", kind="authentication_error")
            scope.setdefault("state", {})["key_scope"] = f"key-{given}"  # Request.state.key_scope
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            return ApiError(413, _too_large(self.max_body), code="request_too_large")
        return None


def _host_name(host: bytes) -> str:
    """The name in a Host header, without its port ([::1]:8080 -> ::1)."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def _too_large(max_body: int) -> str:
    return f"the request body is over this server's limit of {max_body / 2**20:g} MiB (--limit body_mb=...)"
