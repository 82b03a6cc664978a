"""InstrumentedIndex and the ingestion observer record what they should."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Collection, Sequence

import pytest
from prometheus_client import CollectorRegistry

from index.event_applier import BatchResult
from index.memory import InMemoryIndex
from index.status import SourceStatus
from index.store import IndexUnavailable, KVIndex
from kvkeys.types import EngineKey, PrefixHits, ReplicaId, RequestKey
from router.index_metrics import (
    FanOutObserver,
    IndexMetrics,
    InstrumentedIndex,
    keep_block_gauges,
    refresh_block_gauges,
)

R = ReplicaId("r1")


class DownIndex(InMemoryIndex):
    """Fault injection: every lookup fails as an unreachable backend would."""

    async def lookup(
        self, keys: Sequence[RequestKey], *, among: Collection[ReplicaId] | None = None
    ) -> PrefixHits:
        raise IndexUnavailable("down")


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, labels)
    return 0.0 if v is None else v


async def test_instrumented_index_times_and_counts() -> None:
    reg = CollectorRegistry()
    m = IndexMetrics(reg)
    idx: KVIndex = InstrumentedIndex(InMemoryIndex(), m, backend="memory")
    await idx.add(R, [EngineKey(1)], [RequestKey(11)])
    assert (await idx.lookup([RequestKey(11)])).blocks(R) == 1
    assert await idx.request_keys(R, [EngineKey(1)]) == [RequestKey(11)]
    assert value(reg, "router_index_lookup_seconds_count", backend="memory") == 1
    await refresh_block_gauges(idx, m, [R])
    assert value(reg, "router_index_blocks", replica="r1") == 1
    down = InstrumentedIndex(DownIndex(), m, backend="memory")
    with pytest.raises(IndexUnavailable):
        await down.lookup([RequestKey(11)])
    assert value(reg, "router_index_unavailable_total", op="lookup") == 1
    assert value(reg, "router_index_lookup_seconds_count", backend="memory") == 2
    await idx.aclose()
    m.close()
    assert reg.get_sample_value("router_index_unavailable_total", {"op": "lookup"}) is None


def test_observer_and_source_gauges() -> None:
    reg = CollectorRegistry()
    m = IndexMetrics(reg)
    obs = m.observer()
    obs.batch_applied(R, BatchResult(Counter({"BlockStored": 2, "BlockRemoved": 1}), 5, 1,
                                     Counter({"unknown_parent": 1})))  # fmt: skip
    obs.gap(R)
    obs.dropped(R, "undecodable")
    obs.resync(R, "restart")
    assert value(reg, "router_kv_events_applied_total", replica="r1", type="BlockStored") == 2
    assert value(reg, "router_kv_events_blocks_total", replica="r1", op="stored") == 5
    assert value(reg, "router_kv_events_gaps_total", replica="r1") == 1
    assert value(reg, "router_kv_events_dropped_total", replica="r1", reason="undecodable") == 1
    assert value(reg, "router_kv_events_dropped_total", replica="r1", reason="unknown_parent") == 1
    assert value(reg, "router_kv_events_resyncs_total", replica="r1", reason="restart") == 1
    status = SourceStatus(R, "m", None, connected=True, last_seq=7, receive_lag_s=0.25)
    m.watch_sources(lambda: {R: status})
    assert value(reg, "router_kv_events_last_seq", replica="r1") == 7
    assert value(reg, "router_kv_events_receive_lag_seconds", replica="r1") == 0.25
    assert value(reg, "router_kv_events_connected", replica="r1") == 1


def test_fan_out_observer_feeds_every_observer() -> None:
    regs = [CollectorRegistry(), CollectorRegistry()]
    ms = [IndexMetrics(r) for r in regs]
    obs = FanOutObserver(*(m.observer() for m in ms))
    obs.batch_applied(R, BatchResult(Counter({"BlockStored": 1}), 3, 0, Counter()))
    obs.gap(R)
    obs.dropped(R, "undecodable", 2)
    obs.resync(R, "restart")
    for reg in regs:
        assert value(reg, "router_kv_events_blocks_total", replica="r1", op="stored") == 3
        assert value(reg, "router_kv_events_gaps_total", replica="r1") == 1
        assert value(reg, "router_kv_events_dropped_total", replica="r1",
                     reason="undecodable") == 2  # fmt: skip
        assert value(reg, "router_kv_events_resyncs_total", replica="r1", reason="restart") == 1


class DownBlocksIndex(InMemoryIndex):
    """Fault injection: the block count fails as an unreachable Redis would."""

    def blocks(self, replica: ReplicaId) -> int:
        raise IndexUnavailable("down")


async def test_keep_block_gauges_refreshes_and_survives_a_down_backend() -> None:
    reg = CollectorRegistry()
    m = IndexMetrics(reg)
    idx = InstrumentedIndex(InMemoryIndex(), m)
    await idx.add(R, [EngineKey(1), EngineKey(2)], [RequestKey(11), RequestKey(12)])
    task = asyncio.create_task(keep_block_gauges(idx, m, lambda: [R], interval_s=0.01))
    down = asyncio.create_task(
        keep_block_gauges(DownBlocksIndex(), m, lambda: [R], interval_s=0.01)
    )
    for _ in range(200):
        await asyncio.sleep(0.01)
        if value(reg, "router_index_unavailable_total", op="read") >= 2:
            break
    assert value(reg, "router_index_blocks", replica="r1") == 2
    assert value(reg, "router_index_unavailable_total", op="read") >= 2
    assert not down.done()
    for t in (task, down):
        t.cancel()
    await asyncio.gather(task, down, return_exceptions=True)
    m.close()
