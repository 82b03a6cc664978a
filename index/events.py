"""vLLM KV cache events on the wire: typed structs, a tolerant decoder, exact encoders.

Two sets of types live here, on purpose:

* **Wire structs** (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
  ``KVEventBatch``) mirror ``vllm/distributed/kv_events.py`` of vLLM 0.32/0.33 field for
  field, in declaration order, with the same msgspec options.  ``encode_batch`` therefore
  produces vLLM's exact bytes (tagged maps, fields equal to their default omitted, the
  outer batch a positional array of all three elements), and ``encode_batch_legacy``
  produces the tagged-array form of vLLM <= 0.23 (every field of the 0.23 layout present,
  positional).  The simulated replica and the tests publish with these.
* **Decoded events** (``StoredEvent``, ``RemovedEvent``, ``ClearedEvent`` in a
  ``DecodedBatch``) are what ingestion consumes: block hashes are normalised to unsigned
  64-bit ints (``EngineKey``), ``bytes`` hashes become ``int.from_bytes(b[-8:], "big")``
  (what vLLM's ``maybe_convert_block_hash`` and llm-d's ``getHashAsUint64`` give), signed
  ints of vLLM <= 0.10.1 are taken modulo 2**64, and ``medium`` is a ``Medium``
  (case-insensitive, ``None`` meaning GPU).

Decoding contract (``decode_batch``):

* The outer batch is ``[ts, events, data_parallel_rank]`` in every vLLM version; missing
  trailing elements are tolerated, extra ones ignored.
* An event is either a tagged map ``{"type": tag, ...}`` (vLLM >= 0.24, matched by key
  name, unknown keys ignored) or a tagged array ``[tag, f1, f2, ...]`` (vLLM <= 0.23,
  decoded by position and by length, since older versions send fewer fields).
* An event with an unknown tag is skipped and counted in ``DecodedBatch.ignored``.
* Anything else that does not fit (not msgpack, wrong shapes or types in a known event)
  raises ``UndecodableBatch``: the caller counts the batch and drops it (the poison pill),
  it never stops ingestion.
* Speed: what vLLM >= 0.24 sends by default (tagged maps, uint64 hashes, known tags) is
  decoded by one typed msgspec decoder, in C; any batch it rejects goes through the
  tolerant path above, which gives the same result wherever both succeed (a property
  test holds the two paths equal).

What this module deliberately does not do: decide what an event means for the index
(``index.event_applier``), or move bytes (``index.subscriber``, ``replica.sim.kv_publisher``).
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec

from kvkeys.types import EngineKey, Medium

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "ClearedEvent",
    "DecodedBatch",
    "DecodedEvent",
    "KVEvent",
    "KVEventBatch",
    "RemovedEvent",
    "StoredEvent",
    "UndecodableBatch",
    "decode_batch",
    "encode_batch",
    "encode_batch_legacy",
    "normalise_hash",
]

_U64: Final = (1 << 64) - 1

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


# ------------------------------------------------------------------------ decoded events


class StoredEvent(msgspec.Struct, gc=False):
    """A decoded ``BlockStored`` with normalised hashes and tier."""

    block_hashes: list[EngineKey]
    parent_block_hash: EngineKey | None
    token_ids: list[int]
    block_size: int
    medium: Medium = Medium.GPU
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class RemovedEvent(msgspec.Struct, gc=False):
    """A decoded ``BlockRemoved``."""

    block_hashes: list[EngineKey]
    medium: Medium = Medium.GPU
    group_idx: int | None = None


class ClearedEvent(msgspec.Struct, gc=False):
    """A decoded ``AllBlocksCleared``."""


DecodedEvent = StoredEvent | RemovedEvent | ClearedEvent


class DecodedBatch(msgspec.Struct, gc=False):
    """One decoded batch: ``ts`` is the engine's wall clock (``time.time()``) at publish."""

    ts: float
    events: list[DecodedEvent]
    data_parallel_rank: int | None = None
    ignored: int = 0
    """Events skipped because their tag is unknown (a newer vLLM)."""


class UndecodableBatch(ValueError):
    """A payload that is not a KV event batch; count it and drop it."""


