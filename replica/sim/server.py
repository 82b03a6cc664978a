"""The simulated replica's lifecycle: vLLM 0.32's OpenAI-compatible server on aiohttp.

``SimServer.start()`` opens the event publisher, starts the engine task and binds the
listener; ``aclose()`` undoes them in reverse.  ``start_sim(...)`` wraps both as an async
context manager for tests and benchmarks.  Several servers can share one event loop (the
fleet benchmark runs sixteen).  The routes are ``replica.sim.generation`` (the two
generation endpoints) and ``replica.sim.endpoints`` (the rest); errors use vLLM's body
``{"error": {"message", "type", "param", "code"}}``.

Time: engine timing is simulated (``time_scale``), but ``created`` stamps are wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from replica.sim.endpoints import Endpoints
from replica.sim.engine import EngineConfig, SimEngine
from replica.sim.event_sink import PublisherSink
from replica.sim.faults import Faults
from replica.sim.generation import Generation
from replica.sim.kv_publisher import KVEventPublisher
from replica.sim.metrics import SimMetrics
from replica.sim.render import PromptRenderer, TokenizerRenderer
from replica.sim.state import SimSettings, SimState

__all__ = ["SimHandle", "SimServer", "SimSettings", "exit_process", "start_sim"]

log = logging.getLogger(__name__)


class SimServer:
    """One simulated vLLM replica: engine, event publisher and HTTP, started and stopped
    together (the handlers live in ``replica.sim.endpoints`` and ``replica.sim.generation``)."""

    def __init__(
        self,
        settings: SimSettings,
        *,
        renderer: PromptRenderer | None = None,
        on_crash: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.faults = settings.faults
        self.renderer: PromptRenderer = renderer or TokenizerRenderer(settings.tokenizer)
        self.publisher: KVEventPublisher | None = None
        if settings.kv_events:
            ep = settings.kv_events_endpoint
            self.publisher = KVEventPublisher(
                ep or f"tcp://{settings.host}:0",
                replay_endpoint=settings.replay_endpoint or f"tcp://{settings.host}:0",
                topic=settings.topic,
                buffer_steps=settings.buffer_steps,
                data_parallel_rank=0,
                legacy_encoding=settings.legacy_encoding,
                legacy_replay=settings.legacy_replay,
                bind=True if ep is None else None,
            )
        sink = PublisherSink(self.publisher, self.faults) if self.publisher else None
        self.engine = SimEngine(settings.engine_config(), self.renderer.sample_vocab(), sink=sink)
        self.metrics = SimMetrics(self.engine, settings.model)
        self._on_crash = on_crash
        self.state = SimState(
            settings, self.renderer, self.engine, self.metrics, self.publisher,
            on_crash=self._crash, created=int(time.time()), port=settings.port,
        )  # fmt: skip
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._engine_task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        """The bound HTTP port (the configured one until ``start``)."""
        return self.state.port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8001``."""
        return self.state.url

    @property
    def kv_events_endpoint(self) -> str | None:
        """The resolved PUB endpoint (``None`` without events)."""
        return self.state.kv_events_endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The resolved replay (ROUTER) endpoint."""
        return self.state.replay_endpoint

    async def start(self) -> None:
        """Open the publisher, start the engine, bind HTTP."""
        if self.publisher is not None:
            await self.publisher.start()
        self._engine_task = asyncio.create_task(self.engine.run(), name="sim-engine")
        self._engine_task.add_done_callback(self._engine_done)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        Generation(self.state).add_routes(app.router)
        Endpoints(self.state).add_routes(app.router)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.settings.host, self.settings.port,
                                 backlog=1024)
        await self._site.start()
        server = self._site._server
        sockets = getattr(server, "sockets", None)
        if sockets:
            self.state.port = int(sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        """Stop HTTP, then the engine, then the publisher (idempotent)."""
        self.state.never.set()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        task, self._engine_task = self._engine_task, None
        if task is not None and not task.done():  # a dead engine was reported already
            task.cancel()
            # Suppressed even while our own caller is cancelled: the publisher below must
            # still be closed.
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.engine.close()
        if self.publisher is not None:
            await self.publisher.aclose()

    async def kill(self) -> None:
        """Die abruptly: drop every connection and stop (the in-process ``crash``)."""
        self.state.crashed = True
        runner = self._runner
        if runner is not None and runner.server is not None:
            for conn in list(runner.server.connections):
                transport = conn.transport
                if transport is not None:
                    transport.abort()
        await self.aclose()

    def _engine_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            # Like vLLM's EngineDeadError: /health turns 503 and generation fails.
            self.state.engine_dead = True
            log.error("simulated engine died", exc_info=exc)
            for wake in self.state.waiters:
                wake.set()

    def _crash(self) -> None:
        if self._on_crash is not None:
            self._on_crash()
            return
        asyncio.get_running_loop().create_task(self.kill())


@dataclass(frozen=True, slots=True)
class SimHandle:
    """A running in-process simulated replica (what ``start_sim`` yields)."""

    server: SimServer
    url: str
    kv_events_endpoint: str | None
    replay_endpoint: str | None

    @property
    def engine(self) -> SimEngine:
        """The engine (pool, scheduler, stats) for assertions."""
        return self.server.engine

    @property
    def faults(self) -> Faults:
        """The live fault settings."""
        return self.server.faults


@contextlib.asynccontextmanager
async def start_sim(
    tokenizer: str | Path,
    *,
    model: str = "sim-model",
    block_size: int = 16,
    num_blocks: int | None = None,
    profile: str = "default",
    time_scale: float = 1.0,
    seed: int = 0,
    host: str = "127.0.0.1",
    port: int = 0,
    renderer: PromptRenderer | None = None,
    engine: EngineConfig | None = None,
    **settings: Any,
) -> AsyncIterator[SimHandle]:
    """Run a simulated replica on loopback for the duration of the ``async with``.

    Yields a ``SimHandle`` with the base URL and the resolved event endpoints; any other
    ``SimSettings`` field may be passed by keyword (``kv_events_endpoint``, ``topic``,
    ``legacy_encoding``, ``faults``, ...).
    """
    cfg = engine or EngineConfig(
        model=model, block_size=block_size, num_blocks=num_blocks, profile=profile,
        time_scale=time_scale, seed=seed,
    )
    s = SimSettings(model=model, tokenizer=str(tokenizer), host=host, port=port, engine=cfg,
                    **settings)
    server = SimServer(s, renderer=renderer)
    await server.start()
    try:
        yield SimHandle(server, server.url, server.kv_events_endpoint, server.replay_endpoint)
    finally:
        await server.aclose()


def exit_process() -> None:
    """The CLI's ``crash``: die like a killed engine process."""
    os._exit(17)
