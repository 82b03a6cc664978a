"""One serving process of ``kvroute serve``: the router app under uvicorn on a bound
socket, until SIGINT/SIGTERM.  ``router.cli`` runs it for one process, ``router.workers``
in each worker.  Heavy imports (uvicorn, the app) happen inside the functions."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn
    from starlette.applications import Starlette

    from router.config import RouterSettings
    from router.worker_peers import WorkerPeers

__all__ = ["run_server"]

# Young-generation threshold of the cyclic collector in ``kvroute serve`` (default 700).
_GC_YOUNG = 20_000


def run_server(settings: RouterSettings, sock: socket.socket, *, worker: int = 0,
               peers: WorkerPeers | None = None) -> int:
    """Serve the router app on ``sock`` until SIGINT/SIGTERM (graceful); 0 on a clean
    run, 1 if it never started.  ``worker`` is the index under ``--workers``, ``peers``
    where the workers meet."""
    import uvicorn

    from router.app import create_app

    config = _uvicorn_config(create_app(settings, worker=worker, peers=peers), settings)
    if worker == 0:
        _log_start(settings, sock.getsockname()[1])
    server = uvicorn.Server(config)
    _tune_gc()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1


def _log_start(settings: RouterSettings, port: int) -> None:
    import logging

    log = logging.getLogger("kvroute.serve")
    log.info("listening on http://%s:%d (policy %s, index %s)", settings.host, port,
             settings.policy, settings.index.backend)
    for replica in settings.replicas:
        log.info("replica %s: %s", replica.id, replica.url)


def _uvicorn_config(app: Starlette, settings: RouterSettings) -> uvicorn.Config:
    """The uvicorn configuration of ``kvroute serve`` (uvloop, guarded httptools)."""
    import uvicorn

    from router.conn_guard import guarded_protocol

    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        # httptools, with timeouts and bounds on slow, idle and oversized clients.
        http=guarded_protocol(settings.connections),  # also the keep-alive (idle) timeout
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
