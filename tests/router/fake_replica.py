"""A small OpenAI-compatible fake replica on loopback, for fault injection and speed.

It speaks the parts of vLLM's HTTP surface the router uses: ``POST /v1/chat/completions``
and ``/v1/completions`` (streaming SSE and not, with ``usage`` and the
``include_usage`` chunk like vLLM), ``GET /v1/models``, ``GET /health``, and an echo on
any other ``/v1/*`` path.  Knobs (``Behaviour``) inject delays, status codes, a drop of
the connection mid-stream, and an unhealthy ``/health``.  Every request is recorded,
including whether the client went away (``cancelled``) and when.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict


@dataclass
class Behaviour:
    """What the fake does; tests mutate it between requests."""

    status: int = 200
    """Status of completions answers (a non-200 sends an OpenAI-style error body)."""
    headers_delay_s: float = 0.0
    """Wait before sending any response (before headers)."""
    chunks: int = 3
    """Content chunks per stream (before the finish chunk)."""
    chunk_delay_s: float = 0.0
    """Wait between two SSE events."""
    drop_after_chunks: int | None = None
    """Abort the connection after this many events (mid-stream failure)."""
    healthy: bool = True
    """``GET /health`` answers 200 when true, else 503."""
    models: list[str] = field(default_factory=lambda: ["m"])
    cached_tokens: int = 7
    prompt_tokens: int = 11


@dataclass
class Seen:
    """One request as the fake received it."""

    path: str
    headers: Mapping[str, str]
    """Case-insensitive."""
    body: bytes
    started: float
    ended: float | None = None
    cancelled: bool = False


class FakeReplica:
    """Run with ``async with FakeReplica(name) as r:``; ``r.url`` is its base URL."""

    def __init__(self, name: str = "fake", behaviour: Behaviour | None = None, *,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.name = name
        self.host = host
        self.behaviour = behaviour or Behaviour()
        self.seen: list[Seen] = []
        self.health_hits = 0
        self.probe_authorization: list[str | None] = []
        """``Authorization`` of each ``/health`` and ``/v1/models`` request."""
        self._runner: web.AppRunner | None = None
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def completions(self) -> list[Seen]:
        """Recorded completion requests (not health or models probes)."""
        return [s for s in self.seen if s.path.startswith("/v1/") and s.path != "/v1/models"]

    async def __aenter__(self) -> FakeReplica:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/v1/{rest:.*}", self._echo)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                      shutdown_timeout=0.1)
        await self._runner.setup()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop listening (idempotent): later connections are refused."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        self.health_hits += 1
        self.probe_authorization.append(request.headers.get("Authorization"))
        return web.Response(status=200 if self.behaviour.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        self.probe_authorization.append(request.headers.get("Authorization"))
        data = [{"id": m, "object": "model", "owned_by": "vllm", "root": m, "parent": None}
                for m in self.behaviour.models]
        return web.json_response({"object": "list", "data": data})

    async def _echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append(Seen(request.path, CIMultiDict(request.headers), body, time.monotonic()))
        return web.json_response({"path": request.path, "method": request.method,
                                  "query": request.rel_url.raw_query_string, "replica": self.name,
                                  "body": body.decode()})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        b = self.behaviour
        body = await request.read()
        seen = Seen(request.path, CIMultiDict(request.headers), body, time.monotonic())
        self.seen.append(seen)
        try:
            if b.headers_delay_s:
                await asyncio.sleep(b.headers_delay_s)
            req: dict[str, Any] = orjson.loads(body)
            if b.status != 200:
                return web.json_response(
                    {"error": {"message": f"fake {b.status}", "type": "x", "code": b.status}},
                    status=b.status,
                )
            usage = {"prompt_tokens": b.prompt_tokens, "completion_tokens": b.chunks,
                     "total_tokens": b.prompt_tokens + b.chunks,
                     "prompt_tokens_details": {"cached_tokens": b.cached_tokens}}
            if not req.get("stream"):
                return web.json_response({
                    "id": "cmpl-1", "object": "chat.completion", "model": req.get("model"),
                    "choices": [{"index": 0, "message": {"role": "assistant",
                                                         "content": f"from {self.name}"},
                                 "finish_reason": "stop"}],
                    "usage": usage,
                })
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            events = [self._event(i, req) for i in range(b.chunks)]
            events.append(orjson.dumps({"id": "c", "object": "chat.completion.chunk",
                                        "choices": [{"index": 0, "delta": {},
                                                     "finish_reason": "stop"}]}))
            opts = req.get("stream_options") or {}
            if opts.get("include_usage"):
                events.append(orjson.dumps({"id": "c", "object": "chat.completion.chunk",
                                            "choices": [], "usage": usage}))
            for i, event in enumerate(events):
                if b.drop_after_chunks is not None and i >= b.drop_after_chunks:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                if i and b.chunk_delay_s:
                    await asyncio.sleep(b.chunk_delay_s)
                await resp.write(b"data: " + event + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            seen.cancelled = True
            raise
        finally:
            seen.ended = time.monotonic()

    def _event(self, i: int, req: dict[str, Any]) -> bytes:
        return orjson.dumps({"id": "c", "object": "chat.completion.chunk",
                             "model": req.get("model"),
                             "choices": [{"index": 0, "delta": {"content": f"{self.name}-{i} "},
                                          "finish_reason": None}]})
