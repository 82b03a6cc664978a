"""The router's errors and the ONE table that turns them into HTTP responses.

Hierarchy::

    RouterError
    ├── BadRequest                400  invalid JSON, missing ``messages``/``prompt``, bad header
    │   └── UnknownPolicy         400  the per-request policy header names no policy
    ├── BodyTooLarge              413
    ├── Unauthorized              401  missing or unknown API key (+ ``WWW-Authenticate``)
    ├── Forbidden                 403  the tenant may not use this endpoint
    ├── NotFound                  404  an endpoint disabled on this listener
    ├── UnknownModel              404  no configured replica serves the model
    ├── RateLimited               429  a tenant's limit (+ ``Retry-After``)
    ├── NoHealthyReplica          503  + ``Retry-After``
    └── UpstreamError                  raised by the proxy's upstream adapter
        ├── ReplicaUnavailable    502  connect error / connection lost before the first byte
        └── ReplicaTimeout        504  no first byte within the read timeout

Upstream 4xx/5xx responses are not errors here: they are passed through unchanged.  After
the first byte of a stream has been sent, an error is never a status line: the proxy ends
the stream with a final ``data: {"error": ...}`` event (``sse_error_event``).

Bodies are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` (``param``
names the request field at fault, else ``null``).  Foreign exceptions
(aiohttp, asyncio) are converted at the adapter boundary with ``raise X(...) from exc``.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

__all__ = [
    "BadRequest",
    "BodyTooLarge",
    "ErrorResponse",
    "Forbidden",
    "NoHealthyReplica",
    "NotFound",
    "RateLimited",
    "ReplicaTimeout",
    "ReplicaUnavailable",
    "RouterError",
    "Unauthorized",
    "UnknownModel",
    "UnknownPolicy",
    "UpstreamError",
    "error_body",
    "sse_error_event",
    "to_response",
]


class RouterError(Exception):
    """Base of every error the router answers itself."""

    code: str = "router_error"
    """Machine-readable code (the ``error.code`` field); subclasses override."""

    def __init__(self, message: str, *, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        """The request field at fault, when one is (OpenAI's ``error.param``)."""


class BadRequest(RouterError):
    """The request cannot be routed as sent (bad JSON, missing field)."""

    code = "invalid_request"


class UnknownPolicy(BadRequest):
    """The per-request policy header names no registered policy."""

    code = "unknown_policy"


class BodyTooLarge(RouterError):
    """The body exceeds ``max_body_bytes``."""

    code = "body_too_large"


class Unauthorized(RouterError):
    """API keys are configured and the request brings none, or an unknown one."""

    code = "invalid_api_key"


class Forbidden(RouterError):
    """The tenant is known but may not use this endpoint."""

    code = "forbidden"


class NotFound(RouterError):
    """The endpoint is disabled on this listener."""

    code = "not_found"


class RateLimited(RouterError):
    """A tenant's concurrency or request-rate limit."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnknownModel(RouterError):
    """No configured replica serves the requested model."""

    code = "model_not_found"


class NoHealthyReplica(RouterError):
    """Every replica that could serve the request is down."""

    code = "no_healthy_replica"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UpstreamError(RouterError):
    """A replica failed before the first byte (base of the adapter's errors)."""

    code = "upstream_error"


class ReplicaUnavailable(UpstreamError):
    """Could not connect to the replica, or it dropped the connection before answering."""

    code = "replica_unavailable"


class ReplicaTimeout(UpstreamError):
    """The replica sent nothing within the read timeout."""

    code = "replica_timeout"


@dataclass(frozen=True, slots=True)
class ErrorResponse:
    """A ready-to-send error: status, extra headers, JSON body."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


# The one handler table, looked up along the exception's MRO (most specific first).
_TABLE: dict[type[RouterError], tuple[int, str]] = {
    BadRequest: (400, "invalid_request_error"),
    BodyTooLarge: (413, "invalid_request_error"),
    Unauthorized: (401, "invalid_request_error"),
    Forbidden: (403, "permission_error"),
    NotFound: (404, "invalid_request_error"),
    RateLimited: (429, "requests"),
    UnknownModel: (404, "invalid_request_error"),
    NoHealthyReplica: (503, "service_unavailable"),
    ReplicaUnavailable: (502, "upstream_error"),
    ReplicaTimeout: (504, "upstream_timeout"),
    RouterError: (500, "server_error"),
}


def error_body(message: str, type_: str, code: str, param: str | None = None) -> bytes:
    """An OpenAI-shaped error object, serialised."""
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}})


def to_response(exc: RouterError) -> ErrorResponse:
    """Map ``exc`` through the handler table."""
    for klass in type(exc).__mro__:
        entry = _TABLE.get(klass)  # type: ignore[arg-type]
        if entry is not None:
            break
    else:  # pragma: no cover - RouterError is always in the MRO
        entry = _TABLE[RouterError]
    status, type_ = entry
    headers: tuple[tuple[bytes, bytes], ...] = ()
    if isinstance(exc, NoHealthyReplica | RateLimited):
        headers = ((b"retry-after", str(exc.retry_after_s).encode()),)
    elif isinstance(exc, Unauthorized):
        headers = ((b"www-authenticate", b"Bearer"),)
    return ErrorResponse(status, headers, error_body(exc.message, type_, exc.code, exc.param))


def sse_error_event(message: str, code: str) -> bytes:
    """The final SSE event that ends a stream whose upstream failed after the first byte."""
    return b"data: " + error_body(message, "upstream_error", code) + b"\n\n"
