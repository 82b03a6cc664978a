"""``kvroute serve --workers N``: N router processes on one port.

A supervisor (this process) starts N workers (``multiprocessing``, spawn: a fresh
interpreter each, nothing inherited but the settings) and watches them.  Each worker
binds the same ``host:port`` with ``SO_REUSEPORT``, so the kernel spreads incoming
connections over the workers' accept queues (no shared accept, no thundering herd), and
runs the whole router app with its own event loop; a worker listens only once its app
has started, so no connection waits on a worker that is still starting.  With
``port: 0`` the supervisor picks the port and keeps it reserved (bound, not listening)
while the workers run.

What the workers share, and how:

* **Index.**  ``memory``: each worker ingests every replica's KV events into its own
  index (a ZMQ PUB serves any number of subscribers; every worker sees every event, so
  every worker predicts the same cached tokens).  ``redis``: one index; the ingestion
  lease makes exactly one process ingest each replica, all read the same entries.
* **Load.**  Each worker counts its own in-flight requests and reads the replicas'
  ``/metrics`` (queue, running requests) that show everyone's load; the other workers'
  requests count as foreign load there.
* **The kv policy's look ahead.**  Each worker tells the others of the requests it
  routes and that finish, over IPC sockets in a directory the supervisor creates for
  them (``router.outlook_ipc``), or over the Redis index's channel when the index is in
  Redis (``router.outlook_redis``: the other hosts' routers are on it too), so every
  worker forecasts pool space and evictions from the whole fleet's requests, not its
  own share (``router.outlook_peers``).
* **Session affinity.**  The consistent-hash ring is a pure function of the member ids,
  so every worker pins a session key to the same replica.  Session tables (think time,
  prefix breaks) are per worker: a conversation's turns may land on different workers,
  which then learn from the same KV events.
* **Membership.**  Each worker reads the same sources (static list, file, DNS) and so
  sees the same fleet.  The admin API is per worker (worker ``i`` listens on
  ``admin.port + i``): a change made there reaches one worker only, so fleets served by
  several workers are best changed through the membership file (SIGHUP to the
  supervisor is forwarded to every worker) or DNS.

Signals: SIGTERM or SIGINT make every worker shut down gracefully (in-flight requests
get ``timeouts.shutdown_grace_s``), then the supervisor exits 0; a worker still alive
after that (plus a margin) is killed.  SIGHUP is forwarded.  A worker that dies on its
own is restarted (at most once a second); one that dies within 10 s of starting three
times in a row (it cannot start: a Redis namespace of another layout, a port taken by
another program) stops them all, and the supervisor exits 1.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from router.listen import bind_socket
from router.parent_watch import stop_with_parent
from router.worker_peers import WorkerPeers

__all__ = ["reuseport_socket", "run_workers"]

_log = logging.getLogger(__name__)
_RESTART_EVERY_S = 1.0
_EARLY_EXIT_S = 10.0
_EARLY_EXITS_TO_GIVE_UP = 3
_NEVER_STARTED = 3
"""A worker's exit code when its server never started (a port taken, a bad wiring): an
early exit however long the start took, which a loaded machine can stretch past
``_EARLY_EXIT_S``."""
_POLL_S = 0.2
_PARENT_POLL_S = 1.0


def reuseport_socket(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """A socket on ``host:port`` that every worker can bind too (``SO_REUSEPORT``),
    listening unless ``listen`` is false (a port reservation)."""
    return bind_socket(host, port, reuse_port=True, listen=listen)


def _worker(data: dict[str, Any], index: int, peers: WorkerPeers) -> None:
    """One worker process: the router app on the shared port."""
    from router.config import RouterSettings
    from router.serving import run_server

    settings = RouterSettings.model_validate(data)
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [worker {index}] %(name)s: "
                        "%(message)s")  # fmt: skip
    # Bound, not listening: uvicorn listens once the app has started, so the kernel never
    # queues a connection on a worker that is still starting (or that fails to start).
    sock = reuseport_socket(settings.host, settings.port, listen=False)
    # A worker must never keep serving the port unsupervised (a SIGKILLed supervisor).
    stop_with_parent(os.getppid(), poll_s=_PARENT_POLL_S)
    code = run_server(settings, sock, worker=index, peers=peers)
    raise SystemExit(_NEVER_STARTED if code == 1 else code)


def run_workers(data: dict[str, Any], host: str, port: int, workers: int,
                grace_s: float) -> int:  # fmt: skip
    """Supervise ``workers`` router processes on ``host:port`` until SIGTERM/SIGINT.

    ``data`` is the validated settings as JSON-ready data (re-validated in each worker)."""
    reservation = reuseport_socket(host, port, listen=False)
    port = reservation.getsockname()[1]
    meeting = tempfile.mkdtemp(prefix="kvroute-workers-")  # mode 0700: theirs alone
    data = {**data, "port": port}
    ctx = multiprocessing.get_context("spawn")
    procs: list[BaseProcess | None] = [None] * workers
    started: list[float] = [0.0] * workers
    early_exits = [0] * workers
    stopping = False
    failed = False

    def start(i: int) -> None:
        p = ctx.Process(target=_worker, args=(data, i, WorkerPeers(meeting, i, workers)),
                        name=f"kvroute-worker-{i}")
        p.start()
        procs[i] = p
        started[i] = time.monotonic()

    def on_stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    def on_hup(signum: int, frame: FrameType | None) -> None:
        _signal_all(procs, signal.SIGHUP)

    previous = {s: signal.signal(s, on_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, on_hup)
    _log.info("kvroute: %d workers on %s:%d (SO_REUSEPORT)", workers, host, port)
    try:
        for i in range(workers):
            start(i)
        while not stopping:
            time.sleep(_POLL_S)
            for i, p in enumerate(procs):
                if stopping or p is None or p.is_alive():
                    continue
                lived = time.monotonic() - started[i]
                early = lived < _EARLY_EXIT_S or p.exitcode == _NEVER_STARTED
                early_exits[i] = early_exits[i] + 1 if early else 0
                if early_exits[i] >= _EARLY_EXITS_TO_GIVE_UP:
                    _log.error("worker %d exited %d times within %.0f s of starting (code "
                               "%s); stopping", i, early_exits[i], _EARLY_EXIT_S, p.exitcode)
                    stopping = failed = True
                    break
                _log.error("worker %d exited (code %s); restarting it", i, p.exitcode)
                if lived < _RESTART_EVERY_S:
                    time.sleep(_RESTART_EVERY_S)
                start(i)
        _signal_all(procs, signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 5.0
        for p in procs:
            if p is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        clean = True
        for p in procs:
            if p is not None and p.is_alive():
                _log.error("worker %s did not stop in time; killing it", p.name)
                p.kill()
                p.join()
                clean = False
        return 0 if clean and not failed else 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        reservation.close()
        shutil.rmtree(meeting, ignore_errors=True)


def _signal_all(procs: list[BaseProcess | None], signum: int) -> None:
    for p in procs:
        if p is not None and p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass
