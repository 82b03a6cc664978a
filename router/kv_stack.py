"""The KV stack, built in one place for ``kvroute serve`` and ``kvroute indexer``.

``open_kv_stack`` builds, in order: the index (``memory`` or ``redis`` per
``settings.index``, wrapped in ``InstrumentedIndex`` so lookups and writes are timed),
the namespace check, the KV-event ingestion (``router.kv_members``: one supervised task
per replica) and the per-replica block gauges (one supervised task).  ``kvroute indexer``
ingests the fixed list ``source_specs`` finds; ``kvroute serve`` passes its fleet
(``Membership``), whose replicas are ingested as they join and cleared as they leave.
Exiting cancels and awaits those tasks, then closes the index and unregisters its series.

With a Redis index, ingestion runs under per-source leases (``index.lease``): any number
of routers and ``kvroute indexer`` processes may run it, exactly one applies each
replica's events, the others stand by and read the owner's ``SourceStatus`` from Redis.
With the in-memory index every router ingests everything itself (no lease).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp

    from aio.task_owner import TaskOwner
    from index.ingestion import SourceSpec
    from index.status import SourceStatus
    from index.store import KVIndex
    from index.subscriber import IngestObserver
    from kvkeys.types import ReplicaId
    from router.config import IndexSettings, RouterSettings
    from router.index_metrics import IndexMetrics, InstrumentedIndex
    from router.kv_members import MemberIngestion

__all__ = [
    "KvStack",
    "Membership",
    "check_index",
    "instrumented_index",
    "make_index",
    "open_kv_stack",
    "source_specs",
]

_log = logging.getLogger(__name__)


def make_index(settings: IndexSettings) -> KVIndex:
    """The configured backend (not instrumented; wrap it in ``InstrumentedIndex``)."""
    from index.memory import InMemoryIndex
    from index.redis_store import RedisIndex

    if settings.backend == "redis":
        return RedisIndex.from_url(
            settings.url, key_prefix=settings.key_prefix, op_timeout_s=settings.op_timeout_s
        )
    return InMemoryIndex()


async def check_index(index: KVIndex) -> None:
    """Refuse to start on a Redis namespace this version cannot share (another
    ``max_replicas`` or key layout): ``ConfigError`` naming it.  An unreachable Redis
    does not stop start-up (the router degrades, and the first write checks again)."""
    from index.redis_store import RedisIndex
    from index.store import IndexUnavailable
    from router.config import ConfigError

    inner = getattr(index, "inner", index)
    if not isinstance(inner, RedisIndex):
        return
    try:
        await inner.check_namespace()
    except IndexUnavailable as exc:
        _log.warning(
            "redis index not reachable at start-up (%s); its namespace is checked on the "
            "first write", exc)  # fmt: skip
    except ValueError as exc:
        raise ConfigError(f"invalid kvroute configuration:\n  index: {exc}") from exc


def instrumented_index(settings: IndexSettings, metrics: IndexMetrics) -> InstrumentedIndex:
    """The configured backend wrapped so it records ``metrics`` (``backend`` label)."""
    from router.index_metrics import InstrumentedIndex

    return InstrumentedIndex(make_index(settings), metrics, backend=settings.backend)


def source_specs(
    settings: RouterSettings,
    discovered_models: Callable[[ReplicaId], Sequence[str] | None] | None = None,
) -> list[SourceSpec]:
    """One ``SourceSpec`` per configured replica whose KV events can be found.

    A replica without ``kv_events_endpoint`` is included only with
    ``scoring.discover_kv_events`` (its streams are found at ``/kv_event_sources``).  The
    key root (model) is the replica's first configured model, else the first model under
    ``scoring.models``, else what ``discovered_models`` reports (the router's health
    prober reads ``/v1/models``), else ``None``: ingestion then asks the replica.
    """
    from index.ingestion import SourceSpec
    from kvkeys.types import ReplicaId

    scoring = settings.scoring
    default_model = scoring.models[0].name if scoring.models else None
    specs = []
    for r in settings.replicas:
        if r.kv_events_endpoint is None and not scoring.discover_kv_events:
            continue
        replica = ReplicaId(r.id)
        model = r.models[0] if r.models else default_model
        if model is None and discovered_models is not None:
            discovered = discovered_models(replica)
            model = discovered[0] if discovered else None
        specs.append(SourceSpec(replica, model=model, url=r.url,
                                endpoint=r.kv_events_endpoint,
                                replay_endpoint=r.replay_endpoint))  # fmt: skip
    return specs


@dataclass(frozen=True, slots=True)
class Membership:
    """A fleet whose members change (``kvroute serve``): ``members()`` lists the replicas
    now, ``spec_of`` gives a replica's event source (``None``: not ingested), and
    ``subscribe`` registers a callback called with ``("added" | "removed", replica)``."""

    members: Callable[[], Iterable[ReplicaId]]
    spec_of: Callable[[ReplicaId], SourceSpec | None]
    subscribe: Callable[[Callable[[str, ReplicaId], None]], object]


@dataclass(slots=True)
class KvStack:
    """What ``open_kv_stack`` yields: the instrumented index, its series, the ingestion
    (one run per replica) and the sources it started with."""

    index: InstrumentedIndex
    metrics: IndexMetrics
    ingestion: MemberIngestion
    specs: list[SourceSpec]

    def status(self, replica: ReplicaId) -> SourceStatus | None:
        """The event-source snapshot of ``replica``, if it has a source."""
        return self.ingestion.status(replica)


@asynccontextmanager
async def open_kv_stack(
    settings: RouterSettings,
    metrics: IndexMetrics,
    *,
    tasks: TaskOwner | None = None,
    http: aiohttp.ClientSession | None = None,
    specs: list[SourceSpec] | None = None,
    membership: Membership | None = None,
    observers: Sequence[IngestObserver] = (),
    gauge_replicas: Callable[[], Collection[ReplicaId]] | None = None,
    lease_ttl_s: float = 10.0,
    lease_owner: str | None = None,
) -> AsyncIterator[KvStack]:
    """Build and run the KV stack while the context is open (see the module docstring).

    ``metrics`` (the ``router_index_*`` and ``router_kv_events_*`` series) is handed over:
    closed on exit.  The ingestion's and gauges' tasks are owned by ``tasks`` (default: an
    owner of the stack's own).  The sources are ``specs`` (default ``source_specs(settings)``)
    or, with ``membership``, its members' (read once the index is checked), followed as
    replicas join and leave.  ``observers`` see every applied batch besides the series;
    ``gauge_replicas`` lists the replicas whose block counts are kept as gauges (default:
    the ingested sources)."""
    from contextlib import AsyncExitStack

    from aio.task_owner import TaskOwner
    from router.index_metrics import keep_block_gauges

    index = instrumented_index(settings.index, metrics)
    try:
        await check_index(index)
        async with AsyncExitStack() as exits:
            owner = tasks if tasks is not None else await exits.enter_async_context(TaskOwner())
            ingestion = _ingestion(index, metrics, owner, http, observers, lease_ttl_s,
                                   lease_owner)  # fmt: skip
            replicas = gauge_replicas or (lambda: list(ingestion.sources))
            gauges = owner.supervise(lambda: keep_block_gauges(index, metrics, replicas),
                                     name="kv-index-gauges")  # fmt: skip
            try:
                if membership is not None:
                    specs = [sp for sp in map(membership.spec_of, membership.members())
                             if sp is not None]  # fmt: skip
                    _follow(membership, ingestion, metrics)
                elif specs is None:
                    specs = source_specs(settings)
                for spec in specs:
                    ingestion.add(spec)
                yield KvStack(index, metrics, ingestion, specs)
            finally:
                # Stop the tasks that use the index before closing it.
                gauges.cancel()
                await asyncio.gather(gauges, return_exceptions=True)
                await ingestion.aclose()
    finally:
        try:
            await index.aclose()
        finally:
            metrics.close()


def _ingestion(
    index: InstrumentedIndex,
    metrics: IndexMetrics,
    tasks: TaskOwner,
    http: aiohttp.ClientSession | None,
    observers: Sequence[IngestObserver],
    lease_ttl_s: float,
    lease_owner: str | None,
) -> MemberIngestion:
    """The per-replica ingestion, under leases with a Redis index: routers and indexers
    sharing it ingest each source once and read the others' statuses from Redis."""
    from index.ingestion import LeaseSettings
    from index.redis_store import RedisIndex
    from router.index_metrics import FanOutObserver
    from router.kv_members import MemberIngestion

    lease = None
    if isinstance(index.inner, RedisIndex):
        kwargs: dict[str, Any] = {"ttl_s": lease_ttl_s, "key_prefix": index.inner.ns}
        if lease_owner is not None:
            kwargs["owner"] = lease_owner
        lease = LeaseSettings(index.inner.client, **kwargs)
    events = metrics.observer()
    ingestion = MemberIngestion(
        index, tasks=tasks, http=http, lease=lease,
        observer=FanOutObserver(*observers, events) if observers else events,
    )  # fmt: skip
    metrics.watch_sources(ingestion.statuses, ingestion.health)
    return ingestion


def _follow(membership: Membership, ingestion: MemberIngestion, metrics: IndexMetrics) -> None:
    """Start ingesting joining replicas; stop, clear and forget leaving ones."""
    from router.series import forget_replica

    def on_change(change: str, replica: ReplicaId) -> None:
        if ingestion.closed:  # shutting down
            return
        if change == "added":
            spec = membership.spec_of(replica)
            if spec is not None:
                ingestion.add(spec)
            return
        ingestion.remove(replica, then=lambda: forget_replica([metrics], replica))

    membership.subscribe(on_change)
