"""A paged KV block pool that behaves like vLLM V1's ``BlockPool`` (0.32).

Contract (mirrors ``vllm/v1/core/block_pool.py`` and ``kv_cache_manager.py``):

* ``num_blocks`` physical blocks; block 0 is the *null block*, reserved at start like
  vLLM's, so ``num_blocks - 1`` blocks are usable and ``usage()`` is
  ``1 - free / (num_blocks - 1)``.  Free blocks that still carry a hash (evictable
  prefix-cache entries) count as free, exactly as in ``vllm:kv_cache_usage_perc``.
* Only full blocks get a content key; the key of block ``i`` chains over every earlier
  block (``kvkeys.keys.block_keys``: cache_salt folded into block 0, the LoRA name into
  every block).  The *engine hash* that events carry is a seeded per-pool function of the
  key, so it differs from kvroute's request keys the way vLLM's hashes do.
* The free queue is an LRU: ``allocate`` pops from the head; ``free`` releases a
  request's blocks in *reverse* order, hashed blocks to the tail and un-hashed blocks to
  the head (vLLM: "LIFO reuse of non-cached blocks"), so a request's tail blocks are
  evicted before its head.  ``touch`` (a prefix hit) takes a block out of the free queue.
* Reusing a hashed free block evicts it: its hash leaves the cache and a
  ``BlockRemoved`` is queued.  Storing a block whose content is already cached elsewhere
  creates a duplicate (vLLM does not de-duplicate); each copy is stored and removed on
  its own.
* ``reset()`` succeeds only when no block is in use, and queues ``AllBlocksCleared``.
* Events are queued as plain values (``PoolEvent``) and taken per scheduler step with
  ``take_events``; encoding them on the wire is someone else's job.
* An optional host tier (``replica.sim.offload.HostTier``) receives evicted blocks.

The pool never looks at the clock and never does I/O; it is single-threaded by design
(one owner, the scheduler).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from kvkeys.types import RequestKey

if TYPE_CHECKING:
    from replica.sim.offload import HostTier

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


@dataclass(slots=True, eq=False)
class Block:
    """One physical KV block.  ``key`` is set once the block is full and cached."""

    block_id: int
    ref_cnt: int = 0
    key: RequestKey | None = None
    engine_hash: int | None = None


@dataclass(frozen=True, slots=True)
class Stored:
    """``BlockStored``: a run of blocks of one request that just became full."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[list[str] | None] | None = None
    """One entry per block (0.32: ``to_event_extra_keys``); ``None`` for token-less events."""
    keys: list[RequestKey] = field(default_factory=list)
    """kvroute's request keys of the same blocks (not on the wire; for tests)."""


@dataclass(frozen=True, slots=True)
class Removed:
    """``BlockRemoved``: cached blocks that were evicted from ``medium``."""

    block_hashes: list[int]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class Cleared:
    """``AllBlocksCleared``: the prefix cache was reset."""


PoolEvent = Stored | Removed | Cleared


def make_engine_hasher(seed: int) -> EngineHasher:
    """The engine-side hash: a seeded 64-bit function of kvroute's content key.

    Like vLLM's random ``NONE_HASH`` per process, the seed makes published hashes
    unpredictable to a router, which must map them through ``token_ids``.
    """
    return EngineHasher(seed)


class EngineHasher:
    """Maps a content key to the uint64 the pool publishes (callable)."""

    __slots__ = ("_seed",)

    def __init__(self, seed: int) -> None:
        self._seed = seed & 0xFFFF_FFFF_FFFF_FFFF

    def __call__(self, key: RequestKey) -> int:
        return xxhash.xxh3_64_intdigest(key.to_bytes(8, "little"), seed=self._seed)


