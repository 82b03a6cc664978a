"""Provisional index entries: closing the burst blind spot.

Between routing a request and the ``BlockStored`` events of its prefill, the index does
not know the chosen replica will hold the request's blocks.  A burst of requests sharing
a new prefix (a new system prompt, a fan-out of one agent's sub-calls) would then be
spread by load, each computing the prefix again.  So right after a decision the router
records the request's block keys as provisionally held by the chosen replica, for a short
``ttl_s``; lookups see the union of the real index and these entries.  Real events
replace them naturally: once the index holds the blocks, the provisional run adds
nothing, and the entries expire.

Invariants:

* Per replica, the unexpired keys are prefix-closed along every chain: all keys of one
  insert share one expiry, and re-inserting a key only ever extends it, so a key is
  never outlived by a key after it in the same chain.  The held run of a prompt is
  therefore found by bisection, O(log n) per replica.
* Memory is bounded by ``max_keys`` (oldest inserts go first); expired entries are purged
  on every insert.  Times are passed in: no clock here.
* Provisional blocks count as GPU blocks (that is where the prefill will put them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence

from kvkeys.types import PrefixHits, ReplicaHit, ReplicaId, RequestKey

__all__ = ["ProvisionalBlocks"]


class ProvisionalBlocks:
    """Short-lived "this replica will hold these blocks" entries."""

    def __init__(self, *, ttl_s: float = 10.0, max_keys: int = 1_000_000) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._expiry: dict[ReplicaId, dict[RequestKey, float]] = {}
        self._inserts: deque[tuple[float, ReplicaId, tuple[RequestKey, ...]]] = deque()
        self._size = 0
        self._latest = float("-inf")
        """The latest expiry any insert set."""

    def __len__(self) -> int:
        """Keys currently stored (expired ones until the next purge included)."""
        return self._size

    def add(self, replica: ReplicaId, keys: Sequence[RequestKey], now: float) -> None:
        """Record that ``replica`` will hold ``keys`` (a chain from block 0) until
        ``now + ttl_s``."""
        self._purge(now)
        if not keys or self.ttl_s <= 0:
            return
        until = now + self.ttl_s
        table = self._expiry.setdefault(replica, {})
        before = len(table)
        if until >= self._latest:
            # No stored expiry is later (a monotonic clock): every key is extended, and
            # the comparison per key (hundreds per prompt, every request) is skipped.
            self._latest = until
            for k in keys:
                table[k] = until
        else:
            for k in keys:
                if table.get(k, -1.0) < until:
                    table[k] = until
        self._size += len(table) - before
        self._inserts.append((until, replica, tuple(keys)))
        while self._size > self.max_keys and self._inserts:
            self._drop(*self._inserts.popleft())

    def run(self, replica: ReplicaId, keys: Sequence[RequestKey], now: float) -> int:
        """Leading blocks of ``keys`` provisionally held by ``replica``."""
        table = self._expiry.get(replica)
        if not table or not keys:
            return 0
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if table.get(keys[mid - 1], -1.0) > now:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def overlay(
        self,
        hits: PrefixHits,
        keys: Sequence[RequestKey],
        now: float,
        among: Collection[ReplicaId],
    ) -> PrefixHits:
        """``hits`` extended by provisional runs: a replica whose provisional run is longer
        than its indexed run gets the difference as GPU blocks."""
        merged: dict[ReplicaId, ReplicaHit] | None = None
        for replica in among:
            extra = self.run(replica, keys, now)
            if extra == 0:
                continue
            real = hits.by_replica.get(replica)
            held = real.blocks if real is not None else 0
            if extra <= held:
                continue
            if merged is None:
                merged = dict(hits.by_replica)
            if real is None:
                merged[replica] = ReplicaHit(gpu_blocks=extra)
            else:
                merged[replica] = ReplicaHit(
                    gpu_blocks=real.gpu_blocks + extra - held,
                    cpu_blocks=real.cpu_blocks,
                    storage_blocks=real.storage_blocks,
                )
        return hits if merged is None else PrefixHits(merged)

    def forget(self, replica: ReplicaId) -> None:
        """Drop every entry of ``replica`` (it restarted or left)."""
        table = self._expiry.pop(replica, None)
        if table:
            self._size -= len(table)

    def _purge(self, now: float) -> None:
        while self._inserts and self._inserts[0][0] <= now:
            self._drop(*self._inserts.popleft())

    def _drop(self, until: float, replica: ReplicaId, keys: tuple[RequestKey, ...]) -> None:
        table = self._expiry.get(replica)
        if table is None:
            return
        for k in keys:
            expiry = table.get(k)
            # A later insert extended this key: it belongs to that insert now, and
            # dropping it would break prefix-closure of the later chain.
            if expiry is not None and expiry <= until:
                del table[k]
                self._size -= 1
        if not table:
            del self._expiry[replica]
