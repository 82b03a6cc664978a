"""vLLM KV cache events on the wire: typed structs, a tolerant decoder, exact encoders.

Two sets of types meet here, on purpose:

* **Wire structs** (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
  ``KVEventBatch``) and the exact encoders live in ``index.event_wire`` and are
  re-exported here: vLLM's own classes, field for field.
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
* A known event that does not fit is replaced, in place, by an ``InvalidEvent`` naming
  the field at fault (ingestion drops and counts it; the rest of the batch goes on):
  a field of the wrong type or shape; a block hash that is neither a 64-bit int nor 1 to 64
  bytes; a ``BlockStored`` token id outside ``[0, 2**32)`` (what ``kvkeys.keys`` hashes);
  for the indexed group (``group_idx`` 0 or absent, full or MLA attention), token ids
  that are not ``block_size * len(block_hashes)`` or a ``block_size`` outside
  ``[1, MAX_BLOCK_SIZE]``; a ``parent_block_hash`` naming one of the event's own blocks.
  Its ``block_hashes`` are kept when they could be read, so ingestion can recognise the
  children of a dropped store.
* A payload that is not a batch at all (not msgpack, not ``[ts, events, ...]``) raises
  ``UndecodableBatch``: the caller counts the batch and drops it (the poison pill), it
  never stops ingestion.
* Speed: what vLLM >= 0.24 sends by default (tagged maps, uint64 hashes, known tags) is
  decoded by one typed msgspec decoder, in C; any batch it rejects goes through the
  tolerant path above, which gives the same result wherever both succeed (a property
  test holds the two paths equal).

What this module deliberately does not do: decide what an event means for the index
(``index.event_applier``), or move bytes (``index.subscriber``, ``replica.sim.kv_publisher``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final

import msgspec

from index.event_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
    encode_batch_legacy,
)
from kvkeys.types import EngineKey, Medium

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "ClearedEvent",
    "DecodedBatch",
    "DecodedEvent",
    "INDEXED_KINDS",
    "InvalidEvent",
    "KVEvent",
    "MAX_BLOCK_SIZE",
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
_U32_END: Final = 1 << 32

MAX_BLOCK_SIZE: Final = 1 << 20
"""The largest ``block_size`` accepted for the indexed group (vLLM's are 1 to a few
thousand tokens)."""

INDEXED_KINDS: Final = frozenset({None, "full_attention", "mla_attention"})
"""``kv_cache_spec_kind`` values of the group the index keeps (with ``group_idx`` 0)."""

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


class InvalidEvent(msgspec.Struct, gc=False):
    """A known event that does not fit its contract, in its place in the batch."""

    kind: str
    """The event's tag (``BlockStored``, ``BlockRemoved``) or ``event`` for an entry
    that is neither a tagged map nor a tagged array."""
    field: str
    """The field at fault (a name of the wire struct, or ``event``)."""
    detail: str
    block_hashes: list[EngineKey] | None = None
    """The event's hashes when they could be read, else ``None``."""


DecodedEvent = StoredEvent | RemovedEvent | ClearedEvent | InvalidEvent


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
_Token = Annotated[int, msgspec.Meta(ge=0, lt=_U32_END)]


class _FastStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None = None
    token_ids: list[_Token] = []
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


def _hash_error(value: object) -> str | None:
    """Why ``value`` is not a well-formed engine block hash (``None`` if it is)."""
    if isinstance(value, bytes):
        return None if 1 <= len(value) <= 64 else f"a {len(value)}-byte hash"
    if isinstance(value, int) and not isinstance(value, bool):
        return None if -(1 << 63) <= value <= _U64 else "a hash beyond 64 bits"
    return f"a hash of type {type(value).__name__}"


def _read_hashes(values: object) -> tuple[list[EngineKey] | None, str | None]:
    """Normalised hashes, or ``None`` and why they cannot be read."""
    if not isinstance(values, list):
        return None, f"block_hashes of type {type(values).__name__}"
    out: list[EngineKey] = []
    for v in values:
        err = _hash_error(v)
        if err is not None:
            return None, err
        out.append(normalise_hash(v))
    return out, None


