"""Active health checking of the replicas.

Every ``interval_s`` the prober sends ``GET /health`` to each replica concurrently, each
with its own ``health_probe_s`` timeout, and feeds the result to
``ReplicaRegistry.record_probe`` (which applies the hysteresis).  A 2xx is healthy;
anything else (status, connect error, timeout) is a failure.

It also reads each healthy replica's ``GET /v1/models``: right after it comes up, and
every ``models_refresh_s``.  A models failure is logged and leaves the last known list.

``probe_once()`` runs one round and is awaited at start-up, so the router knows which
replicas are up (and what they serve) before it takes traffic.  ``run()`` loops forever;
it is owned and cancelled by the app's ``TaskOwner``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
import orjson

from kvkeys.types import ReplicaId
from router.config import HealthSettings
from router.metrics import RouterMetrics
from router.replica_registry import ReplicaRegistry

__all__ = ["HealthProber"]

_log = logging.getLogger(__name__)


class HealthProber:
    """Probes replicas and updates the registry."""

    def __init__(
        self,
        replicas: ReplicaRegistry,
        session: aiohttp.ClientSession,
        settings: HealthSettings,
        *,
        probe_timeout_s: float,
        metrics: RouterMetrics,
        clock: Callable[[], float],
    ) -> None:
        self._replicas = replicas
        self._session = session
        self._settings = settings
        self._timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
        self._metrics = metrics
        self._clock = clock
        self._models_read_at: dict[ReplicaId, float] = {}

    async def run(self) -> None:
        """Probe forever, one round every ``interval_s``."""
        while True:
            await asyncio.sleep(self._settings.interval_s)
            await self.probe_once()

    async def probe_once(self) -> None:
        """One concurrent probe round over every replica."""
        await asyncio.gather(*(self._probe(r) for r in self._replicas.ids))

    async def _probe(self, replica: ReplicaId) -> None:
        state = self._replicas[replica]
        ok = False
        try:
            async with self._session.get(state.url + "/health", timeout=self._timeout) as resp:
                await resp.read()
                ok = 200 <= resp.status < 300
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            _log.debug("health probe of %s failed: %r", replica, exc)
        self._metrics.health_probes.labels(replica, "ok" if ok else "fail").inc()
        changed = self._replicas.record_probe(replica, ok)
        if changed is not None:
            self._metrics.health_transitions.labels(replica, "up" if changed else "down").inc()
            _log.warning("replica %s is now %s", replica, "up" if changed else "down")
        if not state.healthy or state.static_models:
            return
        last = self._models_read_at.get(replica)
        now = self._clock()
        if changed or last is None or now - last >= self._settings.models_refresh_s:
            await self._read_models(replica)

    async def _read_models(self, replica: ReplicaId) -> None:
        state = self._replicas[replica]
        try:
            async with self._session.get(state.url + "/v1/models", timeout=self._timeout) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise ValueError(f"status {resp.status}")
            data = orjson.loads(body)["data"]
            if not isinstance(data, list):
                raise ValueError("'data' is not a list")
            cards = [c for c in data if isinstance(c, dict) and "id" in c]
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError, TypeError) as exc:
            _log.warning("reading /v1/models of %s failed: %s", replica, exc)
            return
        self._replicas.set_models(replica, cards)
        self._models_read_at[replica] = self._clock()
