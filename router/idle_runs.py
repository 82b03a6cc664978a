"""The paused sessions whose blocks are still cached, per replica, oldest pause first.

When a session's turn finishes, its blocks go to the back of its replica's LRU free
queue (``paused``): the run is remembered with the replica's allocation count and free
pool then.  When the session's next turn is routed, the run is forgotten (``resumed``):
the turn re-uses or strands it, and ``router.session_tracker`` knows which.  A run whose
depth has been consumed by later allocations is gone from the replica; ``runs`` drops
such runs from the front (pauses are kept in the order they started, so the evicted
ones gather there) and yields the rest as ``displacement.IdleRun``.

Bounded: at most ``max_runs`` runs per replica (the oldest go first); a run only lives
while its blocks can still be cached, so a replica holds about its pool size over the
mean run.  Synchronous; times and counts are passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from kvkeys.types import ReplicaId
from router.displacement import IdleRun

__all__ = ["IdleRuns"]


@dataclass(frozen=True, slots=True)
class _Run:
    replica: ReplicaId
    alloc_mark: float
    free_mark: float
    blocks: int
    finished_at: float

    def depth(self, allocated: float) -> float:
        return self.free_mark + self.blocks - (allocated - self.alloc_mark)


class IdleRuns:
    """Per replica, the runs of paused sessions (module docstring)."""

    def __init__(self, *, max_runs: int = 4096) -> None:
        self.max_runs = max_runs
        self._by_replica: dict[ReplicaId, OrderedDict[str, _Run]] = {}
        self._where: dict[str, ReplicaId] = {}

    def __len__(self) -> int:
        return len(self._where)

    def paused(
        self, session: str, replica: ReplicaId, *, alloc_mark: float, free_mark: float,
        blocks: int, now: float,
    ) -> None:
        """The session's turn finished on ``replica``: its ``blocks`` went behind
        ``free_mark`` free blocks when ``alloc_mark`` blocks had been allocated there."""
        self.resumed(session)
        runs = self._by_replica.setdefault(replica, OrderedDict())
        runs[session] = _Run(replica, alloc_mark, free_mark, blocks, now)
        self._where[session] = replica
        while len(runs) > self.max_runs:
            old, _ = runs.popitem(last=False)
            del self._where[old]

    def resumed(self, session: str) -> None:
        """The session's next turn was routed (or it was forgotten): drop its run."""
        replica = self._where.pop(session, None)
        if replica is not None:
            self._by_replica[replica].pop(session, None)

    def forget_replica(self, replica: ReplicaId) -> None:
        """The replica left or restarted: its runs are gone."""
        for session in self._by_replica.pop(replica, OrderedDict()):
            self._where.pop(session, None)

    def run_of(self, session: str, allocated: float, now: float) -> IdleRun | None:
        """The session's own run, if it is paused with blocks still cached (``allocated``:
        the count on its replica)."""
        replica = self._where.get(session)
        if replica is None:
            return None
        run = self._by_replica[replica][session]
        depth = run.depth(allocated)
        return IdleRun(depth, run.blocks, max(0.0, now - run.finished_at)) if depth > 0 else None

    def replica_of(self, session: str) -> ReplicaId | None:
        """Where the session's paused run is, if remembered."""
        return self._where.get(session)

    def runs(
        self, replica: ReplicaId, allocated: float, now: float, exclude: str | None = None
    ) -> Iterator[IdleRun]:
        """The runs still (partly) cached on ``replica``, ``allocated`` blocks having
        been allocated there so far; evicted runs at the front are dropped."""
        runs = self._by_replica.get(replica)
        if not runs:
            return
        while runs:
            session, first = next(iter(runs.items()))
            if first.depth(allocated) > 0:
                break
            runs.popitem(last=False)
            del self._where[session]
        for session, run in runs.items():
            depth = run.depth(allocated)
            if depth > 0 and session != exclude:
                yield IdleRun(depth, run.blocks, max(0.0, now - run.finished_at))
