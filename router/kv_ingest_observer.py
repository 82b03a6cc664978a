"""What the ``kv`` service learns from KV event ingestion besides the index: each
batch's stored blocks feed the eviction-horizon estimator's allocation count, and an
engine restart (the event sequence reset) is announced to whoever must forget what it
learnt of that replica (the ``kv`` policy)."""

from __future__ import annotations

from collections.abc import Callable

from index.event_applier import BatchResult
from kvkeys.types import ReplicaId
from router.horizon import HorizonEstimator

__all__ = ["KvIngestObserver", "ReplicaResets"]


class ReplicaResets:
    """Who must hear that a replica's event source restarted (its engine restarted:
    empty caches, counters from 0): the ``kv`` policy drops what it learnt of it."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[ReplicaId], None]] = []

    def listen(self, listener: Callable[[ReplicaId], None]) -> None:
        """Call ``listener(replica)`` on every restart."""
        self._listeners.append(listener)

    def restarted(self, replica: ReplicaId) -> None:
        """``replica``'s engine restarted."""
        for listener in self._listeners:
            listener(replica)


class KvIngestObserver:
    """An ``IngestObserver``: ``BlockStored`` counts into the horizon estimator,
    restarts to ``ReplicaResets``."""

    def __init__(
        self, horizon: HorizonEstimator, clock: Callable[[], float], resets: ReplicaResets
    ) -> None:
        self._horizon = horizon
        self._clock = clock
        self._resets = resets

    def batch_applied(self, replica: ReplicaId, result: BatchResult) -> None:
        if result.blocks_stored:
            self._horizon.observe_allocated(replica, self._clock(), result.blocks_stored)

    def gap(self, replica: ReplicaId) -> None:
        """Counted by the source status."""

    def dropped(self, replica: ReplicaId, reason: str, count: int = 1) -> None:
        """Counted by the source status."""

    def resync(self, replica: ReplicaId, reason: str) -> None:
        """Counted by the source status; an engine restart resets what was learnt."""
        if reason == "restart":
            self._resets.restarted(replica)
