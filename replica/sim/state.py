"""What the simulated replica's endpoint handlers share: its settings, engine, renderer,
publisher and fault state (``SimState``), and vLLM's error and JSON response shapes.

``SimServer`` (``replica.sim.server``) builds one ``SimState`` and owns its lifecycle;
the handlers (``replica.sim.endpoints``, ``replica.sim.generation``) only read and flag it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from replica.sim.engine import EngineConfig, SimEngine
from replica.sim.faults import Faults
from replica.sim.kv_publisher import KVEventPublisher
from replica.sim.metrics import SimMetrics
from replica.sim.render import PromptRenderer

__all__ = ["HttpError", "SimSettings", "SimState", "error_response", "json_response"]


@dataclass(frozen=True, slots=True)
class SimSettings:
    """Everything ``kvroute sim`` takes on its command line."""

    model: str
    tokenizer: str
    host: str = "127.0.0.1"
    port: int = 0
    engine: EngineConfig | None = None
    kv_events: bool = True
    kv_events_endpoint: str | None = None
    """PUB endpoint; ``None`` binds a free loopback port (reported at ``/kv_event_sources``)."""
    replay_endpoint: str | None = None
    """ROUTER endpoint; ``None`` binds a free loopback port."""
    topic: str = ""
    legacy_encoding: bool = False
    legacy_replay: bool = False
    buffer_steps: int = 10_000
    enable_prompt_tokens_details: bool = True
    lora_modules: tuple[str, ...] = ()
    """LoRA adapter names served besides the base model (their blocks carry the name)."""
    faults: Faults = field(default_factory=Faults)

    def engine_config(self) -> EngineConfig:
        """The engine configuration (defaults filled in)."""
        return self.engine if self.engine is not None else EngineConfig(model=self.model)


class HttpError(Exception):
    """A request the replica refuses, with vLLM's status, error type and ``param``."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param


def error_response(status: int, message: str, err_type: str,
                   param: str | None = None) -> web.Response:  # fmt: skip
    """vLLM's error body ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def json_response(obj: Any, status: int = 200) -> web.Response:
    """``obj`` as a JSON response."""
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


@dataclass(slots=True)
class SimState:
    """One replica's shared state, as the endpoint handlers see it."""

    settings: SimSettings
    renderer: PromptRenderer
    engine: SimEngine
    metrics: SimMetrics
    publisher: KVEventPublisher | None
    on_crash: Callable[[], None]
    """Called once when a ``crash`` fault fires (the server dies, or the process exits)."""
    created: int
    port: int = 0
    engine_dead: bool = False
    """Set when the engine task died: ``/health`` answers 503, generation fails."""
    crashed: bool = False
    never: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on close: releases requests parked by ``hang`` or after a crash."""
    waiters: set[asyncio.Event] = field(default_factory=set)
    """One wake-up per in-flight generation (set when the engine dies)."""

    @property
    def faults(self) -> Faults:
        """The live fault settings."""
        return self.settings.faults

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8001``."""
        return f"http://{self.settings.host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """The resolved PUB endpoint (``None`` without events)."""
        return self.publisher.endpoint if self.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        """The resolved replay (ROUTER) endpoint."""
        return self.publisher.resolved_replay_endpoint if self.publisher else None

    def crash(self) -> None:
        """Fire the ``crash`` fault (once)."""
        if not self.crashed:
            self.crashed = True
            self.on_crash()

    async def gate(self) -> None:
        """Apply the ``crash`` and ``hang`` faults before a request is served."""
        if self.faults.crash:
            self.crash()
        if self.faults.hang or self.crashed:
            await self.never.wait()
            raise web.HTTPServiceUnavailable()
