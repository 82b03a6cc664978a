"""Per-tenant admission: a concurrency cap and a token-bucket request rate.

``TenantGate.admit(tenant)`` runs before the request body is read.  It checks the
concurrency cap first (a refused request then takes no token), then the bucket:
``requests_per_s`` tokens per second up to ``burst`` (default ``requests_per_s`` rounded
up, at least 1), one per request.  Past either limit it raises ``RateLimited`` (429) with
``Retry-After``: the whole seconds until a token is back for the rate, 1 for the cap.
An admitted request holds its slot until ``release(tenant)``, which the proxy calls in
``finally`` (disconnect, cancel and error included).

Every outcome is counted in ``router_tenant_requests_total{tenant,outcome}``, and the
slots held are ``router_tenant_inflight_requests{tenant}``; the label values are the
configured tenant names only, created at start-up (a bounded set).  No locks: the gate
never awaits, so each call is atomic on the event loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

from router.errors import RateLimited
from router.metrics import TENANT_OUTCOMES, TenantMetrics

__all__ = ["LimitedTenant", "TenantGate", "TokenBucket"]


class LimitedTenant(Protocol):
    """What the gate reads of a tenant (``router.tenancy.Tenant`` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def max_concurrency(self) -> int: ...
    @property
    def requests_per_s(self) -> float: ...
    @property
    def burst(self) -> int: ...


class TokenBucket:
    """``rate`` tokens per second, at most ``capacity`` stored; starts full."""

    __slots__ = ("rate", "capacity", "tokens", "stamp")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.tokens = capacity
        self.stamp = now

    def take(self, now: float) -> float:
        """Take one token: 0.0 if there was one, else the seconds until there is."""
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class TenantGate:
    """The limits of every configured tenant."""

    def __init__(self, tenants: Sequence[LimitedTenant], *, metrics: TenantMetrics,
                 clock: Callable[[], float]) -> None:
        self._clock = clock
        self._metrics = metrics
        now = clock()
        self._buckets: dict[str, TokenBucket] = {}
        self._inflight: dict[str, int] = {}
        for t in tenants:
            self._inflight[t.name] = 0
            if t.requests_per_s > 0:
                capacity = t.burst or max(1, math.ceil(t.requests_per_s))
                self._buckets[t.name] = TokenBucket(t.requests_per_s, capacity, now)
            metrics.inflight.labels(t.name).set(0)
            for outcome in TENANT_OUTCOMES:
                metrics.requests.labels(t.name, outcome)

    def admit(self, tenant: LimitedTenant) -> None:
        """Take a slot for one request of ``tenant``, or raise ``RateLimited``."""
        name = tenant.name
        held = self._inflight[name]
        requests = self._metrics.requests
        if tenant.max_concurrency and held >= tenant.max_concurrency:
            requests.labels(name, "concurrency_limited").inc()
            raise RateLimited(
                f"Too many concurrent requests for tenant {name!r} "
                f"(limit {tenant.max_concurrency}).", retry_after_s=1)
        bucket = self._buckets.get(name)
        if bucket is not None:
            wait = bucket.take(self._clock())
            if wait > 0:
                requests.labels(name, "rate_limited").inc()
                raise RateLimited(
                    f"Rate limit reached for tenant {name!r} "
                    f"({tenant.requests_per_s:g} requests per second).",
                    retry_after_s=max(1, math.ceil(wait)))
        self._inflight[name] = held + 1
        requests.labels(name, "admitted").inc()
        self._metrics.inflight.labels(name).inc()

    def release(self, tenant: LimitedTenant) -> None:
        """Give back the slot ``admit`` took."""
        self._inflight[tenant.name] -= 1
        self._metrics.inflight.labels(tenant.name).dec()

    def inflight(self, tenant: LimitedTenant) -> int:
        """Slots ``tenant`` holds now."""
        return self._inflight[tenant.name]
