"""``run_server``: the router app under a real uvicorn on a free loopback port, in the test's
event loop (httptools, like production), stopped and awaited on exit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from starlette.applications import Starlette

from router.config import ConnectionSettings
from router.conn_guard import guarded_protocol
from router.listen import bind_socket


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # the test process keeps its handlers
        pass

    def capture_signals(self):  # type: ignore[no-untyped-def]
        from contextlib import nullcontext

        return nullcontext()


@asynccontextmanager
async def run_server(app: Starlette, *, grace_s: int = 5,
                     connections: ConnectionSettings | None = None) -> AsyncIterator[str]:
    """Serve ``app``; yields its base URL.  With ``connections``, the connection guards
    of ``kvroute serve`` apply (``router.conn_guard``)."""
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    # Idle keep-alive connections stay open for the test's length: with uvicorn's 5 s
    # default, a loaded machine's pauses let the server close a pooled connection just as
    # the client reuses it (a spurious ServerDisconnectedError on a POST).  Tests of the
    # connection guards pass ``connections`` (whose idle timeout then applies).
    http: type[asyncio.Protocol] | str = (
        "httptools" if connections is None else guarded_protocol(connections))
    config = uvicorn.Config(app, http=http, lifespan="on", log_level="warning",
                            access_log=False, timeout_graceful_shutdown=grace_s,
                            timeout_keep_alive=120, server_header=False, date_header=False)
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server did not start")
            await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()
