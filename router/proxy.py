"""The streaming reverse proxy: one request in, one upstream attempt at a time, bytes out.

Per request (``Proxy.handle``, a raw ASGI handler, no Starlette Request/Response):

1. Scan headers once; read the body (413 past ``max_body_bytes``); parse only what
   routing needs (``router.request``); 400 on bad JSON or a missing field.
2. Candidates = healthy replicas serving the model (404 if none serves it, 503 with
   ``Retry-After`` if none of those is up); the policy (default, or the one named by the
   policy header) orders them into a ``Decision``.
3. Attempts, at most ``failover.max_attempts``, over ``decision.replicas``: each attempt
   owns ``with lease(replica)`` and the upstream response in one block whose
   ``finally`` releases both, whatever happens (disconnect, cancel, error).  A connect
   error, a timeout or a 5xx **before the first byte** moves on to the next candidate
   after a ``Backoff`` sleep; the last 5xx is passed through, the last connect error or
   timeout becomes 502/504.
4. The client's response starts only with the upstream's first body chunk (so a failure
   before it can still fail over), then chunks are relayed as they arrive, never
   buffered.  After the first byte, an upstream failure ends the stream with a final
   ``data: {"error": ...}`` event.
5. A watcher task (started once the request has run ``_WATCH_AFTER_S``, 250 ms) waits
   for ``http.disconnect``; on a disconnect it cancels the handler, which closes the
   upstream connection (vLLM aborts the request) well within a second.
6. ``policy.record(request, decision, receipt)`` once, with the usage the replica
   reported (``router.usage``).

Response headers added: ``x-request-id``, ``x-kvroute-replica``, ``x-kvroute-reason``,
``x-kvroute-predicted-cached-tokens`` (when the decision predicts).

Cost: the hot path is three coroutines deep (``handle``, ``_attempts``, ``_attempt``) and
allocates little beyond what uvicorn and aiohttp need; the JSON parse of the body is its
largest own cost.  ``python -m bench.proxy_overhead`` measures it (router CPU per request).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import aiohttp
from yarl import URL

from aio.backoff import Backoff
from kvkeys.types import ReplicaId
from router.config import RouterSettings
from router.errors import (
    NoHealthyReplica,
    ReplicaTimeout,
    ReplicaUnavailable,
    RouterError,
    UnknownModel,
    UpstreamError,
    sse_error_event,
    to_response,
)
from router.load import Lease, LoadTracker
from router.metrics import Outcome, RouterMetrics
from router.plugins import PolicyRegistry
from router.policy import Decision, Endpoint, Receipt, RouteRequest
from router.replica_registry import ReplicaRegistry
from router.request import ClientDisconnected, parse_body, read_body, scan_headers
from router.usage import UsageTap, inject_include_usage, usage_of_body

__all__ = ["Proxy"]

_log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_CLIENT_GONE = 499  # nginx's "client closed request", for metrics only
# Delay before a request gets a disconnect watcher task.  It bounds how late a disconnect
# is noticed (this, plus one loop iteration: well under the 1 s contract) and spares
# every shorter request the task, the receive() and the cancel (~10 us of CPU).  It must
# stay well above the latency of a quick answer under load (tens of ms at 128 requests in
# flight): at 50 ms, a loaded router crossed it, and every request then paid for a
# watcher, which made it slower still.
_WATCH_AFTER_S = 0.25
# Upstream response headers not passed on: hop-by-hop ones, the length (the router frames
# the body itself) and the request id (the router sets its own).
_RESP_HOP = frozenset({
    b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"upgrade",
    b"trailer", b"proxy-authenticate", b"x-request-id",
})
_CONNECT_ERRORS = (aiohttp.ClientConnectionError, OSError)


class _Retry(Exception):
    """Internal: this attempt failed before the first byte; try the next replica."""

    def __init__(self, error: UpstreamError, outcome: Outcome) -> None:
        self.error = error
        self.outcome = outcome


class _Call:
    """Per-request state shared by the attempts and the disconnect watcher."""

    __slots__ = ("endpoint", "method", "path", "query", "body", "headers", "stream",
                 "tap_strip", "request_id", "route", "decision", "prompt_estimate",
                 "receipt_ok", "prompt_tokens", "cached_tokens", "completion_tokens", "ttfb_s",
                 "replica", "done", "gone", "watcher")

    def __init__(self, endpoint: Endpoint, method: str, path: str, query: bytes, body: bytes,
                 headers: dict[str, str], stream: bool, tap_strip: bool, request_id: str,
                 route: RouteRequest, decision: Decision, prompt_estimate: int) -> None:
        self.endpoint = endpoint
        self.method = method
        self.path = path
        self.query = query
        self.body = body
        self.headers = headers
        self.stream = stream
        self.tap_strip = tap_strip
        self.request_id = request_id
        self.route = route
        self.decision = decision
        self.prompt_estimate = prompt_estimate
        """Prompt tokens for the load lease (the decision's count, else an estimate)."""
        self.receipt_ok = False
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.ttfb_s: float | None = None
        self.replica: ReplicaId | None = None
        self.done = False
        """The response is complete (or being completed): a disconnect no longer matters."""
        self.gone = False
        """The watcher saw the client leave and cancelled the handler."""
        self.watcher: asyncio.Task[None] | None = None


class Proxy:
    """The proxy's hot path; built once in the lifespan with everything it needs."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        replicas: ReplicaRegistry,
        load: LoadTracker,
        metrics: RouterMetrics,
        policies: PolicyRegistry,
        session: aiohttp.ClientSession,
        clock: Callable[[], float],
    ) -> None:
        self._replicas = replicas
        self._load = load
        self._metrics = metrics
        self._policies = policies
        self._session = session
        self._clock = clock
        self._limit = settings.max_body_bytes
        self._policy_header = settings.policy_header.lower().encode("latin-1")
        self._session_header = settings.session_header.lower().encode("latin-1")
        t = settings.timeouts
        self._stream_timeout = aiohttp.ClientTimeout(sock_connect=t.connect_s,
                                                     sock_read=t.stream_read_s)
        self._plain_timeout = aiohttp.ClientTimeout(sock_connect=t.connect_s,
                                                    sock_read=t.non_stream_read_s)
        f = settings.failover
        self._backoff = Backoff(f.backoff_base_s, f.backoff_cap_s, f.max_attempts)
        self._passive = settings.health.passive_failures
        self._retry_after = max(1, round(settings.health.interval_s))
        # Request ids for requests that bring none: unique, not secret, so a PRNG seeded
        # once from the OS (os.urandom per request is a system call each time).
        self._ids = random.Random(os.urandom(16))
        self._loop: asyncio.AbstractEventLoop | None = None
        # Caches of bounded size: replica ids and paths come from the configuration and
        # the routes, reasons from small per-policy enums.
        self._urls: dict[tuple[ReplicaId, str], URL] = {}
        self._bytes: dict[str, bytes] = {}

    def _b(self, text: str) -> bytes:
        """``text`` as latin-1 bytes, cached (replica ids and reasons: bounded sets)."""
        raw = self._bytes.get(text)
        if raw is None:
            raw = text.encode("latin-1")
            if len(self._bytes) < 4096:
                self._bytes[text] = raw
        return raw

    # ------------------------------------------------------------------ entry point
    async def handle(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        """Serve one proxied request (ASGI)."""
        clock = self._clock
        t0 = clock()
        status = 500
        try:
            status = await self._handle(scope, receive, send, endpoint)
        finally:
            metrics = self._metrics
            metrics.requests.labels(endpoint, _status_text(status)).inc()
            metrics.request_duration.labels(endpoint).observe(clock() - t0)

    def _new_id(self) -> str:
        return self._ids.randbytes(16).hex()

    async def _handle(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> int:
        try:
            inc = scan_headers(scope["headers"], self._policy_header, self._session_header)
        except RouterError as exc:
            return await _send_error(send, exc, self._new_id())
        request_id = inc.request_id or self._new_id()
        try:
            body = await read_body(receive, self._limit, inc.content_length)
            parsed = parse_body(endpoint, body)
            model = parsed.get("model") if parsed is not None else None
            if model is not None and not isinstance(model, str):
                model = None
            route = RouteRequest(request_id, endpoint, scope["path"], model, parsed,
                                 inc.session or _user(parsed), inc.policy)
            policy = self._policies.get(inc.policy) if inc.policy else self._policies.default
            candidates, known = self._replicas.candidates(model)
            if not candidates:
                if not known:
                    raise UnknownModel(f"The model '{model}' does not exist")
                raise NoHealthyReplica("no healthy replica can serve this request",
                                       retry_after_s=self._retry_after)
            decision = await policy.route(route, candidates)
        except ClientDisconnected:
            self._metrics.client_disconnects.inc()
            return _CLIENT_GONE
        except RouterError as exc:
            return await _send_error(send, exc, request_id)
        self._metrics.decisions.labels(decision.policy, decision.reason).inc()

        stream = parsed is not None and endpoint != "other" and parsed.get("stream") is True
        strip = False
        if stream and decision.want_usage and parsed is not None:
            options = parsed.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage") is True):
                body = inject_include_usage(body, parsed)
                strip = True
        headers = inc.forward
        headers["x-request-id"] = request_id
        prompt_tokens = decision.prompt_tokens
        if prompt_tokens is None:
            prompt_tokens = len(body) // 4  # load estimate only: ~4 bytes of JSON per token
        call = _Call(endpoint, scope["method"], scope["path"], scope.get("query_string", b""),
                     body, headers, stream, strip, request_id, route, decision, prompt_tokens)
        _log.debug("request %s -> %s (%s/%s)", request_id, decision.replicas[0],
                   decision.policy, decision.reason)

        # The disconnect watcher starts only if the request is still running after
        # _WATCH_AFTER_S: quick answers never pay for a task, and a client that left
        # earlier is seen at once when it starts (receive() reports the disconnect).
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        timer = loop.call_later(_WATCH_AFTER_S, self._start_watcher, call, receive, task)
        try:
            return await self._attempts(call, send)
        except asyncio.CancelledError:
            if call.gone and task.uncancel() == 0:
                self._metrics.client_disconnects.inc()
                return _CLIENT_GONE
            raise
        finally:
            timer.cancel()
            if call.watcher is not None:
                call.watcher.cancel()
            receipt = Receipt(call.replica or decision.replicas[0], call.receipt_ok,
                              call.prompt_tokens, call.cached_tokens, call.ttfb_s,
                              call.completion_tokens)
            try:
                policy.record(route, decision, receipt)
            except Exception:  # a policy bug must not break the response path
                _log.exception("policy %s failed to record request %s",
                               decision.policy, request_id)

    def _start_watcher(self, call: _Call, receive: Receive, task: asyncio.Task[Any]) -> None:
        if not call.done:
            assert self._loop is not None
            call.watcher = self._loop.create_task(_watch(call, receive, task))

    # ------------------------------------------------------------------ attempts
    async def _attempts(self, call: _Call, send: Send) -> int:
        order = call.decision.replicas
        attempts = min(len(order), self._backoff.max_attempts)
        last_error: UpstreamError | None = None
        for i in range(attempts):
            replica = order[i]
            if i:
                self._metrics.failovers.labels(order[i - 1]).inc()
                delay = self._backoff.compute(i)
                if delay:
                    await asyncio.sleep(delay)
            call.replica = replica
            try:
                return await self._attempt(call, replica, send, i == attempts - 1)
            except _Retry as retry:
                self._metrics.upstream_requests.labels(replica, retry.outcome).inc()
                if retry.outcome == "connect_error" and self._passive:
                    self._replicas.record_probe(replica, False)
                last_error = retry.error
        assert last_error is not None
        call.done = True
        return await _send_error(send, last_error, call.request_id)

    def _url(self, replica: ReplicaId, path: str, query: bytes) -> URL:
        if query:
            return URL(f"{self._replicas[replica].url}{path}?{query.decode('latin-1')}",
                       encoded=True)
        key = (replica, path)
        url = self._urls.get(key)
        if url is None:
            url = URL(self._replicas[replica].url + path, encoded=True)
            if len(self._urls) < 1024:
                self._urls[key] = url
        return url

    async def _attempt(self, call: _Call, replica: ReplicaId, send: Send, last: bool) -> int:
        """One upstream attempt, relayed: returns the status sent to the client, or raises
        ``_Retry`` while nothing has been sent yet."""
        outcome: Outcome = "cancelled"
        clock = self._clock
        with self._load.lease(replica, call.prompt_estimate) as lease:
            t_up = clock()
            try:
                resp = await self._session.request(
                    call.method, self._url(replica, call.path, call.query), data=call.body,
                    headers=call.headers, allow_redirects=False,
                    timeout=self._stream_timeout if call.stream else self._plain_timeout,
                )
            except TimeoutError as exc:
                raise _Retry(ReplicaTimeout(f"replica {replica} did not answer in time"),
                             "timeout") from exc
            except _CONNECT_ERRORS as exc:
                raise _Retry(ReplicaUnavailable(f"cannot reach replica {replica}: {exc}"),
                             "connect_error") from exc
            status = resp.status
            counted = False
            try:
                if status >= 500 and not last:
                    raise _Retry(ReplicaUnavailable(f"replica {replica} answered {status}"),
                                 "http_5xx")
                if call.endpoint != "other" and not (call.stream and status == 200):
                    # A chat/completions JSON answer (or an error): read whole, for usage.
                    try:
                        body = await resp.read()
                    except TimeoutError as exc:
                        raise _Retry(ReplicaTimeout(f"replica {replica} did not answer in "
                                                    "time"), "timeout") from exc
                    except (aiohttp.ClientError, OSError) as exc:
                        raise _Retry(ReplicaUnavailable(f"replica {replica} failed: {exc!r}"),
                                     "connect_error") from exc
                    self._first_byte(call, replica, lease, clock() - t_up)
                    if status == 200:
                        (call.prompt_tokens, call.cached_tokens,
                         call.completion_tokens) = usage_of_body(body)
                        call.receipt_ok = True
                    call.done = True
                    await send({"type": "http.response.start", "status": status,
                                "headers": self._headers(call, replica, resp, len(body))})
                    await send({"type": "http.response.body", "body": body})
                    outcome = "ok"
                    return status
                # A stream (or any /v1/* passthrough): relayed chunk by chunk from the first.
                try:
                    chunk = await resp.content.readany()
                except TimeoutError as exc:
                    raise _Retry(ReplicaTimeout(f"replica {replica} sent no data in time"),
                                 "timeout") from exc
                except (aiohttp.ClientError, OSError) as exc:
                    raise _Retry(ReplicaUnavailable(f"replica {replica} failed: {exc!r}"),
                                 "connect_error") from exc
                self._first_byte(call, replica, lease, clock() - t_up)
                tap = UsageTap(strip=call.tap_strip) if call.stream else None
                await send({"type": "http.response.start", "status": status,
                            "headers": self._headers(call, replica, resp, None)})
                outcome = await _pump(call, resp, chunk, tap, send)
                if tap is not None:
                    call.prompt_tokens, call.cached_tokens = tap.prompt_tokens, tap.cached_tokens
                    call.completion_tokens = tap.completion_tokens
                    call.receipt_ok = outcome == "ok"
                return status
            except _Retry:
                counted = True  # the caller counts it
                raise
            finally:
                resp.release()
                if not counted:
                    if outcome == "ok" and status >= 400:
                        outcome = "http_5xx" if status >= 500 else "http_4xx"
                    self._metrics.upstream_requests.labels(replica, outcome).inc()

    def _headers(self, call: _Call, replica: ReplicaId, resp: aiohttp.ClientResponse,
                 length: int | None) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in resp.raw_headers if k.lower() not in _RESP_HOP]
        if length is not None:
            headers.append((b"content-length", b"%d" % length))
        headers.append((b"x-request-id", call.request_id.encode("latin-1")))
        headers.append((b"x-kvroute-replica", self._b(replica)))
        decision: Decision = call.decision
        headers.append((b"x-kvroute-reason", self._b(decision.reason)))
        if decision.predicted_cached_tokens is not None:
            headers.append((b"x-kvroute-predicted-cached-tokens",
                            b"%d" % decision.predicted_cached_tokens))
        return headers

    def _first_byte(self, call: _Call, replica: ReplicaId, lease: Lease, ttfb: float) -> None:
        lease.first_byte()
        call.ttfb_s = ttfb
        self._metrics.ttfb.labels(replica).observe(ttfb)


async def _watch(call: _Call, receive: Receive, task: asyncio.Task[Any]) -> None:
    """Wait for ``http.disconnect``; cancel the handler's task if the response is not done.
    Owned by the handler, which cancels it in its ``finally``."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not call.done:
                call.gone = True
                task.cancel()
            return


async def _pump(call: _Call, resp: aiohttp.ClientResponse, chunk: bytes,
                tap: UsageTap | None, send: Send) -> Outcome:
    """Relay ``chunk`` and every later one; end the body (with an SSE error event if
    the upstream fails after the first byte)."""
    content = resp.content
    try:
        while chunk:
            out = tap.feed(chunk) if tap is not None else chunk
            if content.at_eof():  # the last chunk: end the body in the same write
                call.done = True
                tail = tap.flush() if tap is not None else b""
                await send({"type": "http.response.body", "body": out + tail})
                return "ok"
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
            chunk = await content.readany()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        code = "replica_timeout" if isinstance(exc, asyncio.TimeoutError) else "replica_failed"
        _log.warning("request %s: replica failed mid-stream: %r", call.request_id, exc)
        call.done = True
        tail = (tap.flush() if tap is not None else b"")
        await send({"type": "http.response.body",
                    "body": tail + sse_error_event(f"upstream failed mid-stream: {exc!r}",
                                                   code)})
        return "midstream_error"
    call.done = True
    tail = tap.flush() if tap is not None else b""
    await send({"type": "http.response.body", "body": tail})
    return "ok"


_STATUS_TEXT = {code: str(code) for code in range(100, 600)}


def _status_text(status: int) -> str:
    return _STATUS_TEXT.get(status) or str(status)


def _user(parsed: Mapping[str, Any] | None) -> str | None:
    if parsed is None:
        return None
    user = parsed.get("user")
    return user if isinstance(user, str) else None


async def _send_error(send: Send, exc: RouterError, request_id: str) -> int:
    resp = to_response(exc)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(resp.body)).encode()),
               (b"x-request-id", request_id.encode("latin-1")), *resp.headers]
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    await send({"type": "http.response.body", "body": resp.body})
    return resp.status

