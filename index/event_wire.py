"""vLLM KV cache events as vLLM writes them: wire structs and exact encoders.

``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` and ``KVEventBatch`` mirror
``vllm/distributed/kv_events.py`` of vLLM 0.32/0.33 field for field, in declaration
order, with the same msgspec options, so ``encode_batch`` produces vLLM's exact bytes
(tagged maps, fields equal to their default omitted, the outer batch a positional array
of all three elements), and ``encode_batch_legacy`` the tagged-array form of vLLM <=
0.23 (every field of the 0.23 layout present, positional).  The simulated replica and
the tests publish with these; ``index.events`` decodes (and re-exports them).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "KVEventBatch",
    "encode_batch",
    "encode_batch_legacy",
]

# --------------------------------------------------------------------------- wire structs


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``EventBatch``: always a positional array ``[ts, events, dp_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's ``KVCacheEvent`` base: tagged by class name, defaults omitted (>= 0.24)."""


class BlockStored(_KVCacheEvent):
    """vLLM 0.32's ``BlockStored``, field for field.

    0.33's extra ``lookahead_token_ids`` is left out on purpose: msgspec sizes a struct's
    map header by its field count, so a 16th key would turn 0.32's ``fixmap`` header into
    a ``map16`` and the bytes would no longer match 0.32's."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_KVCacheEvent):
    """vLLM's ``BlockRemoved``."""

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_KVCacheEvent):
    """vLLM's ``AllBlocksCleared``: the replica (DP rank) dropped its whole prefix cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    """vLLM's ``KVEventBatch``: one engine step's events."""

    events: list[KVEvent]


# Legacy (<= 0.23) tagged arrays.  The 0.22/0.23 layout, the longest array form.


class _LegacyEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class _LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class _LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


class _LegacyBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder: Final = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    """vLLM >= 0.24 bytes (tagged maps), identical to ``msgspec.msgpack.Encoder().encode``
    of vLLM's own ``KVEventBatch`` with the same values."""
    return _encoder.encode(batch)


def encode_batch_legacy(batch: KVEventBatch) -> bytes:
    """vLLM 0.22/0.23 bytes: every event a tagged positional array with all its fields."""
    legacy: list[_LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            legacy.append(
                _LegacyBlockStored(
                    ev.block_hashes,
                    ev.parent_block_hash,
                    ev.token_ids,
                    ev.block_size,
                    ev.lora_id,
                    ev.medium,
                    ev.lora_name,
                    ev.extra_keys,
                    ev.group_idx,
                    ev.kv_cache_spec_kind,
                    ev.kv_cache_spec_sliding_window,
                )
            )
        elif isinstance(ev, BlockRemoved):
            legacy.append(_LegacyBlockRemoved(ev.block_hashes, ev.medium, ev.group_idx))
        else:
            legacy.append(_LegacyAllBlocksCleared())
    return _encoder.encode(_LegacyBatch(batch.ts, legacy, batch.data_parallel_rank))
