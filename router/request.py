"""Reading one incoming request: headers in one pass, the body with a size limit, and
only the body fields the router needs.

The body is parsed once with orjson into a dict (the policy's ``RouteRequest.body``);
the original bytes are what goes upstream unless the router must add a field.  The
required fields are checked per endpoint: chat needs a ``messages`` list, completions a
``prompt``; anything else (types of the other fields, sampling parameters) is the
replica's business and is not validated here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from prompt.errors import InvalidCacheSalt
from prompt.keyer import validate_cache_salt
from router.errors import BadRequest, BodyTooLarge
from router.policy import Endpoint

__all__ = ["ClientDisconnected", "Incoming", "parse_body", "read_body", "scan_headers"]

Receive = Callable[[], Awaitable[Mapping[str, Any]]]

# Headers that describe one hop, never forwarded (RFC 9110 7.6.1), plus those the upstream
# client sets itself.
_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length",
    b"expect", b"x-request-id",
})


class ClientDisconnected(Exception):
    """The client went away while its body was being read."""


class Incoming:
    """What the proxy keeps of the request headers."""

    __slots__ = ("forward", "content_length", "request_id", "policy", "session")

    def __init__(self) -> None:
        self.forward: dict[str, str] = {}
        self.content_length: int | None = None
        self.request_id: str | None = None
        self.policy: str | None = None
        self.session: str | None = None


def scan_headers(
    raw: list[tuple[bytes, bytes]], policy_header: bytes, session_header: bytes
) -> Incoming:
    """One pass over the ASGI headers (names are lower-case bytes)."""
    inc = Incoming()
    forward = inc.forward
    for name, value in raw:
        if name == b"content-length":
            try:
                inc.content_length = int(value)
            except ValueError:
                raise BadRequest("invalid Content-Length header", code="invalid_header") from None
        elif name == b"x-request-id":
            inc.request_id = value.decode("latin-1")
        elif name == policy_header:
            inc.policy = value.decode("latin-1").strip()
            continue
        elif name == session_header:
            inc.session = value.decode("latin-1")
        if name not in _HOP:
            forward[name.decode("latin-1")] = value.decode("latin-1")
    return inc


async def read_body(receive: Receive, limit: int, content_length: int | None) -> bytes:
    """The whole request body, or ``BodyTooLarge`` as soon as it passes ``limit``."""
    if content_length is not None and content_length > limit:
        raise BodyTooLarge(f"request body of {content_length} bytes exceeds {limit} bytes")
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientDisconnected
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise BodyTooLarge(f"request body exceeds {limit} bytes")
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def parse_body(endpoint: Endpoint, body: bytes) -> dict[str, Any] | None:
    """The JSON object of a chat/completions body (validated), or of any other body if
    it is one (``None`` otherwise)."""
    if endpoint == "other":
        if not body:
            return None
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        return obj if isinstance(obj, dict) else None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    if endpoint == "chat":
        if not isinstance(obj.get("messages"), list):
            raise BadRequest("'messages' is required and must be a list", code="missing_messages")
    elif "prompt" not in obj or obj["prompt"] is None:
        raise BadRequest("'prompt' is required", code="missing_prompt")
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", code="invalid_model")
    if "cache_salt" in obj:
        # vLLM rejects these too; rejecting here keeps a bad salt out of the index keys.
        try:
            validate_cache_salt(obj["cache_salt"])
        except InvalidCacheSalt as exc:
            raise BadRequest(str(exc), code="invalid_cache_salt") from None
    return obj
