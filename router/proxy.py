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
   after a ``Backoff`` sleep; so does an answer that is not HTTP (a malformed status
   line or headers: ``bad_response``); the last 5xx is passed through, the last connect
   error, garbage answer or timeout becomes 502/504.  Connect errors and garbage
   answers count against the replica's health (``health.passive_failures``).
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
``x-kvroute-predicted-cached-tokens`` (when the decision predicts), each describing the
replica that answered: after a failover the reason is ``failover`` and the prediction
is the one for that replica (``Decision.predicted_for``).  The ``x-kvroute-*`` headers go
only to tenants allowed them.  With API keys, ``router.tenancy.Access`` runs first.

The relay itself (the request's ``Call`` state, the stream pump, the disconnect watcher)
is ``router.relay``.  Cost: the hot path is a chain of coroutine calls (``handle`` ->
``_serve`` -> ``_run`` -> ``_attempts`` -> ``_attempt`` -> ``_relay_*``) and allocates
little beyond what uvicorn and aiohttp need; the JSON parse of the body is its largest
own cost.  ``python -m bench.proxy_overhead`` measures it (router CPU per request).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Awaitable, Callable, Mapping
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
    to_response,
)
from router.load import Lease, LoadTracker
from router.metrics import Outcome, RouterMetrics
from router.plugins import PolicyRegistry
from router.policy import Decision, Endpoint, Policy, Receipt, RouteRequest
from router.relay import Call, Receive, Scope, Send, pump, watch_disconnect
from router.replica_registry import ReplicaRegistry
from router.request import (
    ClientDisconnected,
    Incoming,
    parse_body,
    read_body,
    scan_headers,
    session_key,
)
from router.tenancy import Access, Tenant
from router.usage import UsageTap, inject_include_usage, usage_of_body

__all__ = ["Proxy", "Receive", "Scope", "Send"]

_log = logging.getLogger(__name__)

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
# Bodies past this size let other requests run between being read and being parsed.
_YIELD_BEFORE_PARSE_BYTES = 1 << 20
# Failed attempts that count against the replica's health (passive health checking).
_HEALTH_FAILURES = frozenset({"connect_error", "bad_response"})


