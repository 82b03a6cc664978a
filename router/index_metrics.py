"""Metrics of the KV index and of KV event ingestion, on an injected registry.

* ``InstrumentedIndex(inner, metrics)`` is a ``KVIndex`` that times every lookup and
  write and counts ``IndexUnavailable`` (then re-raises it: the caller falls back).
* ``IndexMetrics.observer()`` is the ``index.subscriber.IngestObserver`` handed to
  ``KVEventIngestion``: events applied by type, blocks, gaps, drops, resyncs.
* ``IndexMetrics.watch_sources(statuses)`` exports each source's ``SourceStatus`` at
  scrape time (receive lag, last sequence, connected), and ``set_blocks`` the per-replica
  block counts (``refresh_block_gauges`` reads them from any backend;
  ``keep_block_gauges`` does so periodically until cancelled, skipping a down backend).
* ``FanOutObserver(*observers)`` hands every ingestion callback to each observer in turn
  (``KVEventIngestion`` takes one observer: the router adds these metrics to its own).

Series (labels are replica ids from the configuration, or small enums):

=============================================  =========  ================================
``router_index_lookup_seconds``                histogram  one ``lookup`` (``backend``)
``router_index_write_seconds``                 histogram  one ``apply`` (an event batch)
``router_index_unavailable_total{op}``         counter    ``lookup`` / ``write`` / ``read``
``router_index_blocks{replica}``               gauge      request keys held (any tier)
``router_kv_events_applied_total{replica,type}``  counter  events, by vLLM type
``router_kv_events_blocks_total{replica,op}``  counter    blocks ``stored`` / ``removed``
``router_kv_events_gaps_total{replica}``       counter    sequence gaps (replayed)
``router_kv_events_dropped_total{replica,reason}``  counter  events or batches not applied
``router_kv_events_resyncs_total{replica,reason}``  counter  clears for a rebuild
``router_kv_events_receive_lag_seconds{replica}``  gauge  engine stamp -> received
``router_kv_events_last_seq{replica}``         gauge      last applied sequence number
``router_kv_events_connected{replica}``        gauge      1 while the stream is connected
=============================================  =========  ================================
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from index.event_applier import BatchResult
from index.status import SourceStatus
from index.store import IndexOp, IndexUnavailable, KVIndex
from kvkeys.types import EngineKey, Medium, PrefixHits, ReplicaId, RequestKey

if TYPE_CHECKING:
    from index.subscriber import IngestObserver

__all__ = [
    "FanOutObserver",
    "IndexMetrics",
    "InstrumentedIndex",
    "keep_block_gauges",
    "refresh_block_gauges",
]

T = TypeVar("T")

_LOOKUP_BUCKETS = (0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)
_WRITE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


class _Observer:
    def __init__(self, m: IndexMetrics) -> None:
        self._m = m

    def batch_applied(self, replica: ReplicaId, result: BatchResult) -> None:
        m = self._m
        for kind, n in result.applied.items():
            m.events_applied.labels(replica, kind).inc(n)
        if result.blocks_stored:
            m.event_blocks.labels(replica, "stored").inc(result.blocks_stored)
        if result.blocks_removed:
            m.event_blocks.labels(replica, "removed").inc(result.blocks_removed)
        for reason, n in result.dropped.items():
            m.events_dropped.labels(replica, reason).inc(n)

    def gap(self, replica: ReplicaId) -> None:
        self._m.gaps.labels(replica).inc()

    def dropped(self, replica: ReplicaId, reason: str, count: int = 1) -> None:
        self._m.events_dropped.labels(replica, reason).inc(count)

    def resync(self, replica: ReplicaId, reason: str) -> None:
        self._m.resyncs.labels(replica, reason).inc()


class FanOutObserver:
    """An ``IngestObserver`` that forwards every call to ``observers``, in order."""

    def __init__(self, *observers: IngestObserver) -> None:
        self._observers = observers

    def batch_applied(self, replica: ReplicaId, result: BatchResult) -> None:
        for obs in self._observers:
            obs.batch_applied(replica, result)

    def gap(self, replica: ReplicaId) -> None:
        for obs in self._observers:
            obs.gap(replica)

    def dropped(self, replica: ReplicaId, reason: str, count: int = 1) -> None:
        for obs in self._observers:
            obs.dropped(replica, reason, count)

    def resync(self, replica: ReplicaId, reason: str) -> None:
        for obs in self._observers:
            obs.resync(replica, reason)


class _SourceCollector:
    def __init__(self, statuses: Callable[[], Mapping[ReplicaId, SourceStatus]]) -> None:
        self._statuses = statuses

    def collect(self) -> Iterator[Metric]:
        lag = GaugeMetricFamily(
            "router_kv_events_receive_lag_seconds",
            "Delay from the engine stamping the last applied batch to receiving it.",
            labels=["replica"],
        )
        seq = GaugeMetricFamily(
            "router_kv_events_last_seq", "Last applied KV event sequence number.",
            labels=["replica"],
        )  # fmt: skip
        conn = GaugeMetricFamily(
            "router_kv_events_connected", "1 while the replica's event stream is connected.",
            labels=["replica"],
        )  # fmt: skip
        for rid, st in sorted(self._statuses().items()):
            if st.receive_lag_s is not None:
                lag.add_metric([rid], st.receive_lag_s)
            if st.last_seq is not None:
                seq.add_metric([rid], st.last_seq)
            conn.add_metric([rid], 1.0 if st.connected else 0.0)
        yield lag
        yield seq
        yield conn


class IndexMetrics:
    """Every index and ingestion series, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self.lookup_seconds = Histogram(
            "router_index_lookup_seconds", "One KV index lookup.", ["backend"],
            buckets=_LOOKUP_BUCKETS, registry=registry,
        )  # fmt: skip
        self.write_seconds = Histogram(
            "router_index_write_seconds", "One KV index write (an event batch).", ["backend"],
            buckets=_WRITE_BUCKETS, registry=registry,
        )  # fmt: skip
        self.unavailable = Counter(
            "router_index_unavailable_total",
            "KV index operations that failed because the backend was unreachable.",
            ["op"], registry=registry,
        )  # fmt: skip
        self.blocks = Gauge(
            "router_index_blocks", "Blocks the index holds per replica (any tier).",
            ["replica"], registry=registry,
        )  # fmt: skip
        self.events_applied = Counter(
            "router_kv_events_applied_total", "KV events applied, by vLLM event type.",
            ["replica", "type"], registry=registry,
        )  # fmt: skip
        self.event_blocks = Counter(
            "router_kv_events_blocks_total", "Blocks stored or removed by applied KV events.",
            ["replica", "op"], registry=registry,
        )  # fmt: skip
        self.gaps = Counter(
            "router_kv_events_gaps_total", "KV event sequence gaps (filled by replay).",
            ["replica"], registry=registry,
        )  # fmt: skip
        self.events_dropped = Counter(
            "router_kv_events_dropped_total",
            "KV events or batches not applied (undecodable, unknown_parent, index down, ...).",
            ["replica", "reason"], registry=registry,
        )  # fmt: skip
        self.resyncs = Counter(
            "router_kv_events_resyncs_total",
            "Times a replica's index entries were cleared and rebuilt, by cause.",
            ["replica", "reason"], registry=registry,
        )  # fmt: skip
        self._collectors: list[_SourceCollector] = []

    def observer(self) -> _Observer:
        """The ingestion observer feeding the ``router_kv_events_*`` counters."""
        return _Observer(self)

    def watch_sources(self, statuses: Callable[[], Mapping[ReplicaId, SourceStatus]]) -> None:
        """Export the sources' status gauges, read at scrape time."""
        collector = _SourceCollector(statuses)
        self._registry.register(collector)  # type: ignore[arg-type]
        self._collectors.append(collector)

    def set_blocks(self, replica: ReplicaId, blocks: int) -> None:
        """Update ``router_index_blocks{replica}``."""
        self.blocks.labels(replica).set(blocks)

    def close(self) -> None:
        """Unregister everything (so an app can be rebuilt on the same registry)."""
        for series in (
            self.lookup_seconds, self.write_seconds, self.unavailable, self.blocks,
            self.events_applied, self.event_blocks, self.gaps, self.events_dropped,
            self.resyncs, *self._collectors,
        ):  # fmt: skip
            self._registry.unregister(series)  # type: ignore[arg-type]
        self._collectors.clear()