def _stored_error(ev: StoredEvent, *, tokens_checked: bool) -> tuple[str, str] | None:
    """The field at fault in a decoded ``BlockStored`` and why, or ``None``
    (``tokens_checked``: the typed decoder already held the token ids in range)."""
    tokens = ev.token_ids
    if tokens:
        if not tokens_checked:
            lo, hi = min(tokens), max(tokens)
            if lo < 0 or hi >= _U32_END:
                return "token_ids", f"token id {lo if lo < 0 else hi} outside [0, 2**32)"
        if ev.group_idx in (None, 0) and ev.kv_cache_spec_kind in INDEXED_KINDS:
            bs = ev.block_size
            if not 1 <= bs <= MAX_BLOCK_SIZE:
                return "block_size", f"block_size {bs} outside [1, {MAX_BLOCK_SIZE}]"
            if len(tokens) != bs * len(ev.block_hashes):
                return "token_ids", (f"{len(tokens)} token ids for {len(ev.block_hashes)} "
                                     f"blocks of {bs}")  # fmt: skip
    parent = ev.parent_block_hash
    if parent is not None and parent in ev.block_hashes:
        return "parent_block_hash", "the parent is one of the event's own blocks"
    return None


def _checked(ev: StoredEvent, *, tokens_checked: bool = False) -> StoredEvent | InvalidEvent:
    err = _stored_error(ev, tokens_checked=tokens_checked)
    if err is None:
        return ev
    return InvalidEvent("BlockStored", err[0], err[1], ev.block_hashes)


_FIELD_AT: Final = re.compile(r"at `\$\.(\w+)|field `(\w+)`")


def _invalid(tag: str, exc: Exception, fields: dict[str, Any]) -> InvalidEvent:
    """An ``InvalidEvent`` for a conversion error, naming the field msgspec names."""
    found = _FIELD_AT.search(str(exc))
    name = (found.group(1) or found.group(2)) if found else "event"
    hashes, _ = _read_hashes(fields.get("block_hashes"))
    return InvalidEvent(tag, name, str(exc)[:200], hashes)


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
        return InvalidEvent("event", "event",
                            f"neither a tagged map nor a tagged array: {raw!r:.80}")  # fmt: skip
    if tag == "BlockStored":
        try:
            s = msgspec.convert(fields, _StoredWire)
        except (msgspec.ValidationError, TypeError, ValueError) as exc:
            return _invalid(tag, exc, fields)
        hashes, err = _read_hashes(s.block_hashes)
        if hashes is None:
            return InvalidEvent(tag, "block_hashes", err or "", None)
        parent: EngineKey | None = None
        if s.parent_block_hash is not None:
            err = _hash_error(s.parent_block_hash)
            if err is not None:
                return InvalidEvent(tag, "parent_block_hash", err, hashes)
            parent = normalise_hash(s.parent_block_hash)
        return _checked(StoredEvent(
            hashes, parent, s.token_ids, s.block_size, Medium.parse(s.medium), s.lora_name,
            s.extra_keys, s.group_idx, s.kv_cache_spec_kind,
        ))  # fmt: skip
    if tag == "BlockRemoved":
        try:
            r = msgspec.convert(fields, _RemovedWire)
        except (msgspec.ValidationError, TypeError, ValueError) as exc:
            return _invalid(tag, exc, fields)
        removed, err = _read_hashes(r.block_hashes)
        if removed is None:
            return InvalidEvent(tag, "block_hashes", err or "", None)
        return RemovedEvent(removed, Medium.parse(r.medium), r.group_idx)
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
            out.append(_checked(StoredEvent(
                ev.block_hashes,  # type: ignore[arg-type]  # uint64s: EngineKeys already
                None if ev.parent_block_hash is None else EngineKey(ev.parent_block_hash),
                ev.token_ids, ev.block_size, Medium.parse(ev.medium), ev.lora_name,
                ev.extra_keys, ev.group_idx, ev.kv_cache_spec_kind,
            ), tokens_checked=True))  # fmt: skip
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
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        raise UndecodableBatch(str(exc)) from exc
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
