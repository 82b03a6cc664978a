"""How much of the fleet's KV capacity holds a second copy of a block, over a replay.

One pooled cache (``bench.bounds``' pooled LRU) holds each block once.  A fleet of
separate caches holds a block once per replica that computed it: a prefix that every
conversation starts with (a shared system prompt) sits in every replica that serves
such conversations, and a conversation that moves leaves its context behind on the
replica it left until that replica evicts it.  Every such copy is capacity the pooled
reference has and the fleet does not.

``BlockCopies`` counts them from the replicas' pool events (``replica.sim.pool_events``:
the same stores, evictions and resets the KV events publish): a physical block whose
content another block in the fleet already holds (on another replica or, as vLLM does
not de-duplicate, on the same one) is a copy.  ``mean_copies`` is the count averaged
over simulated time, from the first event to the last.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvkeys.types import ReplicaId, RequestKey
from replica.sim.pool_events import MEDIUM_GPU, Cleared, PoolEvent, Removed, Stored

__all__ = ["BlockCopies"]


class BlockCopies:
    """Copies of cached GPU blocks across a fleet's pools (module docstring)."""

    def __init__(self) -> None:
        self._fleet: Counter[RequestKey] = Counter()
        """Physical blocks holding each key, fleet-wide (no zero counts)."""
        self._blocks = 0
        """Physical blocks holding a key, fleet-wide."""
        self._held: dict[ReplicaId, Counter[RequestKey]] = {}
        """Per replica: physical blocks holding each key."""
        self._key_of: dict[ReplicaId, dict[int, RequestKey]] = {}
        """Per replica: the key behind each engine hash its events carry."""
        self._area = 0.0
        self._start: float | None = None
        self._last = 0.0

    def apply(self, replica: ReplicaId, events: Iterable[PoolEvent], now: float) -> None:
        """One engine step's events of ``replica``, which ended at ``now``."""
        self._advance(now)
        held = self._held.setdefault(replica, Counter())
        key_of = self._key_of.setdefault(replica, {})
        for ev in events:
            if isinstance(ev, Stored):
                if ev.medium != MEDIUM_GPU:
                    continue
                for h, key in zip(ev.block_hashes, ev.keys, strict=True):
                    key_of[h] = key
                    held[key] += 1
                    self._change(key, 1)
            elif isinstance(ev, Removed):
                if ev.medium != MEDIUM_GPU:
                    continue
                for h in ev.block_hashes:
                    key = key_of[h]
                    held[key] -= 1
                    if not held[key]:
                        del held[key]
                        del key_of[h]
                    self._change(key, -1)
            elif isinstance(ev, Cleared):
                for key, n in held.items():
                    self._change(key, -n)
                held.clear()
                key_of.clear()

    @property
    def copies(self) -> int:
        """Physical blocks now holding a key that another block also holds."""
        return self._blocks - len(self._fleet)

    def mean_copies(self) -> float:
        """The copies averaged over simulated time (0 before two events)."""
        if self._start is None or self._last <= self._start:
            return 0.0
        return self._area / (self._last - self._start)

    def _advance(self, now: float) -> None:
        if self._start is None:
            self._start = now
        elif now > self._last:
            self._area += self.copies * (now - self._last)
        self._last = max(self._last, now)

    def _change(self, key: RequestKey, n: int) -> None:
        """``n`` more (or, negative, fewer) physical blocks hold ``key``."""
        self._blocks += n
        left = self._fleet[key] + n
        if left:
            self._fleet[key] = left
        else:
            del self._fleet[key]