# Tolerant validation targets: only what ingestion needs, every field optional except the
# hashes, unknown keys ignored (msgspec's default).
class _StoredWire(msgspec.Struct, gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _RemovedWire(msgspec.Struct, gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


_POSITIONAL: Final[dict[str, tuple[str, ...]]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}

_generic: Final = msgspec.msgpack.Decoder()

# The fast path: what vLLM >= 0.24 sends with its default settings (tagged maps, uint64
# hashes) decodes straight into these, in C.  Anything else (an unknown tag, ``bytes`` or
# signed hashes, tagged arrays, a wrong type) fails validation here and is decoded by the
# tolerant path below, which gives the same result wherever both succeed.
_Hash = Annotated[int, msgspec.Meta(ge=0)]


class _FastStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _FastRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None


class _FastCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _FastBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_FastStored | _FastRemoved | _FastCleared]
    data_parallel_rank: int | None = None


_fast: Final = msgspec.msgpack.Decoder(_FastBatch)


def normalise_hash(value: int | bytes) -> EngineKey:
    """An engine block hash as an unsigned 64-bit int (bytes: their last 8, big-endian)."""
    if isinstance(value, bytes):
        return EngineKey(int.from_bytes(value[-8:], "big"))
    return EngineKey(value & _U64)


def _hashes(values: list[int | bytes]) -> list[EngineKey]:
    out: list[EngineKey] = []
    for v in values:
        if isinstance(v, bytes):
            out.append(EngineKey(int.from_bytes(v[-8:], "big")))
        elif v < 0:
            out.append(EngineKey(v & _U64))
        else:
            out.append(EngineKey(v))
    return out


def _decode_event(raw: Any) -> DecodedEvent | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields: dict[str, Any] = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _POSITIONAL.get(tag)
        if names is None:
            return None
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise UndecodableBatch(f"event is neither a tagged map nor a tagged array: {raw!r:.80}")
    if tag == "BlockStored":
        s = msgspec.convert(fields, _StoredWire)
        return StoredEvent(
            _hashes(s.block_hashes),
            None if s.parent_block_hash is None else normalise_hash(s.parent_block_hash),
            s.token_ids,
            s.block_size,
            Medium.parse(s.medium),
            s.lora_name,
            s.extra_keys,
            s.group_idx,
            s.kv_cache_spec_kind,
        )
    if tag == "BlockRemoved":
        r = msgspec.convert(fields, _RemovedWire)
        return RemovedEvent(_hashes(r.block_hashes), Medium.parse(r.medium), r.group_idx)
    if tag == "AllBlocksCleared":
        return ClearedEvent()
    return None


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one ZMQ payload; raise ``UndecodableBatch`` if it is not a KV event batch."""
    try:
        fast = _fast.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _decode_tolerant(payload)
    out: list[DecodedEvent] = []
    for ev in fast.events:
        if type(ev) is _FastStored:
            out.append(StoredEvent(
                ev.block_hashes,  # type: ignore[arg-type]  # uint64s: EngineKeys already
                None if ev.parent_block_hash is None else EngineKey(ev.parent_block_hash),
                ev.token_ids, ev.block_size, Medium.parse(ev.medium), ev.lora_name,
                ev.extra_keys, ev.group_idx, ev.kv_cache_spec_kind,
            ))  # fmt: skip
        elif type(ev) is _FastRemoved:
            out.append(RemovedEvent(
                ev.block_hashes, Medium.parse(ev.medium), ev.group_idx  # type: ignore[arg-type]
            ))  # fmt: skip
        else:
            out.append(ClearedEvent())
    return DecodedBatch(fast.ts, out, fast.data_parallel_rank, 0)


def _decode_tolerant(payload: bytes) -> DecodedBatch:
    try:
        raw = _generic.decode(payload)
        if not isinstance(raw, list) or len(raw) < 2:
            raise UndecodableBatch("batch is not an array [ts, events, dp_rank]")
        ts, events = raw[0], raw[1]
        dp_rank = raw[2] if len(raw) > 2 else None
        if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(events, list):
            raise UndecodableBatch("batch is not an array [ts, events, dp_rank]")
        if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool)):
            raise UndecodableBatch("data_parallel_rank is not an int")
        out: list[DecodedEvent] = []
        ignored = 0
        for ev in events:
            decoded = _decode_event(ev)
            if decoded is None:
                ignored += 1
            else:
                out.append(decoded)
        return DecodedBatch(float(ts), out, dp_rank, ignored)
    except UndecodableBatch:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError) as exc:
        raise UndecodableBatch(str(exc)) from exc
