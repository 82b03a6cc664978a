"""A bounded host-memory (CPU) tier for blocks evicted from the GPU pool.

Contract: when the GPU pool evicts a cached block, ``offload`` copies its content key
into an LRU of at most ``capacity_blocks`` entries and queues a CPU-medium
``BlockStored`` in vLLM's default OffloadingConnector shape (same hash as on the GPU,
``parent_block_hash=None``, no tokens, ``block_size=0``).  The CPU ``Stored`` is queued
*before* the GPU ``Removed`` of the same block, so a subscriber can still resolve the
hash.  Overflow evicts the least recently used entry with a CPU ``BlockRemoved``.
A prefix lookup that runs past the GPU hit continues here (``longest_hit``); loading
those blocks back costs ``load_seconds(n)`` at ``bandwidth_bytes_per_s``.

Deliberate simplification: vLLM's OffloadingConnector stores write-through as blocks
are computed; this tier stores on eviction, which is what a router can observe anyway
(a CPU copy outliving the GPU copy).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvkeys.types import RequestKey
from replica.sim.block_pool import MEDIUM_CPU, PoolEvent, Removed, Stored


class HostTier:
    """LRU host pool of evicted blocks, by content key."""

    def __init__(
        self, capacity_blocks: int, *, block_bytes: int, bandwidth_bytes_per_s: float
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        if bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth must be positive")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.bandwidth = bandwidth_bytes_per_s
        self.entries: OrderedDict[RequestKey, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def offload(self, key: RequestKey, engine_hash: int) -> list[PoolEvent]:
        """Copy an evicted GPU block here; returns the events to queue, in order."""
        entries = self.entries
        if key in entries:
            entries.move_to_end(key)
            return []
        entries[key] = engine_hash
        events: list[PoolEvent] = [Stored([engine_hash], None, [], 0, medium=MEDIUM_CPU)]
        if len(entries) > self.capacity_blocks:
            _, old = entries.popitem(last=False)
            events.append(Removed([old], medium=MEDIUM_CPU))
        return events

    def longest_hit(self, keys: Sequence[RequestKey]) -> int:
        """How many leading ``keys`` this tier holds (touching them as used)."""
        n = 0
        entries = self.entries
        for key in keys:
            if key not in entries:
                break
            entries.move_to_end(key)
            n += 1
        return n

    def load_seconds(self, n_blocks: int) -> float:
        """Simulated time to copy ``n_blocks`` back to the GPU."""
        return n_blocks * self.block_bytes / self.bandwidth

    def clear(self) -> None:
        """Forget everything (a prefix-cache reset clears every tier)."""
        self.entries.clear()
