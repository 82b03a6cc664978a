"""The KV stack, built in one place for ``kvroute serve`` and ``kvroute indexer``.

``open_kv_stack`` builds, in order: the index (``memory`` or ``redis`` per
``settings.index``, wrapped in ``InstrumentedIndex`` so lookups and writes are timed),
the namespace check, the per-replica block gauges (one owned task), and the KV-event
ingestion for every source ``source_specs`` finds (one owned task).  Exiting cancels and
awaits those tasks, then closes the index and unregisters its series.

With a Redis index, ingestion runs under per-source leases (``index.lease``): any number
of routers and ``kvroute indexer`` processes may run it, exactly one applies each
replica's events, the others stand by and read the owner's ``SourceStatus`` from Redis.
With the in-memory index every router ingests everything itself (no lease).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp
    from prometheus_client import CollectorRegistry

    from index.ingestion import KVEventIngestion, SourceSpec
    from index.status import SourceStatus
    from index.store import KVIndex
    from index.subscriber import IngestObserver
    from kvkeys.types import ReplicaId
    from router.config import IndexSettings, RouterSettings
    from router.index_metrics import IndexMetrics, InstrumentedIndex

__all__ = [
    "KvStack",
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


@dataclass(slots=True)
class KvStack:
    """What ``open_kv_stack`` yields: the instrumented index, its series, and the
    ingestion (``None`` when no replica has KV events to ingest)."""

    index: InstrumentedIndex
    metrics: IndexMetrics
    ingestion: KVEventIngestion | None
    specs: list[SourceSpec]

    def status(self, replica: ReplicaId) -> SourceStatus | None:
        """The event-source snapshot of ``replica``, if it has a source."""
        return self.ingestion.status(replica) if self.ingestion is not None else None


@asynccontextmanager
async def open_kv_stack(
    settings: RouterSettings,
    registry: CollectorRegistry,
    *,
    http: aiohttp.ClientSession | None = None,
    specs: list[SourceSpec] | None = None,
    observer: IngestObserver | None = None,
    gauge_replicas: Callable[[], Collection[ReplicaId]] | None = None,
    lease_ttl_s: float = 10.0,
    lease_owner: str | None = None,
) -> AsyncIterator[KvStack]:
    """Build and run the KV stack while the context is open (see the module docstring).

    The ``router_index_*`` and ``router_kv_events_*`` series go on ``registry`` and are
    unregistered on exit.  ``specs`` defaults to ``source_specs(settings)``; ``observer``
    sees every applied batch besides those series; ``gauge_replicas`` lists the replicas
    whose block counts are kept as gauges (default: the ingested sources)."""
    from aio.task_owner import TaskOwner
    from index.ingestion import KVEventIngestion, LeaseSettings
    from index.redis_store import RedisIndex
    from router.index_metrics import FanOutObserver, IndexMetrics, keep_block_gauges

    metrics = IndexMetrics(registry)
    index = instrumented_index(settings.index, metrics)
    specs = source_specs(settings) if specs is None else specs
    ingestion: KVEventIngestion | None = None
    try:
        await check_index(index)
        async with TaskOwner() as tasks:
            if specs:
                lease = None
                if isinstance(index.inner, RedisIndex):
                    kwargs: dict[str, Any] = {"ttl_s": lease_ttl_s, "key_prefix": index.inner.ns}
                    if lease_owner is not None:
                        kwargs["owner"] = lease_owner
                    lease = LeaseSettings(index.inner.client, **kwargs)
                events = metrics.observer()
                ingestion = KVEventIngestion(
                    index, specs, http=http, lease=lease,
                    observer=FanOutObserver(observer, events) if observer else events,
                )  # fmt: skip
                metrics.watch_sources(ingestion.statuses, ingestion.health)
                tasks.spawn(ingestion.run(), name="kv-events")
            sources = ingestion.sources if ingestion is not None else {}
            replicas = gauge_replicas or (lambda: list(sources))
            tasks.spawn(keep_block_gauges(index, metrics, replicas), name="kv-index-gauges")
            yield KvStack(index, metrics, ingestion, specs)
    finally:
        try:
            await index.aclose()
        finally:
            metrics.close()
