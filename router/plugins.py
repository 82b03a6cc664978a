"""How policies and services plug into the router without touching the proxy.

Two extension points, both handed to ``create_app`` (and filled by default from
``router.builtin_plugins``, the only lists to edit when a component ships):

* **Policies.**  A ``PolicyFactory`` is ``Callable[[PolicyContext], Policy]``.  The
  ``PolicyRegistry`` builds the default policy (``settings.policy``) at start-up, and any
  other registered policy lazily, the first time a request names it in the
  ``X-KVRoute-Policy`` header.  Each policy is built once per app.

* **Services.**  A ``Service`` is a name plus ``start(ctx) -> AsyncContextManager[T]``.
  The lifespan enters every service, in order, in its ``AsyncExitStack`` before any policy
  is built, and stores what it yields in ``ctx.services[name]``; teardown runs in reverse.
  A service that needs a background task spawns it on ``ctx.tasks`` (cancelled on
  shutdown) or runs its own ``TaskGroup`` inside its context manager.

How a component drops in (no proxy change): write a factory (and, if it needs one, a
service), then add one line to each list in ``router.builtin_plugins``, which is where
``kvroute serve`` gets its lists; the ``kv`` and ``session`` policies and the ``kv``
service (``router.kv_services``) are built that way.

Tests pass their own ``policy_factories=`` / ``services=`` to ``create_app``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from aio.task_owner import TaskOwner
from router.config import RouterSettings
from router.errors import UnknownPolicy
from router.load import LoadTracker
from router.metrics import RouterMetrics
from router.policy import Policy
from router.replica_registry import ReplicaRegistry
from router.worker_peers import WorkerPeers

__all__ = [
    "PolicyContext",
    "PolicyFactory",
    "PolicyRegistry",
    "Service",
]


@dataclass(slots=True)
class PolicyContext:
    """What a policy factory or a service may use; built once in the lifespan."""

    settings: RouterSettings
    replicas: ReplicaRegistry
    load: LoadTracker
    metrics: RouterMetrics
    http: aiohttp.ClientSession
    """The shared upstream client (for services that call replicas over HTTP)."""
    tasks: TaskOwner
    """Owner for background tasks; everything spawned here is cancelled on shutdown."""
    clock: Callable[[], float]
    rng: random.Random
    services: dict[str, Any] = field(default_factory=dict)
    """What each started ``Service`` yielded, by service name."""
    peers: WorkerPeers | None = None
    """The other workers of ``kvroute serve --workers N`` (``None``: one process)."""


PolicyFactory = Callable[[PolicyContext], Policy]
"""Builds one policy from the app's context."""


@dataclass(frozen=True, slots=True)
class Service:
    """A component started in the lifespan before the policies (e.g. a KV index)."""

    name: str
    start: Callable[[PolicyContext], AbstractAsyncContextManager[Any]]


class PolicyRegistry:
    """Name -> policy, built on first use; the default one is built eagerly."""

    def __init__(
        self, factories: Mapping[str, PolicyFactory], ctx: PolicyContext, default: str
    ) -> None:
        self._factories = dict(factories)
        self._ctx = ctx
        self._built: dict[str, Policy] = {}
        self.default = self.get(default)

    @property
    def names(self) -> Sequence[str]:
        """Every registered policy name."""
        return sorted(self._factories)

    def get(self, name: str) -> Policy:
        """The policy registered as ``name`` (raises ``UnknownPolicy``)."""
        policy = self._built.get(name)
        if policy is not None:
            return policy
        factory = self._factories.get(name)
        if factory is None:
            raise UnknownPolicy(
                f"unknown routing policy {name!r}; registered: {', '.join(self.names)}"
            )
        policy = self._built[name] = factory(self._ctx)
        return policy
