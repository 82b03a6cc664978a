"""The admin listener: the FastAPI admin app (``router.admin``) under its own uvicorn
server, in the router's event loop, started and stopped by the router's lifespan.

It binds ``admin.host:admin.port + worker`` (``kvroute serve --workers N``: worker i on
``port + i``; each worker has its own membership, so an admin change goes to each worker
or, better, through the membership file or DNS, which every worker reads).  It installs
no signal handlers (the main server owns SIGINT/SIGTERM).  The main app's lifespan
state is put in every admin request's scope, so the admin routes read the same objects
as the proxy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import uvicorn

from router.admin import build_admin_app
from router.listen import bind_socket
from router.proxy import Receive, Scope, Send

__all__ = ["serve_admin"]

_log = logging.getLogger(__name__)


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone."""

    def install_signal_handlers(self) -> None:
        return None

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _WithState:
    """ASGI wrapper: the main app's lifespan state in every admin request's scope."""

    def __init__(self, app: Any, state: Mapping[str, Any]) -> None:
        self._app = app
        self._state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return  # nothing to start: the main app's lifespan owns everything
        scope["state"] = dict(self._state)
        await self._app(scope, receive, send)


@asynccontextmanager
async def serve_admin(state: Mapping[str, Any], *, worker: int = 0) -> AsyncIterator[str | None]:
    """Serve the admin API while the context is open; yields its base URL (``None``
    when ``admin.enabled`` is off)."""
    admin = state["settings"].admin
    if not admin.enabled:
        yield None
        return
    port = admin.port + worker if admin.port else 0
    sock = bind_socket(admin.host, port)
    bound = sock.getsockname()[1]
    app = _WithState(build_admin_app(state, worker=worker), state)
    config = uvicorn.Config(app, http="httptools", lifespan="off", log_level="warning",
                            access_log=False, timeout_graceful_shutdown=2, server_header=False)
    server = _QuietServer(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]),
                                                  name="admin-server")
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            task.result()
        host = f"[{admin.host}]" if ":" in admin.host else admin.host
        url = f"http://{host}:{bound}"
        _log.info("admin API on %s (OpenAPI at %s/docs)", url, url)
        yield url
    finally:
        server.should_exit = True
        await asyncio.gather(task, return_exceptions=True)
        sock.close()
