"""Subcommands of ``kvroute`` that belong to ``router``.

``kvroute serve --host H --port P --replica URL [--replica URL ...] [--config FILE]
[--policy NAME] [--log-level LEVEL]``: flags override ``KVROUTE_*`` variables, which
override the YAML file (``router.config``).  The command line is a stable interface.
Heavy imports (uvicorn, the app) happen inside the handler so ``kvroute --help`` is fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from router import kv_stack

if TYPE_CHECKING:
    import uvicorn
    from starlette.applications import Starlette

    from router.config import RouterSettings

_SERVE_EPILOG = """\
configuration sources, lowest priority first: defaults, the YAML file (--config),
KVROUTE_* environment variables (nested fields with '__', e.g.
KVROUTE_TIMEOUTS__CONNECT_S=2; lists as JSON, e.g.
KVROUTE_REPLICAS='[{"url": "http://127.0.0.1:8000"}]'), then these flags.

example:
  kvroute serve --port 8080 --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002
"""


# Young-generation threshold of the cyclic collector in ``kvroute serve`` (default 700).
_GC_YOUNG = 20_000


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add this layer's subcommands to the ``kvroute`` parser."""
    _register_serve(sub)
    kv_stack.register(sub)


def _register_serve(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the router (an OpenAI-compatible proxy in front of vLLM replicas)",
        description="Run the kvroute router: an OpenAI-compatible streaming reverse proxy "
        "that routes each request to one of the replicas.",
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default=None,
                   help="address to listen on (default 127.0.0.1; setting: host)")
    p.add_argument("--port", type=int, default=None,
                   help="port to listen on (default 8080; setting: port)")
    p.add_argument("--replica", metavar="URL", action="append", default=None,
                   help="base URL of an upstream replica, e.g. http://127.0.0.1:8000; repeat "
                   "for each replica (replaces the 'replicas' setting; its id is host:port)")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="YAML file with any settings (replicas, timeouts, health, failover, "
                   "index, scoring, ...)")
    p.add_argument("--policy", metavar="NAME", default=None,
                   help="routing policy: kv (KV-cache aware, the default), session, "
                   "round_robin, least_loaded or random; a request may pick another with "
                   "the X-KVRoute-Policy header (setting: policy)")
    p.add_argument("--log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="log level (default info; setting: log_level)")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from router.app import create_app
    from router.config import ConfigError, RouterSettings
    from router.listen import bind_socket

    cli: dict[str, Any] = {}
    if args.host is not None:
        cli["host"] = args.host
    if args.port is not None:
        cli["port"] = args.port
    if args.replica:
        cli["replicas"] = [{"url": url} for url in args.replica]
    if args.policy is not None:
        cli["policy"] = args.policy
    if args.log_level is not None:
        cli["log_level"] = args.log_level
    try:
        settings = RouterSettings.load(config_file=args.config, cli=cli)
        app = create_app(settings)
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = _uvicorn_config(app, settings)
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        print(f"kvroute serve: cannot listen on {settings.host}:{settings.port}: {exc}",
              file=sys.stderr)
        return 1
    server = uvicorn.Server(config)
    _tune_gc()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1


def _uvicorn_config(app: Starlette, settings: RouterSettings) -> uvicorn.Config:
    """The uvicorn configuration of ``kvroute serve`` (uvloop, httptools)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level=settings.log_level,
        access_log=settings.access_log,
        # X-Forwarded-* only change the client address uvicorn logs; the router reads
        # neither, so without an access log the middleware is a layer per request for
        # nothing.
        proxy_headers=settings.access_log,
        timeout_graceful_shutdown=int(settings.timeouts.shutdown_grace_s + 0.999),
        server_header=False,
        date_header=False,
    )


def _tune_gc() -> None:
    """The cyclic collector's settings for a serving process (called once, before serving).

    Everything imported so far lives as long as the process: ``gc.freeze()`` moves it out
    of the collector's reach, so full collections under load do not rescan it (CPU and
    p99).  A proxied request allocates a few hundred container objects and frees them all
    (no cycles on the happy path), but 32-128 requests in flight keep the young
    generation above the default 700 net allocations, so the collector ran about once
    per request and rescanned the in-flight state (~5% of the router's CPU).  At
    ``_GC_YOUNG`` it runs only when garbage really accumulates (a few MB at most).
    """
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG, *gc.get_threshold()[1:])
