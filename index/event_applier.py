"""Applying one event source's decoded batches to a ``KVIndex``, in order.

Per batch, ``EventIngestor.apply`` turns the events into ``IndexOp``s and hands them to
the index in one ``apply`` call (one atomic Lua call for Redis), after resolving the
parents it needs with one ``request_keys`` call.

Rules (vLLM 0.32 semantics, ``shared/docs/vllm-interfaces.md`` section 1):

* ``BlockStored`` with tokens: request keys are ``kvkeys.keys.block_keys`` over
  ``token_ids`` with the event's ``block_size``, continuing from the request key of
  ``parent_block_hash`` (looked up through the engine -> request map, including blocks
  stored earlier in the same batch).  When the parent is ``None`` the chain starts at the
  model's root and the ``cache_salt`` from block 0's ``extra_keys`` is folded in.  The
  LoRA name (``lora_name``) goes into every key.
* **Parents** are resolved from the blocks stored earlier in the same batch, then from
  the ingestor's own record of what it applied in earlier batches (``parent_cache``
  engine keys, oldest dropped first; a key leaves it when any of its tiers is removed
  and everything leaves on a clear, so it never names a block the index has dropped
  through this ingestor), then from the index in one ``request_keys`` call.  A
  conversation's next turn continues from blocks stored moments ago, so a remote index
  is asked for parents rarely rather than once per batch.
* **Unknown parent**: the event is dropped and counted, never chained to a wrong parent
  (llm-d skips it the same way).  Its blocks then stay unknown, and so do their
  children, which is safe: the index under-predicts.  After ``resync_after`` consecutive
  unknown parents the result asks for a resynchronisation (the subscriber clears the
  replica and replays from 0, rate-limited), because it means we missed history.
* Blocks whose ``extra_keys`` carry multimodal or prompt-embedding keys (non-string
  items) cannot be keyed from a prompt's tokens: the event is cut at the first such
  block (later blocks chain through it).
* Token-less stores (CPU/STORAGE offload placeholders, ``token_ids == []``) resolve
  through the engine keys (``AddByEngineKeyOp``); unknown ones are ignored.
* ``BlockRemoved`` drops one reference per hash in its ``medium`` (a GPU removal keeps a
  CPU copy).  ``AllBlocksCleared`` clears the replica.
* Only the full-attention group 0 is indexed: events with ``group_idx`` not in
  ``(None, 0)`` or a ``kv_cache_spec_kind`` other than full/MLA attention are skipped.
* A ``BlockStored`` whose ``token_ids`` length is not ``block_size * len(block_hashes)``
  is malformed for a full-attention group: skipped and counted.

Which model a replica serves (the key root) comes from configuration or discovery; the
block size comes from the events (``last_block_size``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Final

from index.events import ClearedEvent, DecodedBatch, RemovedEvent, StoredEvent
from index.store import AddByEngineKeyOp, AddOp, ClearOp, EvictOp, IndexOp, KVIndex
from kvkeys.keys import block_keys
from kvkeys.types import EngineKey, ReplicaId, RequestKey

__all__ = ["BatchResult", "EventIngestor", "salt_and_usable_blocks"]

log = logging.getLogger(__name__)

_INDEXED_KINDS: Final = frozenset({None, "full_attention", "mla_attention"})

DEFAULT_PARENT_CACHE: Final = 65_536
"""Engine keys an ingestor remembers to resolve parents locally: about a GPU pool's worth
of blocks per source (a few MB), which covers every parent of a replica whose cache has
not turned over."""


@dataclass(slots=True)
class BatchResult:
    """What one batch did to the index (for metrics and the subscriber)."""

    applied: Counter[str] = field(default_factory=Counter)
    """Events applied, by vLLM type name (``BlockStored``, ``BlockRemoved``, ...)."""
    blocks_stored: int = 0
    blocks_removed: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    """Events not applied, by reason: ``unknown_parent``, ``malformed``,
    ``other_group``, ``unknown_tag``."""
    resync_requested: bool = False
    """Consecutive unknown parents reached the threshold: rebuild this replica."""
    cleared: bool = False


def salt_and_usable_blocks(
    extra_keys: list[Any] | None, n_blocks: int, lora_name: str | None
) -> tuple[str | None, int]:
    """The ``cache_salt`` published on block 0 and how many leading blocks can be keyed.

    Each ``extra_keys[i]`` lists, in order: the LoRA name (when ``lora_name`` is set),
    multimodal ``(identifier, offset)`` pairs, the cache salt (block 0 only), prompt
    embedding digests.  A block with multimodal or embedding keys ends the usable run."""
    if not extra_keys:
        return None, n_blocks
    salt: str | None = None
    for i in range(min(n_blocks, len(extra_keys))):
        entry = extra_keys[i]
        if entry is None:
            continue
        items = list(entry) if isinstance(entry, list | tuple) else [entry]
        if lora_name is not None and items and items[0] == lora_name:
            items = items[1:]
        for item in items:
            if isinstance(item, str):
                if i == 0 and salt is None:
                    salt = item
                    continue
                return salt, i
            return salt, i  # mm tuple, embedding digest, or something newer
    return salt, n_blocks


class EventIngestor:
    """Applies one event source's batches to the index, in order (one per source)."""

    def __init__(
        self,
        index: KVIndex,
        replica: ReplicaId,
        model: str,
        *,
        resync_after: int = 3,
        parent_cache: int = DEFAULT_PARENT_CACHE,
    ) -> None:
        self.index = index
        self.replica = replica
        self.model = model
        self._resync_after = resync_after
        self._unknown_streak = 0
        self._parent_cap = parent_cache
        self._parents: dict[EngineKey, RequestKey] = {}
        self.last_block_size: int | None = None
        """The block size of the last ``BlockStored`` with tokens (the replica's)."""

    def reset(self) -> None:
        """Forget per-source history (after the replica was cleared)."""
        self._unknown_streak = 0
        self._parents.clear()

    async def apply(self, batch: DecodedBatch) -> BatchResult:
        """Apply one batch; raises ``IndexUnavailable`` if the index cannot be written
        (nothing of the batch is then applied)."""
        result = BatchResult()
        if batch.ignored:
            result.dropped["unknown_tag"] += batch.ignored
        # Parents not produced earlier in this batch are resolved in one round trip.
        produced: set[EngineKey] = set()
        wanted: list[EngineKey] = []
        for ev in batch.events:
            if isinstance(ev, StoredEvent) and ev.token_ids:
                p = ev.parent_block_hash
                if p is not None and p not in produced:
                    wanted.append(p)
                produced.update(ev.block_hashes)
            elif isinstance(ev, ClearedEvent):
                produced.clear()
        known: dict[EngineKey, RequestKey | None] = {}
        if wanted:
            cache = self._parents
            missing: list[EngineKey] = []
            for p in dict.fromkeys(wanted):
                rk = cache.get(p)
                if rk is None:
                    missing.append(p)
                else:
                    known[p] = rk
            if missing:
                found = await self.index.request_keys(self.replica, missing)
                known.update(zip(missing, found, strict=True))

        ops: list[IndexOp] = []
        overlay: dict[EngineKey, RequestKey] = {}
        cleared = False
        for ev in batch.events:
            if isinstance(ev, StoredEvent):
                self._stored(ev, ops, overlay, known, cleared, result)
            elif isinstance(ev, RemovedEvent):
                if ev.group_idx not in (None, 0):
                    result.dropped["other_group"] += 1
                    continue
                ops.append(EvictOp(ev.block_hashes, ev.medium))
                result.applied["BlockRemoved"] += 1
                result.blocks_removed += len(ev.block_hashes)
            else:
                ops.append(ClearOp())
                overlay.clear()
                cleared = True
                result.cleared = True
                result.applied["AllBlocksCleared"] += 1
        if ops:
            await self.index.apply(self.replica, ops)
            self._remember(ops)
        if result.cleared:
            self._unknown_streak = 0
        return result

    def _remember(self, ops: list[IndexOp]) -> None:
        """Record what the index now maps (after ``ops`` were applied), for parents."""
        if not self._parent_cap:
            return
        cache = self._parents
        for op in ops:
            if isinstance(op, AddOp):
                cache.update(zip(op.engine_keys, op.request_keys, strict=True))
            elif isinstance(op, EvictOp):
                for ek in op.engine_keys:
                    cache.pop(ek, None)
            elif isinstance(op, ClearOp):
                cache.clear()
        excess = len(cache) - self._parent_cap
        if excess > 0:
            for ek in list(islice(cache, excess)):
                del cache[ek]

    def _stored(
        self,
        ev: StoredEvent,
        ops: list[IndexOp],
        overlay: dict[EngineKey, RequestKey],
        known: dict[EngineKey, RequestKey | None],
        cleared: bool,
        result: BatchResult,
    ) -> None:
        if ev.group_idx not in (None, 0) or ev.kv_cache_spec_kind not in _INDEXED_KINDS:
            result.dropped["other_group"] += 1
            return
        hashes = ev.block_hashes
        if not ev.token_ids:
            ops.append(AddByEngineKeyOp(hashes, ev.medium))
            result.applied["BlockStored"] += 1
            result.blocks_stored += len(hashes)
            return
        bs = ev.block_size
        if bs <= 0 or len(ev.token_ids) != bs * len(hashes):
            result.dropped["malformed"] += 1
            return
        parent_key: RequestKey | None = None
        parent = ev.parent_block_hash
        if parent is not None:
            parent_key = overlay.get(parent)
            if parent_key is None and not cleared:
                parent_key = known.get(parent)
            if parent_key is None:
                result.dropped["unknown_parent"] += 1
                self._unknown_streak += 1
                if self._unknown_streak >= self._resync_after:
                    result.resync_requested = True
                return
        self._unknown_streak = 0
        salt, usable = salt_and_usable_blocks(ev.extra_keys, len(hashes), ev.lora_name)
        if usable == 0:
            result.dropped["unsupported_extra_keys"] += 1
            return
        keys = block_keys(
            ev.token_ids[: usable * bs],
            bs,
            model=self.model,
            cache_salt=salt if parent is None else None,
            lora_name=ev.lora_name,
            parent=parent_key,
            first_block_index=0 if parent is None else 1,
        )
        used = hashes[:usable]
        ops.append(AddOp(used, keys, ev.medium))
        overlay.update(zip(used, keys, strict=True))
        self.last_block_size = bs
        result.applied["BlockStored"] += 1
        result.blocks_stored += usable
