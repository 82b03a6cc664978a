"""KV event ingestion for the router, and ``kvroute indexer`` (ingestion without HTTP).

For the router's lifespan (one call builds everything; exiting stops it)::

    index = make_index(settings.index)                       # memory | redis
    async with start_ingestion(settings, index, http=session, metrics=index_metrics) as ing:
        ...  # ing.statuses() -> {source id: SourceStatus}; ing.sources

With a Redis index, ingestion runs under per-source leases (``index.lease``): any number
of routers and ``kvroute indexer`` processes can run it, exactly one applies each
replica's events, the others stand by and read the owner's ``SourceStatus`` from Redis.
With the in-memory index every router ingests everything itself (no lease).

``kvroute indexer --config FILE [--replica URL ...] [--metrics-port P]`` runs the same
ingestion alone, until SIGINT/SIGTERM; ``--metrics-port`` serves ``/metrics`` and
``/status`` (JSON) on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp

    from index.ingestion import KVEventIngestion, SourceSpec
    from index.store import KVIndex
    from router.config import IndexSettings, RouterSettings
    from router.index_metrics import IndexMetrics, InstrumentedIndex

__all__ = [
    "check_index",
    "instrumented_index",
    "make_index",
    "register",
    "run_indexer",
    "source_specs",
    "start_ingestion",
]


def make_index(settings: IndexSettings) -> KVIndex:
    """The configured backend (not instrumented; wrap it in ``InstrumentedIndex``)."""
    from index.memory import InMemoryIndex
    from index.redis_store import RedisIndex

    if settings.backend == "redis":
        return RedisIndex.from_url(
            settings.url, key_prefix=settings.key_prefix, op_timeout_s=settings.op_timeout_s
        )
    return InMemoryIndex()


async def check_index(index: KVIndex) -> None:
    """Refuse to start on a Redis namespace this version cannot share (another
    ``max_replicas`` or key layout): ``ConfigError`` naming it.  An unreachable Redis
    does not stop start-up (the router degrades, and the first write checks again)."""
    import logging

    from index.redis_store import RedisIndex
    from index.store import IndexUnavailable
    from router.config import ConfigError

    inner = getattr(index, "inner", index)
    if not isinstance(inner, RedisIndex):
        return
    try:
        await inner.check_namespace()
    except IndexUnavailable as exc:
        logging.getLogger(__name__).warning(
            "redis index not reachable at start-up (%s); its namespace is checked on the "
            "first write", exc)  # fmt: skip
    except ValueError as exc:
        raise ConfigError(f"invalid kvroute configuration:\n  index: {exc}") from exc


def instrumented_index(settings: IndexSettings, metrics: IndexMetrics) -> InstrumentedIndex:
    """The configured backend wrapped so it records ``metrics`` (``backend`` label)."""
    from router.index_metrics import InstrumentedIndex

    return InstrumentedIndex(make_index(settings), metrics, backend=settings.backend)


def source_specs(settings: RouterSettings) -> list[SourceSpec]:
    """One ``SourceSpec`` per configured replica (discovery fills in what is missing)."""
    from index.ingestion import SourceSpec
    from kvkeys.types import ReplicaId

    return [
        SourceSpec(
            ReplicaId(r.id),
            model=r.models[0] if r.models else None,
            url=r.url,
            endpoint=r.kv_events_endpoint,
            replay_endpoint=r.replay_endpoint,
        )
        for r in settings.replicas
    ]


@asynccontextmanager
async def start_ingestion(
    settings: RouterSettings,
    index: KVIndex,
    *,
    http: aiohttp.ClientSession | None = None,
    metrics: IndexMetrics | None = None,
    lease_ttl_s: float = 10.0,
    owner: str | None = None,
) -> AsyncIterator[KVEventIngestion]:
    """Run ingestion for every configured replica while the context is open."""
    import asyncio

    from aio.cancel import cancel_and_wait
    from index.ingestion import KVEventIngestion, LeaseSettings
    from index.redis_store import RedisIndex

    inner = getattr(index, "inner", index)
    lease = None
    if isinstance(inner, RedisIndex):
        kwargs: dict[str, Any] = {"ttl_s": lease_ttl_s, "key_prefix": inner.ns}
        if owner is not None:
            kwargs["owner"] = owner
        lease = LeaseSettings(inner.client, **kwargs)
    ingestion = KVEventIngestion(
        index,
        source_specs(settings),
        http=http,
        observer=metrics.observer() if metrics is not None else None,
        lease=lease,
    )
    if metrics is not None:
        metrics.watch_sources(ingestion.statuses)
    task = asyncio.create_task(ingestion.run(), name="kv-ingestion")
    try:
        yield ingestion
    finally:
        await cancel_and_wait(task)


async def run_indexer(settings: RouterSettings, *, metrics_port: int = 0,
                      lease_ttl_s: float = 10.0) -> None:  # fmt: skip
    """``kvroute indexer``: ingest until cancelled (SIGINT/SIGTERM cancel it)."""
    import asyncio
    import json
    import signal
    from dataclasses import asdict

    from aiohttp import web
    from prometheus_client import CollectorRegistry, generate_latest

    from router.index_metrics import IndexMetrics, keep_block_gauges

    registry = CollectorRegistry()
    metrics = IndexMetrics(registry)
    index = instrumented_index(settings.index, metrics)
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if main is not None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, main.cancel)
    runner: web.AppRunner | None = None
    try:
        await check_index(index)
        async with start_ingestion(settings, index, metrics=metrics,
                                   lease_ttl_s=lease_ttl_s) as ingestion:  # fmt: skip
            if metrics_port:

                async def metrics_page(request: web.Request) -> web.Response:
                    return web.Response(body=generate_latest(registry),
                                        content_type="text/plain")  # fmt: skip

                async def status_page(request: web.Request) -> web.Response:
                    body = {rid: asdict(st) for rid, st in ingestion.statuses().items()}
                    return web.json_response(body, dumps=lambda o: json.dumps(o, default=str))

                app = web.Application()
                app.router.add_get("/metrics", metrics_page)
                app.router.add_get("/status", status_page)
                runner = web.AppRunner(app, access_log=None)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", metrics_port).start()
            await keep_block_gauges(index, metrics, lambda: list(ingestion.sources))
    finally:
        if runner is not None:
            await runner.cleanup()
        await index.aclose()
        metrics.close()


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add ``kvroute indexer``."""
    p = sub.add_parser(
        "indexer",
        help="ingest the replicas' KV events into the shared (Redis) index, without HTTP",
        description="Subscribe to every replica's vLLM KV events and keep the index "
        "current. With a Redis index several indexers and routers coordinate through "
        "leases: exactly one ingests each replica.",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML settings (replicas, index: {backend: redis, url: ...})",
    )
    p.add_argument(
        "--replica",
        metavar="URL",
        action="append",
        default=None,
        help="base URL of a replica (repeat); its events are discovered from GET /kv_event_sources",
    )
    p.add_argument(
        "--redis",
        metavar="URL",
        default=None,
        help="use the Redis index at URL (sets index.backend=redis)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve /metrics and /status on 127.0.0.1:PORT (0: off)",
    )
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=10.0,
        help="seconds a dead ingester keeps its replicas before another takes over",
    )
    p.add_argument(
        "--log-level", default=None, choices=["critical", "error", "warning", "info", "debug"]
    )
    p.set_defaults(func=_indexer)  # fmt: skip


def _indexer(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from router.config import ConfigError, RouterSettings

    cli: dict[str, Any] = {}
    if args.replica:
        cli["replicas"] = [{"url": url} for url in args.replica]
    if args.redis:
        cli["index"] = {"backend": "redis", "url": args.redis}
    if args.log_level is not None:
        cli["log_level"] = args.log_level
    try:
        settings = RouterSettings.load(config_file=args.config, cli=cli)
    except ConfigError as exc:
        print(f"kvroute indexer: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    try:
        asyncio.run(run_indexer(settings, metrics_port=args.metrics_port,
                                lease_ttl_s=args.lease_ttl))  # fmt: skip
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    return 0
