"""``kvroute indexer``: the KV stack (``router.kv_stack``) without the HTTP proxy.

``kvroute indexer --config FILE [--replica URL ...] [--metrics-port P]`` ingests every
replica's KV events into the (shared Redis) index until SIGINT/SIGTERM; ``--metrics-port``
serves ``/metrics`` and ``/status`` (JSON) on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from index.status import SourceStatus
    from kvkeys.types import ReplicaId
    from router.config import RouterSettings

__all__ = ["register", "run_indexer"]


async def run_indexer(settings: RouterSettings, *, metrics_port: int = 0,
                      lease_ttl_s: float = 10.0) -> None:  # fmt: skip
    """``kvroute indexer``: ingest until cancelled (SIGINT/SIGTERM cancel it)."""
    import asyncio
    import signal

    from prometheus_client import CollectorRegistry

    from router.index_metrics import IndexMetrics
    from router.kv_stack import open_kv_stack

    registry = CollectorRegistry()
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if main is not None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, main.cancel)
    async with open_kv_stack(settings, IndexMetrics(registry), lease_ttl_s=lease_ttl_s) as stack:
        runner = None
        if metrics_port:
            runner = await _serve_status(registry, stack.ingestion.statuses, metrics_port)
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            if runner is not None:
                await runner.cleanup()


async def _serve_status(
    registry: CollectorRegistry,
    statuses: Callable[[], Mapping[ReplicaId, SourceStatus]],
    port: int,
) -> web.AppRunner:
    """Serve ``/metrics`` and ``/status`` on 127.0.0.1:``port``."""
    import json
    from dataclasses import asdict

    from aiohttp import web
    from prometheus_client import generate_latest

    async def metrics_page(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    async def status_page(request: web.Request) -> web.Response:
        body = {rid: asdict(st) for rid, st in statuses().items()}
        return web.json_response(body, dumps=lambda o: json.dumps(o, default=str))

    app = web.Application()
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/status", status_page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


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
        "--log-level", default=None, choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default info; setting: log_level)",
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
    if settings.index.backend != "redis":
        print("kvroute indexer: needs a shared Redis index (--redis URL, or index.backend: "
              "redis with index.url in --config): with the in-memory index its events would "
              "go into a private index that no router can read", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    try:
        asyncio.run(run_indexer(settings, metrics_port=args.metrics_port,
                                lease_ttl_s=args.lease_ttl))  # fmt: skip
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    return 0
