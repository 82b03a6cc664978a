"""The kv service's ingestion observer: stored blocks into the horizon, restarts to
whoever forgets a replica."""

from __future__ import annotations

from index.event_applier import BatchResult
from kvkeys.types import ReplicaId
from router.horizon import HorizonEstimator
from router.kv_ingest_observer import KvIngestObserver, ReplicaResets

R = ReplicaId("r1")


def test_an_engine_restart_is_announced_and_other_resyncs_are_not() -> None:
    resets = ReplicaResets()
    heard: list[ReplicaId] = []
    resets.listen(heard.append)
    horizon = HorizonEstimator()
    observer = KvIngestObserver(horizon, lambda: 5.0, resets)
    for reason in ("reconnect", "disconnected", "history_lost"):
        observer.resync(R, reason)
    assert heard == []
    observer.resync(R, "restart")
    assert heard == [R]


def test_stored_blocks_count_as_allocations() -> None:
    horizon = HorizonEstimator()
    observer = KvIngestObserver(horizon, lambda: 5.0, ReplicaResets())
    before = horizon.allocated(R)
    observer.batch_applied(R, BatchResult(blocks_stored=7))
    assert horizon.allocated(R) == before + 7
