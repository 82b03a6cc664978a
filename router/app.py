"""The composition root of the router: ``create_app`` builds and wires everything.

Nothing is built at import time and nothing is global.  ``create_app`` only validates the
wiring (the default policy must be registered) and returns a Starlette app; every object
is built in its lifespan, inside one ``AsyncExitStack`` (teardown in reverse order):

1. ``RouterMetrics`` on the injected ``CollectorRegistry`` (unregistered on exit);
2. ``ReplicaRegistry`` and ``LoadTracker``;
3. the shared upstream ``aiohttp.ClientSession`` (closed on exit) and a small separate one
   for health probes (so probes never queue behind proxied traffic);
4. a ``TaskOwner`` for background tasks (cancelled and awaited on exit);
5. one health round (awaited: traffic starts with known health), then the prober task;
6. the ``Service``s, in order (``ctx.services[name]``);
7. the ``Membership`` and its run-time sources (``router.membership_sources``: the
   membership file, re-read on SIGHUP and on change, and DNS names; applied once before
   traffic, then kept current by owned tasks);
8. the ``PolicyRegistry`` (default policy built now), then the ``Proxy``;
9. the admin listener (``router.admin_server``), when ``admin.enabled``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(union of the healthy replicas' models), any other ``/v1/*`` (passed through via the same
policy), ``GET /health`` (liveness), ``GET /ready`` (200 iff a replica is healthy, with
what is degraded: ``router.readiness``), ``GET /metrics``.  With API keys configured
(``router.tenancy``), ``/v1/*`` needs a key, and ``/metrics`` and ``/debug/route`` follow
``auth.metrics`` / ``auth.debug_route`` (``open``, ``trusted`` or ``disabled``); ``/health``
and ``/ready`` stay open.  Unknown paths and wrong methods (a router path such as
``/v1/chat/completions`` asked with another method too) get OpenAI-shaped JSON 404/405
errors from the router itself.  The proxy routes are raw ASGI callables (``_ProxyRoute``):
no Starlette Request/Response on the hot path.

Extending (policies, services): see ``router.plugins``.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TypedDict

import aiohttp
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aio.clock_warp import ClockWarp
from aio.task_owner import TaskOwner
from router.admin_server import serve_admin
from router.builtin_plugins import builtin_policy_factories, builtin_services
from router.config import ConfigError, RouterSettings
from router.debug import debug_route
from router.errors import RouterError, error_body, to_response
from router.health import HealthProber
from router.load import LoadTracker
from router.membership import Membership
from router.membership_sources import Resolver, run_membership
from router.metrics import RouterMetrics
from router.plugins import PolicyContext, PolicyFactory, PolicyRegistry, Service
from router.policy import Endpoint
from router.proxy import Proxy, Receive, Scope, Send
from router.readiness import TaskCollector, readiness
from router.replica_registry import ReplicaRegistry
from router.tenancy import Access, check_endpoint
from router.worker_peers import WorkerPeers

__all__ = ["State", "create_app"]


class State(TypedDict):
    """What the lifespan exposes to every request (``scope["state"]``)."""

    settings: RouterSettings
    proxy: Proxy
    replicas: ReplicaRegistry
    load: LoadTracker
    metrics: RouterMetrics
    policies: PolicyRegistry
    context: PolicyContext
    access: Access | None
    """API keys, tenants and their limits; ``None`` when no keys are configured."""
    membership: Membership


def _judgement_clock(
    clock: Callable[[], float], time_scale: float, warp: ClockWarp | None = None
) -> Callable[[], float]:
    """The clock of the policies and the proxy's timings: ``clock`` slowed down by
    ``time_scale`` wall seconds per second (``RouterSettings.time_scale``), moved forward
    with a benchmark's skipped idle time (``RouterSettings.clock_file``)."""
    if warp is not None:
        offset = warp.offset

        def warped() -> float:
            return (clock() + offset()) / time_scale

        return warped
    if time_scale == 1.0:
        return clock

    def scaled() -> float:
        return clock() / time_scale

    return scaled


