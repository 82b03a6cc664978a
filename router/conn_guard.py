"""Client connections that are slow, idle, too many, or carry oversized headers.

uvicorn's httptools protocol arms one timer, keep-alive, and only after a response: a
client that connects and sends nothing, or stalls mid-headers or mid-body, holds its
connection (and a file descriptor) for ever, and httptools accepts headers of any size
and number (a 1 MB header would reach the replicas).  ``guarded_protocol(limits)``
returns a subclass of it, given to ``uvicorn.Config(http=...)``, that adds
(``ConnectionSettings``):

- **idle**: a connection with no request in progress is closed after
  ``idle_timeout_s``: from accept, not only after a response, and bare CRLFs between
  requests do not restart the clock;
- **header deadline**: the request line and headers must arrive within
  ``header_timeout_s`` of the request's first byte, else 408 and close;
- **body deadline**: the whole body must arrive within ``body_timeout_s`` of the
  headers, else close (408 when no response has started); the app's ``receive()``
  returns ``http.disconnect``, so the proxy drops the request as a client disconnect;
- **header bounds**: more than ``max_header_bytes`` (request line and headers) or
  ``max_headers`` fields is refused with 431 before the app sees the request;
- **connection cap**: a connection accepted while ``max_connections`` are open is
  closed at once.

Deadlines cost no timer per request: each connection keeps one deadline (a float), and
one ``_Sweeper`` per server, a self-rescheduling ``call_later`` that runs only while
connections are open, fires the expired ones every quarter of the shortest timeout
(0.05 to 1 s), so a deadline fires up to that late.  This also replaces uvicorn's own
keep-alive timer, armed after every response.

Answers are OpenAI-shaped JSON with ``connection: close``.  A response in progress on
the connection (a pipelined request behind it) is never overwritten: then the
connection is only closed.  Each refusal is counted in
``router_connections_refused_total{reason}`` once the app's lifespan has built its
metrics.

The subclass relies on uvicorn's ``HttpToolsProtocol`` internals (``parser``, ``cycle``,
``pipeline``, ``flow``, the parser callbacks; ``on_response_complete`` is uvicorn 0.54's
with the keep-alive timer replaced); ``tests/router/test_conn_guard.py`` holds it to them
over real sockets.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, Literal

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from router.config import ConnectionSettings
from router.errors import error_body

__all__ = ["GuardedHttpToolsProtocol", "RefusalReason", "guarded_protocol"]

RefusalReason = Literal["max_connections", "header_timeout", "body_timeout",
                        "headers_too_large"]
"""``router_connections_refused_total{reason}`` values."""

_Phase = Literal["idle", "headers", "body", "closing"]
# After an error answer, the write side is shut (FIN) and what the client still sends is
# read and dropped for at most this long before the close: closing with unread data
# would send an RST, which can destroy the answer before the client reads it (nginx's
# lingering close).
_LINGER_S = 1.0


class _HeadersTooLarge(Exception):
    """Raised from a parser callback to stop parsing an oversized header block."""


class _Sweeper:
    """Fires the expired deadlines of one server's connections, ``period`` apart; runs
    only while a connection is open (so nothing is left behind when the server stops)."""

    def __init__(self, period: float) -> None:
        self.period = period
        self._conns: set[GuardedHttpToolsProtocol] = set()
        self._handle: asyncio.TimerHandle | None = None

    def add(self, conn: GuardedHttpToolsProtocol) -> None:
        self._conns.add(conn)
        if self._handle is None:
            self._handle = conn.loop.call_later(self.period, self._sweep, conn.loop)

    def discard(self, conn: GuardedHttpToolsProtocol) -> None:
        self._conns.discard(conn)
        if not self._conns and self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        expired = [c for c in self._conns if c.deadline_at is not None and c.deadline_at <= now]
        for conn in expired:
            conn.expire()
        self._handle = loop.call_later(self.period, self._sweep, loop) if self._conns else None


def guarded_protocol(limits: ConnectionSettings) -> type[GuardedHttpToolsProtocol]:
    """A ``GuardedHttpToolsProtocol`` class bound to ``limits`` and a sweeper of its own
    (uvicorn builds one instance per connection from the class it is given; use one
    class per server)."""
    shortest = min(limits.header_timeout_s, limits.body_timeout_s, limits.idle_timeout_s)
    sweeper = _Sweeper(min(1.0, max(0.05, shortest / 4)))
    return type("BoundGuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                {"limits": limits, "sweeper": sweeper})


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the guards of the module docstring."""

    limits: ClassVar[ConnectionSettings] = ConnectionSettings()
    """Bound per server by ``guarded_protocol``."""
    sweeper: ClassVar[_Sweeper] = _Sweeper(1.0)
    """Bound per server by ``guarded_protocol``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: _Phase = "idle"
        self.deadline_at: float | None = None
        """When the current phase times out (``loop.time()``); ``None``: never (a
        response is being produced)."""
        self._header_bytes = 0
        """Exact bytes of the request line and completed header fields so far."""
        self._pending = 0
        """Bytes received while the headers are incomplete (an upper bound)."""

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._count("max_connections")
            transport.close()
            return
        self.deadline_at = self.loop.time() + self.limits.idle_timeout_s
        self.sweeper.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.deadline_at = None
        self.sweeper.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase == "closing":
            return
        if self._phase == "headers":
            self._pending += len(data)
            if self._pending > self.limits.max_header_bytes:
                self._refuse_headers()
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _HeadersTooLarge):
                self._refuse_headers()
                return
            self._bad_request()
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            self._bad_request()
            return
        if self._phase == "headers" and self._pending == 0:
            # The request began in this chunk: count all of it (an upper bound).
            self._pending = len(data)
            if self._pending > self.limits.max_header_bytes:
                self._refuse_headers()

    def on_response_complete(self) -> None:
        # uvicorn's, with its keep-alive timer replaced by the idle deadline.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif self._phase == "idle":
            self.deadline_at = self.loop.time() + self.limits.idle_timeout_s

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = "headers"
        self._header_bytes = 0
        self._pending = 0
        self.deadline_at = self.loop.time() + self.limits.header_timeout_s

    def on_url(self, url: bytes) -> None:
        self._header_bytes += len(url)
        if self._header_bytes > self.limits.max_header_bytes:
            raise _HeadersTooLarge
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + 4
        if (self._header_bytes > self.limits.max_header_bytes
                or len(self.headers) >= self.limits.max_headers):
            raise _HeadersTooLarge
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._phase = "body"
        self.deadline_at = self.loop.time() + self.limits.body_timeout_s
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._phase = "idle"
        # Idle from now if the answer is already out (an early error), else once it is.
        self.deadline_at = (self.loop.time() + self.limits.idle_timeout_s
                            if self._between_requests() else None)
        super().on_message_complete()

    # ------------------------------------------------------------------ deadlines
    def _between_requests(self) -> bool:
        cycle = self.cycle
        return cycle is None or cycle.response_complete

    def expire(self) -> None:
        """The current phase's deadline has passed (called by the sweeper)."""
        self.deadline_at = None
        phase = self._phase
        if self.transport.is_closing():
            return
        if phase == "closing" or (phase == "idle" and self._between_requests()):
            self.transport.close()
        elif phase == "headers" and not self._between_requests():
            # Behind a response still being sent: an answer cannot go out now, and a
            # close would cut that response.
            self.deadline_at = self.loop.time() + self.limits.header_timeout_s
        elif phase == "body" and self.pipeline:
            # Queued behind a running response: uvicorn paused reading, so the body
            # waits on us, not on the client.
            self.deadline_at = self.loop.time() + self.limits.body_timeout_s
        elif phase == "headers":
            self._count("header_timeout")
            self._answer_and_close(408, "request headers were not received in time",
                                   "request_timeout")
        elif phase == "body":
            self._count("body_timeout")
            self._answer_and_close(408, "request body was not received in time",
                                   "request_timeout")

    # ------------------------------------------------------------------ refusals
    def _refuse_headers(self) -> None:
        self._count("headers_too_large")
        self._answer_and_close(
            431,
            f"request headers exceed {self.limits.max_header_bytes} bytes or "
            f"{self.limits.max_headers} fields",
            "headers_too_large",
        )

    def _bad_request(self) -> None:
        self.logger.warning("Invalid HTTP request received.")
        self._answer_and_close(400, "invalid HTTP request", "invalid_http_request")

    def _answer_and_close(self, status: int, message: str, code: str) -> None:
        """Write an OpenAI-shaped error unless a response is already under way, then
        close (after a lingering read); the app, if one runs for this request, sees a
        disconnect."""
        self._phase = "idle"
        self.deadline_at = None
        cycle = self.cycle if self.cycle is not None and not self.cycle.response_complete \
            else None
        started = cycle is not None and cycle.response_started
        if not self.transport.is_closing() and not started:
            body = error_body(message, "invalid_request_error", code)
            self.transport.write(b"".join([
                STATUS_LINE[status],
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n\r\n",
                body,
            ]))
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        if started or self.transport.is_closing() or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._phase = "closing"
        self.deadline_at = self.loop.time() + _LINGER_S

    def _count(self, reason: RefusalReason) -> None:
        metrics = self.app_state.get("metrics")
        counter = getattr(metrics, "connections_refused", None)
        if counter is not None:
            counter.labels(reason).inc()