class BlockPool:
    """vLLM V1's block pool: allocation, prefix cache, LRU free queue, events."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        hasher: EngineHasher,
        host_tier: HostTier | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (one is the null block)")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hasher = hasher
        self.host_tier = host_tier
        self.blocks = [Block(i) for i in range(num_blocks)]
        # The null block is never handed out and never freed (vLLM pops it at start).
        self.free_queue: OrderedDict[int, Block] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self.cached: dict[RequestKey, dict[int, Block]] = {}
        self.events: list[PoolEvent] = []

    # ---- queries -------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now, including evictable cached ones."""
        return len(self.free_queue)

    def usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: the share of usable blocks pinned by requests."""
        return 1.0 - len(self.free_queue) / (self.num_blocks - 1)

    def get_cached(self, key: RequestKey) -> Block | None:
        """The first cached block with content ``key`` (vLLM returns the first copy)."""
        copies = self.cached.get(key)
        if not copies:
            return None
        return next(iter(copies.values()))

    def longest_hit(self, keys: Sequence[RequestKey], max_blocks: int) -> list[Block]:
        """Leading blocks of ``keys`` held in the GPU cache, at most ``max_blocks``."""
        hit: list[Block] = []
        cached = self.cached
        for key in keys[:max_blocks]:
            copies = cached.get(key)
            if not copies:
                break
            hit.append(next(iter(copies.values())))
        return hit

    @staticmethod
    def num_evictable(blocks: Iterable[Block]) -> int:
        """How many of ``blocks`` sit in the free queue (a hit on them consumes free room)."""
        return sum(1 for b in blocks if b.ref_cnt == 0)

    # ---- mutations -----------------------------------------------------------------

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on prefix-hit blocks, removing free ones from the queue."""
        free_queue = self.free_queue
        for b in blocks:
            if b.ref_cnt == 0:
                del free_queue[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """Pop ``n`` blocks from the head of the free queue, evicting cached content."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, {len(self.free_queue)} free")
        out: list[Block] = []
        popitem = self.free_queue.popitem
        for _ in range(n):
            _, b = popitem(last=False)
            if b.key is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: Block) -> None:
        # vLLM queues one BlockRemoved per evicted physical block.
        key = b.key
        assert key is not None and b.engine_hash is not None
        copies = self.cached[key]
        del copies[b.block_id]
        if not copies:
            del self.cached[key]
        if self.host_tier is not None:
            self.events.extend(self.host_tier.offload(key, b.engine_hash))
        self.events.append(Removed([b.engine_hash]))
        b.key = None
        b.engine_hash = None

    def free(self, blocks: Sequence[Block]) -> None:
        """Release a request's blocks (given in request order) like vLLM's ``free``.

        Blocks are released in reverse order; those reaching ref 0 go to the tail of the
        free queue when hashed (LRU) and to the head when not (reused first).
        """
        free_queue = self.free_queue
        unhashed: list[Block] = []
        for b in reversed(blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.key is None:
                    unhashed.append(b)
                else:
                    free_queue[b.block_id] = b
        for b in reversed(unhashed):
            free_queue[b.block_id] = b
            free_queue.move_to_end(b.block_id, last=False)

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        keys: Sequence[RequestKey],
        tokens: Sequence[int],
        num_cached: int,
        num_full: int,
        *,
        cache_salt: str | None,
        lora_name: str | None,
    ) -> None:
        """Cache blocks ``[num_cached, num_full)`` of a request and queue one ``Stored``.

        ``keys`` are the request's chained content keys and ``tokens`` all its tokens.
        """
        if num_cached >= num_full:
            return
        hasher = self.hasher
        cached = self.cached
        hashes: list[int] = []
        for i in range(num_cached, num_full):
            b = blocks[i]
            key = keys[i]
            h = hasher(key)
            b.key = key
            b.engine_hash = h
            copies = cached.get(key)
            if copies is None:
                cached[key] = {b.block_id: b}
            else:
                copies[b.block_id] = b
            hashes.append(h)
        bs = self.block_size
        # vLLM takes the parent from the request's own hash list, not from the block.
        parent = hasher(keys[num_cached - 1]) if num_cached > 0 else None
        # vLLM publishes one extra-keys entry per block (None when a block has none):
        # the LoRA name on every block, then the salt on block 0.
        extra: list[list[str] | None]
        if cache_salt or lora_name:
            extra = []
            for i in range(num_cached, num_full):
                parts: list[str] = []
                if lora_name:
                    parts.append(lora_name)
                if i == 0 and cache_salt:
                    parts.append(cache_salt)
                extra.append(parts or None)
        else:
            extra = [None] * (num_full - num_cached)
        self.events.append(
            Stored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=list(tokens[num_cached * bs : num_full * bs]),
                block_size=bs,
                lora_name=lora_name,
                extra_keys=extra,
                keys=list(keys[num_cached:num_full]),
            )
        )

    def reset(self) -> bool:
        """Drop every cached hash (``AllBlocksCleared``); refused while blocks are in use."""
        if len(self.free_queue) != self.num_blocks - 1:
            return False
        self.cached.clear()
        for b in self.blocks:
            b.key = None
            b.engine_hash = None
        if self.host_tier is not None:
            self.host_tier.clear()
        self.events.append(Cleared())
        return True

    def take_events(self) -> list[PoolEvent]:
        """All events queued since the last call, oldest first (one scheduler step)."""
        events = self.events
        if events:
            self.events = []
        return events