class _Retry(Exception):
    """Internal: this attempt failed before the first byte; try the next replica."""

    def __init__(self, error: UpstreamError, outcome: Outcome) -> None:
        self.error = error
        self.outcome = outcome


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
        access: Access | None = None,
    ) -> None:
        self._replicas = replicas
        self._load = load
        self._metrics = metrics
        self._policies = policies
        self._session = session
        self._clock = clock
        self._limit = settings.max_body_bytes
        self._access = access
        self._forward_key = settings.auth.forwards_client_key
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
        replicas.on_membership(self._member_changed)

    def _member_changed(self, change: str, replica: ReplicaId) -> None:
        """A replica id may come back with another URL: drop its cached URLs."""
        for key in [k for k in self._urls if k[0] == replica]:
            del self._urls[key]

    def _latin1(self, text: str) -> bytes:
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
        access = self._access
        if access is None:
            return await self._serve(scope, receive, send, endpoint, inc, request_id, None)
        try:
            tenant = access.admit(inc.authorization)
        except RouterError as exc:
            return await _send_error(send, exc, request_id)
        try:
            return await self._serve(scope, receive, send, endpoint, inc, request_id, tenant)
        finally:
            access.release(tenant)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint,
                     inc: Incoming, request_id: str, tenant: Tenant | None) -> int:
        """The request past authentication and admission (``tenant``: ``None`` without keys)."""
        try:
            body = await read_body(receive, self._limit, inc.content_length)
            if len(body) > _YIELD_BEFORE_PARSE_BYTES:
                await asyncio.sleep(0)  # joining and parsing megabytes: one step each
            parsed = parse_body(endpoint, body)
            session = inc.session or _user(parsed)
            if tenant is not None:  # its cache_salt (the policy sees it too), its sessions
                body, session = tenant.scope(parsed, body, session)
            model = parsed.get("model") if parsed is not None else None
            if model is not None and not isinstance(model, str):
                model = None
            route = RouteRequest(request_id, endpoint, scope["path"], model, parsed,
                                 session_key(session), inc.policy)
            policy = self._policies.get(inc.policy) if inc.policy else self._policies.default
            candidates, known = self._replicas.candidates(model)
            if not candidates:
                if not known:
                    raise UnknownModel(self._replicas.unknown_model(model))
                raise NoHealthyReplica("no healthy replica can serve this request",
                                       retry_after_s=self._retry_after)
            decision = await policy.route(route, candidates)
        except ClientDisconnected:
            self._metrics.client_disconnects.inc()
            return _CLIENT_GONE
        except RouterError as exc:
            return await _send_error(send, exc, request_id)
        self._metrics.decisions.labels(decision.policy, decision.reason).inc()
        call = self._new_call(scope, endpoint, inc, request_id, tenant, body, parsed, route,
                              decision)  # fmt: skip
        return await self._run(call, receive, send, policy)

    def _new_call(self, scope: Scope, endpoint: Endpoint, inc: Incoming, request_id: str,
                  tenant: Tenant | None, body: bytes, parsed: dict[str, Any] | None,
                  route: RouteRequest, decision: Decision) -> Call:  # fmt: skip
        """The routed request as the attempts forward it (usage asked for on streams the
        policy wants receipts of, the upstream's headers, the load estimate)."""
        stream = parsed is not None and endpoint != "other" and parsed.get("stream") is True
        strip = False
        if stream and decision.want_usage and parsed is not None:
            options = parsed.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage") is True):
                body = inject_include_usage(body, parsed)
                strip = True
        headers = inc.forward
        headers["x-request-id"] = request_id
        if not self._forward_key:
            headers.pop("authorization", None)  # the upstream key, if any, is the session's
        prompt_tokens = decision.prompt_tokens
        if prompt_tokens is None:
            prompt_tokens = len(body) // 4  # load estimate only: ~4 bytes of JSON per token
        call = Call(endpoint, scope["method"], scope["path"], scope.get("query_string", b""),
                    body, headers, stream, strip, request_id, route, decision, prompt_tokens)
        if tenant is not None:
            call.routing_headers = tenant.routing_headers
        _log.debug("request %s -> %s (%s/%s)", request_id, decision.replicas[0],
                   decision.policy, decision.reason)
        return call

    async def _run(self, call: Call, receive: Receive, send: Send, policy: Policy[Any]) -> int:
        """The attempts under the disconnect watcher, then the receipt to ``policy``."""
        route, decision = call.route, call.decision
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
                               decision.policy, call.request_id)

    def _start_watcher(self, call: Call, receive: Receive, task: asyncio.Task[Any]) -> None:
        if not call.done:
            assert self._loop is not None
            call.watcher = self._loop.create_task(watch_disconnect(call, receive, task))

    # ------------------------------------------------------------------ attempts
    async def _attempts(self, call: Call, send: Send) -> int:
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
                if retry.outcome in _HEALTH_FAILURES and self._passive:
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

    async def _attempt(self, call: Call, replica: ReplicaId, send: Send, last: bool) -> int:
        """One upstream attempt, relayed: returns the status sent to the client, or raises
        ``_Retry`` while nothing has been sent yet."""
        outcome: Outcome = "cancelled"
        clock = self._clock
        with self._load.lease(replica, call.prompt_estimate) as lease:
            t_up = clock()
            resp = await self._request(call, replica)
            status = resp.status
            counted = False
            try:
                if status >= 500 and not last:
                    raise _Retry(ReplicaUnavailable(f"replica {replica} answered {status}"),
                                 "http_5xx")
                if call.endpoint != "other" and not (call.stream and status == 200):
                    # A chat/completions JSON answer (or an error): read whole, for usage.
                    await self._relay_whole(call, replica, resp, lease, t_up, send)
                    outcome = "ok"
                    return status
                # A stream (or any /v1/* passthrough): relayed chunk by chunk from the first.
                outcome = await self._relay_stream(call, replica, resp, lease, t_up, send)
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

    async def _request(self, call: Call, replica: ReplicaId) -> aiohttp.ClientResponse:
        """The upstream's response (status and headers read), or ``_Retry``."""
        try:
            return await self._session.request(
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
        except aiohttp.ClientError as exc:  # not HTTP: a malformed status line, headers
            raise _Retry(ReplicaUnavailable(f"replica {replica} answered garbage: "
                                            f"{exc!r}"), "bad_response") from exc

    async def _relay_whole(self, call: Call, replica: ReplicaId, resp: aiohttp.ClientResponse,
                           lease: Lease, t_up: float, send: Send) -> None:  # fmt: skip
        """Read the whole body (``_Retry`` if that fails), take its usage, send it."""
        body = await _first_read(resp.read(), replica, "did not answer")
        self._first_byte(call, replica, lease, self._clock() - t_up)
        status = resp.status
        if status == 200:
            (call.prompt_tokens, call.cached_tokens,
             call.completion_tokens) = usage_of_body(body)
            call.receipt_ok = True
        call.done = True
        await send({"type": "http.response.start", "status": status,
                    "headers": self._headers(call, replica, resp, len(body))})
        await send({"type": "http.response.body", "body": body})

    async def _relay_stream(self, call: Call, replica: ReplicaId, resp: aiohttp.ClientResponse,
                            lease: Lease, t_up: float, send: Send) -> Outcome:  # fmt: skip
        """Relay the body chunk by chunk once its first chunk is in (``_Retry`` if that
        fails); a stream's usage is tapped on the way."""
        chunk = await _first_read(resp.content.readany(), replica, "sent no data")
        self._first_byte(call, replica, lease, self._clock() - t_up)
        tap = UsageTap(strip=call.tap_strip) if call.stream else None
        await send({"type": "http.response.start", "status": resp.status,
                    "headers": self._headers(call, replica, resp, None)})
        outcome = await pump(call, resp, chunk, tap, send)
        if tap is not None:
            call.prompt_tokens, call.cached_tokens = tap.prompt_tokens, tap.cached_tokens
            call.completion_tokens = tap.completion_tokens
            call.receipt_ok = outcome == "ok"
        return outcome

    def _headers(self, call: Call, replica: ReplicaId, resp: aiohttp.ClientResponse,
                 length: int | None) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in resp.raw_headers if k.lower() not in _RESP_HOP]
        if length is not None:
            headers.append((b"content-length", b"%d" % length))
        headers.append((b"x-request-id", call.request_id.encode("latin-1")))
        if not call.routing_headers:  # untrusted tenant: they are a cache-hit oracle
            return headers
        headers.append((b"x-kvroute-replica", self._latin1(replica)))
        decision: Decision = call.decision
        if replica == decision.replicas[0]:
            headers.append((b"x-kvroute-reason", self._latin1(decision.reason)))
            predicted = decision.predicted_cached_tokens
        else:  # a failover: describe the replica that answers, not the first choice
            headers.append((b"x-kvroute-reason", b"failover"))
            predicted = decision.predicted_for(replica)
        if predicted is not None:
            headers.append((b"x-kvroute-predicted-cached-tokens", b"%d" % predicted))
        return headers

    def _first_byte(self, call: Call, replica: ReplicaId, lease: Lease, ttfb: float) -> None:
        lease.first_byte()
        call.ttfb_s = ttfb
        self._metrics.ttfb.labels(replica).observe(ttfb)


_STATUS_TEXT = {code: str(code) for code in range(100, 600)}


async def _first_read(read: Awaitable[bytes], replica: ReplicaId, silent: str) -> bytes:
    """The upstream's first bytes; a timeout or a failure before them is a ``_Retry``
    (nothing has reached the client yet, so another replica may still answer)."""
    try:
        return await read
    except TimeoutError as exc:
        raise _Retry(ReplicaTimeout(f"replica {replica} {silent} in time"), "timeout") from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise _Retry(ReplicaUnavailable(f"replica {replica} failed: {exc!r}"),
                     "connect_error") from exc


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