def create_app(
    settings: RouterSettings,
    *,
    registry: CollectorRegistry | None = None,
    clock: Callable[[], float] = time.monotonic,
    policy_factories: Mapping[str, PolicyFactory] | None = None,
    services: Sequence[Service] | None = None,
    rng: random.Random | None = None,
    resolver: Resolver | None = None,
    sighup: bool = True,
    worker: int = 0,
    peers: WorkerPeers | None = None,
) -> Starlette:
    """The router as an ASGI app.

    ``policy_factories`` default to ``builtin_policy_factories()`` and ``services`` to
    ``builtin_services(settings)``.  ``registry`` defaults to a fresh
    ``CollectorRegistry``; ``rng`` to one seeded with ``settings.seed``.  ``resolver``
    replaces the system DNS resolver of ``membership.dns``; ``sighup=False`` leaves
    SIGHUP alone (the membership file is still re-read when it changes).  ``worker`` is
    this process's index under ``kvroute serve --workers N`` (its admin listener is on
    ``admin.port + worker``), ``peers`` where the workers meet (``router.outlook_peers``).
    """
    factories = dict(policy_factories if policy_factories is not None
                     else builtin_policy_factories())
    if settings.policy not in factories:
        raise ConfigError(
            f"invalid kvroute configuration:\n  policy: unknown policy {settings.policy!r}; "
            f"registered: {', '.join(sorted(factories))}"
        )
    service_list = list(services if services is not None else builtin_services(settings))
    prom = registry if registry is not None else CollectorRegistry(auto_describe=True)
    the_rng = rng if rng is not None else random.Random(settings.seed)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[State]:
        async with AsyncExitStack() as stack:
            metrics = RouterMetrics(prom)
            stack.callback(metrics.close)
            replicas = ReplicaRegistry(
                settings.replicas,
                fails_to_down=settings.health.fails_to_down,
                successes_to_up=settings.health.successes_to_up,
            )
            load = LoadTracker(replicas.ids)
            metrics.bind_state(replicas, load)
            session = await stack.enter_async_context(_upstream_session(settings))
            probe_session = await stack.enter_async_context(
                aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(),
                                      headers=_upstream_auth(settings))
            )
            access = (Access(settings.auth, metrics=metrics.tenants, clock=clock)
                      if settings.auth.enabled else None)
            tasks = await stack.enter_async_context(TaskOwner())
            task_metrics = TaskCollector(tasks)
            prom.register(task_metrics)  # type: ignore[arg-type]
            stack.callback(prom.unregister, task_metrics)  # type: ignore[arg-type]
            prober = HealthProber(
                replicas, probe_session, settings.health,
                probe_timeout_s=settings.timeouts.health_probe_s, metrics=metrics, clock=clock,
            )
            await prober.probe_once()
            tasks.supervise(prober.run, name="health-prober")
            warp = None
            if settings.clock_file is not None:
                warp = ClockWarp.open(settings.clock_file)
                stack.callback(warp.close)
            judge = _judgement_clock(clock, settings.time_scale, warp)
            ctx = PolicyContext(
                settings=settings, replicas=replicas, load=load, metrics=metrics,
                http=session, tasks=tasks, clock=judge, rng=the_rng, peers=peers,
            )
            for service in service_list:
                ctx.services[service.name] = await stack.enter_async_context(service.start(ctx))
            membership = await stack.enter_async_context(run_membership(
                settings, replicas, load, metrics=metrics, prober=prober, tasks=tasks,
                resolver=resolver, sighup=sighup))
            policies = PolicyRegistry(factories, ctx, settings.policy)
            proxy = Proxy(settings, replicas=replicas, load=load, metrics=metrics,
                          policies=policies, session=session, clock=judge, access=access)
            state = State(settings=settings, proxy=proxy, replicas=replicas, load=load,
                          metrics=metrics, policies=policies, context=ctx, access=access,
                          membership=membership)
            await stack.enter_async_context(serve_admin(state, worker=worker))
            yield state

    async def models(request: Request) -> Response:
        access: Access | None = request.state.access
        if access is not None:
            access.authenticate(request.headers.get("authorization"))
        replicas: ReplicaRegistry = request.state.replicas
        body = orjson.dumps({"object": "list", "data": replicas.model_cards()})
        return Response(body, media_type="application/json")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        ctx: PolicyContext = request.state.context
        status, body = readiness(settings, ctx.replicas, ctx.tasks, ctx.services,
                                 worker=worker)
        return JSONResponse(body, status_code=status)

    async def metrics_endpoint(request: Request) -> Response:
        check_endpoint(settings.auth.metrics, request.state.access,
                       request.headers.get("authorization"))
        return Response(generate_latest(prom), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: Exception) -> Response:
        # Unknown paths and wrong methods: OpenAI-shaped JSON, like every router error.
        assert isinstance(exc, HTTPException)
        return _json_error(exc.status_code, exc.detail, dict(exc.headers or {}))

    async def router_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RouterError)
        resp = to_response(exc)
        return Response(resp.body, status_code=resp.status, media_type="application/json",
                        headers={k.decode(): v.decode() for k, v in resp.headers})

    all_methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    routes = [
        Route("/v1/chat/completions", _ProxyRoute("chat"), methods=["POST"]),
        Route("/v1/completions", _ProxyRoute("completions"), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/{rest:path}", _ProxyRoute("other"), methods=all_methods),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/debug/route", debug_route, methods=["POST"]),
    ]
    return _RouterApp(routes=routes, lifespan=lifespan,
                      exception_handlers={RouterError: router_error,
                                          HTTPException: http_error})


