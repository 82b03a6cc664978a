"""Which replicas are in the fleet, from several sources, changing at run time.

Sources (``Source``): ``static`` (the ``replicas`` setting, at start), ``file`` (a YAML
file re-read on SIGHUP and when it changes), ``dns`` (names re-resolved on an interval)
and ``admin`` (the admin API).  Each source *claims* a set of replicas; the fleet is the
union of the claims, keyed by replica id (the first claim's settings win; a claim of a
known id with another URL is refused).  ``set_source(source, replicas)`` replaces one
source's claims (file and DNS send their whole list each time), ``add``/``remove`` change
one claim (the admin API).

A replica's life:

* **join** (first claim): ``ReplicaRegistry.add`` (unhealthy, no traffic), whose
  listeners start what the replica needs (KV event discovery and ingestion); a health
  probe runs at once, and the first successful one gives it traffic (models are read from
  ``/v1/models`` then, the block size comes with its events and scrapes).
* **leave** (last claim gone): ``drain``: no new requests at once (sessions move to their
  next replica on the affinity ring), the in-flight ones get ``drain_timeout_s`` to finish,
  then ``ReplicaRegistry.remove``, whose listeners stop its event subscribers and clear its
  index entries, and its per-replica metric series are dropped.  A claim that comes back
  while it drains cancels the drain.
* **restart under the same address**: still a member; its event stream's sequence going
  back to 0 (or a disconnection longer than the grace period) clears its entries
  (``index.subscriber``), so no stale prediction survives it.

Metrics: ``router_replicas{state}`` (healthy, draining, unhealthy; read at scrape time)
and ``router_membership_changes_total{source, change}`` (change: ``added``, ``removed``).

Every drain is a task of the app's ``TaskOwner``; ``aclose`` is not needed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric

from aio.task_owner import TaskOwner
from kvkeys.types import ReplicaId
from router.config import ReplicaSettings
from router.load import LoadTracker
from router.replica_registry import ReplicaRegistry

__all__ = ["Change", "Membership", "MembershipMetrics", "Source"]

_log = logging.getLogger(__name__)

Source = Literal["static", "file", "dns", "admin"]
_DRAIN_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Change:
    """What one update did to the fleet."""

    added: tuple[ReplicaId, ...] = ()
    removed: tuple[ReplicaId, ...] = ()
    refused: tuple[str, ...] = ()
    """Why some claims were refused (an id already known under another URL)."""


class MembershipMetrics:
    """``router_replicas{state}`` and ``router_membership_changes_total``."""

    def __init__(self, registry: CollectorRegistry, replicas: ReplicaRegistry) -> None:
        self.registry = registry
        self.changes = Counter(
            "router_membership_changes_total",
            "Replicas that joined or left the fleet, by source and change.",
            ["source", "change"], registry=registry,
        )
        self._states = _StateCounts(replicas)
        registry.register(self._states)

    def close(self) -> None:
        """Unregister both series."""
        self.registry.unregister(self.changes)
        self.registry.unregister(self._states)


class _StateCounts:
    def __init__(self, replicas: ReplicaRegistry) -> None:
        self._replicas = replicas

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        counts = {"healthy": 0, "draining": 0, "unhealthy": 0}
        for state in self._replicas.all():
            counts[state.member_state] += 1
        family = GaugeMetricFamily("router_replicas", "Replicas in the fleet, by state.",
                                   labels=["state"])
        for name, n in counts.items():
            family.add_metric([name], n)
        yield family


class Membership:
    """The fleet's replica set: claims by source, joins and drains."""

    def __init__(
        self,
        replicas: ReplicaRegistry,
        load: LoadTracker,
        *,
        tasks: TaskOwner,
        metrics: MembershipMetrics,
        probe: Callable[[ReplicaId], Coroutine[Any, Any, None]],
        drain_timeout_s: float,
        forget: Callable[[ReplicaId], None] = lambda r: None,
    ) -> None:
        self._replicas = replicas
        self._load = load
        self._tasks = tasks
        self._metrics = metrics
        self._probe = probe
        self._drain_timeout_s = drain_timeout_s
        self._forget = forget
        self._claims: dict[ReplicaId, dict[Source, ReplicaSettings]] = {}
        self._drains: dict[ReplicaId, asyncio.Task[Any]] = {}
        for state in replicas.all():
            if state.settings is not None:
                self._claims[state.id] = {"static": state.settings}

    # ------------------------------------------------------------------ reading

    def sources(self, replica: ReplicaId) -> tuple[Source, ...]:
        """The sources that claim ``replica`` (empty once it has left)."""
        return tuple(self._claims.get(replica, {}))

    def claimed(self, source: Source) -> list[ReplicaSettings]:
        """What ``source`` claims now."""
        return [c[source] for c in self._claims.values() if source in c]

    def draining(self) -> tuple[ReplicaId, ...]:
        """Replicas whose drain is still running."""
        return tuple(self._drains)

    async def settled(self) -> None:
        """Wait until no drain is running (tests, shutdown scripts)."""
        while self._drains:
            await asyncio.gather(*self._drains.values(), return_exceptions=True)

    # ------------------------------------------------------------------ changing

    def set_source(self, source: Source, replicas: Sequence[ReplicaSettings]) -> Change:
        """Make ``source`` claim exactly ``replicas`` (its previous claims not listed go)."""
        wanted = {ReplicaId(r.id): r for r in replicas}
        removed: list[ReplicaId] = []
        for rid in [r for r, c in self._claims.items() if source in c and r not in wanted]:
            if self._unclaim(source, rid):
                removed.append(rid)
        added, refused = self._claim_all(source, wanted.values())
        return Change(tuple(added), tuple(removed), tuple(refused))

    def add(self, source: Source, replica: ReplicaSettings) -> Change:
        """One more claim by ``source``."""
        added, refused = self._claim_all(source, [replica])
        return Change(added=tuple(added), refused=tuple(refused))

    def remove(self, source: Source, replica: ReplicaId) -> Change:
        """Drop ``source``'s claim on ``replica`` (it leaves if no other source claims it)."""
        if self._unclaim(source, replica):
            return Change(removed=(replica,))
        return Change()

    def _claim_all(self, source: Source, replicas: Iterable[ReplicaSettings]
                   ) -> tuple[list[ReplicaId], list[str]]:  # fmt: skip
        added: list[ReplicaId] = []
        refused: list[str] = []
        for rs in replicas:
            rid = ReplicaId(rs.id)
            claims = self._claims.get(rid)
            state = self._replicas.get(rid)
            if state is not None and state.url != rs.url:
                refused.append(f"replica {rid!r} is already a member with URL {state.url}")
                continue
            if claims:
                claims.setdefault(source, rs)
                continue
            self._claims[rid] = {source: rs}
            if self._join(rid, rs):
                added.append(rid)
                self._metrics.changes.labels(source, "added").inc()
        return added, refused

    def _unclaim(self, source: Source, rid: ReplicaId) -> bool:
        claims = self._claims.get(rid)
        if claims is None or source not in claims:
            return False
        del claims[source]
        if claims:
            return False
        del self._claims[rid]
        self._metrics.changes.labels(source, "removed").inc()
        self._leave(rid)
        return True

    def _join(self, rid: ReplicaId, rs: ReplicaSettings) -> bool:
        drain = self._drains.pop(rid, None)
        if drain is not None:  # came back while draining: keep it, with its state
            drain.cancel()
            self._replicas.add(rs)
            _log.info("replica %s rejoined while draining", rid)
            return True
        self._replicas.add(rs)
        _log.info("replica %s joined (%s); traffic once healthy", rid, rs.url)
        self._tasks.spawn(self._probe(rid), name=f"probe:{rid}")
        return True

    def _leave(self, rid: ReplicaId) -> None:
        if rid not in self._replicas or rid in self._drains:
            return
        self._replicas.drain(rid)
        _log.info("replica %s is leaving: draining (%d in flight)", rid,
                  self._load.in_flight(rid))
        self._drains[rid] = self._tasks.spawn(self._drain(rid), name=f"drain:{rid}")

    async def _drain(self, rid: ReplicaId) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._drain_timeout_s
        while self._load.in_flight(rid) > 0 and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        left = self._load.in_flight(rid)
        if left:
            _log.warning("replica %s: %d requests still in flight after the %.1f s drain; "
                         "removing it anyway (they run on)", rid, left, self._drain_timeout_s)
        if self._drains.get(rid) is asyncio.current_task():
            del self._drains[rid]
        self._replicas.remove(rid)
        self._forget(rid)
        _log.info("replica %s left the fleet", rid)
