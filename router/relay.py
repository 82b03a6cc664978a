"""Relaying one upstream response to the client: the request's state shared by the proxy's
attempts and the disconnect watcher (``Call``), the chunk pump of a streamed body
(``pump``, which ends a stream that fails after its first byte with an SSE error event),
and the watcher that cancels the handler when the client leaves (``watch_disconnect``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import aiohttp

from kvkeys.types import ReplicaId
from router.errors import sse_error_event
from router.metrics import Outcome
from router.policy import Decision, Endpoint, RouteRequest
from router.usage import UsageTap

__all__ = ["Call", "Receive", "Scope", "Send", "pump", "watch_disconnect"]

_log = logging.getLogger("router.proxy")  # the proxy's log: the relay is its part

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Call:
    """Per-request state shared by the attempts and the disconnect watcher."""

    __slots__ = ("endpoint", "method", "path", "query", "body", "headers", "stream",
                 "tap_strip", "request_id", "route", "decision", "prompt_estimate",
                 "receipt_ok", "prompt_tokens", "cached_tokens", "completion_tokens", "ttfb_s",
                 "replica", "done", "gone", "watcher", "routing_headers")

    def __init__(self, endpoint: Endpoint, method: str, path: str, query: bytes, body: bytes,
                 headers: dict[str, str], stream: bool, tap_strip: bool, request_id: str,
                 route: RouteRequest, decision: Decision, prompt_estimate: int) -> None:
        self.endpoint = endpoint
        self.method = method
        self.path = path
        self.query = query
        self.body = body
        self.headers = headers
        self.stream = stream
        self.tap_strip = tap_strip
        self.request_id = request_id
        self.route = route
        self.decision = decision
        self.prompt_estimate = prompt_estimate
        """Prompt tokens for the load lease (the decision's count, else an estimate)."""
        self.receipt_ok = False
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.ttfb_s: float | None = None
        self.replica: ReplicaId | None = None
        self.done = False
        """The response is complete (or being completed): a disconnect no longer matters."""
        self.gone = False
        """The watcher saw the client leave and cancelled the handler."""
        self.watcher: asyncio.Task[None] | None = None
        self.routing_headers = True  # the x-kvroute-* response headers


async def watch_disconnect(call: Call, receive: Receive, task: asyncio.Task[Any]) -> None:
    """Wait for ``http.disconnect``; cancel the handler's task if the response is not done.
    Owned by the handler, which cancels it in its ``finally``."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not call.done:
                call.gone = True
                task.cancel()
            return


async def pump(call: Call, resp: aiohttp.ClientResponse, chunk: bytes,
                tap: UsageTap | None, send: Send) -> Outcome:
    """Relay ``chunk`` and every later one; end the body (with an SSE error event if
    the upstream fails after the first byte)."""
    content = resp.content
    try:
        while chunk:
            out = tap.feed(chunk) if tap is not None else chunk
            if content.at_eof():  # the last chunk: end the body in the same write
                call.done = True
                tail = tap.flush() if tap is not None else b""
                await send({"type": "http.response.body", "body": out + tail})
                return "ok"
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
            chunk = await content.readany()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        code = "replica_timeout" if isinstance(exc, asyncio.TimeoutError) else "replica_failed"
        _log.warning("request %s: replica failed mid-stream: %r", call.request_id, exc)
        call.done = True
        tail = (tap.flush() if tap is not None else b"")
        await send({"type": "http.response.body",
                    "body": tail + sse_error_event(f"upstream failed mid-stream: {exc!r}",
                                                   code)})
        return "midstream_error"
    call.done = True
    tail = tap.flush() if tap is not None else b""
    await send({"type": "http.response.body", "body": tail})
    return "ok"