class _RouterApp(Starlette):
    """Starlette, with the two hot routes dispatched straight to ``Proxy.handle``.

    ``POST /v1/chat/completions`` and ``POST /v1/completions`` skip Starlette's
    middleware and router layers (each wraps ``send`` and costs a few percent of the
    router's CPU per request) and the ``_ProxyRoute`` frame; the proxy answers its own
    errors, so nothing is lost.  Everything else goes through Starlette as usual.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # type: ignore[override]
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = _FAST_ROUTES.get(scope["path"])
            if endpoint is not None and "state" in scope:
                scope["app"] = self
                proxy: Proxy = scope["state"]["proxy"]
                await proxy.handle(scope, receive, send, endpoint)
                return
        await super().__call__(scope, receive, send)  # type: ignore[arg-type]


class _ProxyRoute:
    """A raw ASGI endpoint that hands the request to the app's ``Proxy``."""

    __slots__ = ("endpoint",)

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint: Endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.endpoint == "other" and scope["path"] in _OWN_PATHS:
            # A router path with another method: the router's 405, not a replica's.
            allow = _OWN_PATHS[scope["path"]]
            resp = _json_error(405, "Method Not Allowed", {"Allow": allow})
            await resp(scope, receive, send)  # type: ignore[arg-type]
            return
        proxy: Proxy = scope["state"]["proxy"]
        await proxy.handle(scope, receive, send, self.endpoint)


_FAST_ROUTES: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
}


_OWN_PATHS: dict[str, str] = {
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/v1/models": "GET",
}
"""The ``/v1`` paths the router answers itself, and the method each takes."""

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def _json_error(status: int, message: str, headers: dict[str, str]) -> Response:
    code = _HTTP_CODES.get(status, "invalid_request")
    return Response(error_body(message, "invalid_request_error", code), status_code=status,
                    media_type="application/json", headers=headers)


def _upstream_session(settings: RouterSettings) -> aiohttp.ClientSession:
    """The one shared upstream client: pooled keep-alive connections, no cookies, bytes
    passed through undecoded (``auto_decompress=False``)."""
    connector = aiohttp.TCPConnector(
        limit=settings.upstream.max_connections,
        limit_per_host=0,
        keepalive_timeout=settings.upstream.keepalive_s,
        ttl_dns_cache=300,
    )
    return aiohttp.ClientSession(
        connector=connector,
        headers=_upstream_auth(settings),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
        timeout=aiohttp.ClientTimeout(sock_connect=settings.timeouts.connect_s,
                                      sock_read=settings.timeouts.stream_read_s),
    )



def _upstream_auth(settings: RouterSettings) -> dict[str, str] | None:
    """``Authorization`` for every upstream call when ``auth.upstream_key`` is set (a
    forwarded client header, if forwarding is on, overrides it per request)."""
    key = settings.auth.upstream_key
    if key is None:
        return None
    return {"Authorization": f"Bearer {key.get_secret_value()}"}