class InstrumentedIndex:
    """A ``KVIndex`` that records ``IndexMetrics`` around another one."""

    def __init__(
        self,
        inner: KVIndex,
        metrics: IndexMetrics,
        *,
        backend: str = "memory",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.inner = inner
        self._m = metrics
        self._clock = clock
        self._lookup = metrics.lookup_seconds.labels(backend)
        self._write = metrics.write_seconds.labels(backend)

    async def lookup(
        self, keys: Sequence[RequestKey], *, among: Collection[ReplicaId] | None = None
    ) -> PrefixHits:
        """Timed ``lookup``; ``IndexUnavailable`` is counted and re-raised."""
        t0 = self._clock()
        try:
            return await self.inner.lookup(keys, among=among)
        except IndexUnavailable:
            self._m.unavailable.labels("lookup").inc()
            raise
        finally:
            self._lookup.observe(self._clock() - t0)

    async def apply(self, replica: ReplicaId, ops: Sequence[IndexOp]) -> None:
        """Timed ``apply``."""
        t0 = self._clock()
        try:
            await self.inner.apply(replica, ops)
        except IndexUnavailable:
            self._m.unavailable.labels("write").inc()
            raise
        finally:
            self._write.observe(self._clock() - t0)

    async def add(
        self,
        replica: ReplicaId,
        engine_keys: Sequence[EngineKey],
        request_keys: Sequence[RequestKey],
        medium: Medium = Medium.GPU,
    ) -> None:
        """Counted ``add``."""
        await self._counted("write", self.inner.add(replica, engine_keys, request_keys, medium))

    async def add_by_engine_key(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey], medium: Medium
    ) -> int:
        """Counted ``add_by_engine_key``."""
        n: int = await self._counted(
            "write", self.inner.add_by_engine_key(replica, engine_keys, medium)
        )
        return n

    async def evict(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey], medium: Medium = Medium.GPU
    ) -> None:
        """Counted ``evict``."""
        await self._counted("write", self.inner.evict(replica, engine_keys, medium))

    async def request_key(self, replica: ReplicaId, engine_key: EngineKey) -> RequestKey | None:
        """Counted ``request_key``."""
        key: RequestKey | None = await self._counted(
            "read", self.inner.request_key(replica, engine_key)
        )
        return key

    async def request_keys(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey]
    ) -> list[RequestKey | None]:
        """Counted ``request_keys``."""
        keys: list[RequestKey | None] = await self._counted(
            "read", self.inner.request_keys(replica, engine_keys)
        )
        return keys

    async def clear(self, replica: ReplicaId) -> None:
        """Counted ``clear``."""
        await self._counted("write", self.inner.clear(replica))

    async def replicas(self) -> set[ReplicaId]:
        """Counted ``replicas``."""
        out: set[ReplicaId] = await self._counted("read", self.inner.replicas())
        return out

    async def aclose(self) -> None:
        """Close the wrapped index."""
        await self.inner.aclose()

    async def _counted(self, op: str, aw: Awaitable[T]) -> T:
        try:
            return await aw
        except IndexUnavailable:
            self._m.unavailable.labels(op).inc()
            raise


async def refresh_block_gauges(
    index: KVIndex, metrics: IndexMetrics, replicas: Collection[ReplicaId]
) -> None:
    """Set ``router_index_blocks`` from the backend (``blocks`` if it has one)."""
    blocks: Any = getattr(index, "blocks", None)
    inner = getattr(index, "inner", None)
    if blocks is None and inner is not None:
        blocks = getattr(inner, "blocks", None)
    if blocks is None:
        return
    for rid in replicas:
        value = blocks(rid)
        if hasattr(value, "__await__"):
            value = await value
        metrics.set_blocks(rid, int(value))


async def keep_block_gauges(
    index: KVIndex,
    metrics: IndexMetrics,
    replicas: Callable[[], Collection[ReplicaId]],
    *,
    interval_s: float = 5.0,
) -> None:
    """``refresh_block_gauges`` every ``interval_s`` until cancelled (the caller owns the
    task).  A refresh that finds the backend down is counted (``op="read"``) and skipped."""
    while True:
        try:
            await refresh_block_gauges(index, metrics, replicas())
        except IndexUnavailable:
            metrics.unavailable.labels("read").inc()
        await asyncio.sleep(interval_s)
