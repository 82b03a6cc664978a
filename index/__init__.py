"""``index``: which replica holds which KV block, fed by vLLM's KV events.

Events are decoded at the edge (``decode_batch``), applied per source in order
(``EventIngestor``) to a ``KVIndex`` (``InMemoryIndex`` or ``RedisIndex``), with ZMQ
subscription, replay, discovery and leases run by ``KVEventIngestion``.  Block keys and
ids come from ``kvkeys``; the index never renders a prompt.
"""

from __future__ import annotations

from index.event_applier import EventIngestor
from index.events import (
    ClearedEvent,
    DecodedBatch,
    KVEventBatch,
    RemovedEvent,
    StoredEvent,
    UndecodableBatch,
    decode_batch,
    encode_batch,
    encode_batch_legacy,
)
from index.ingestion import KVEventIngestion
from index.memory import InMemoryIndex
from index.redis_store import RedisIndex
from index.status import SourceStatus
from index.store import IndexUnavailable, KVIndex

__all__ = [
    "ClearedEvent",
    "DecodedBatch",
    "EventIngestor",
    "InMemoryIndex",
    "IndexUnavailable",
    "KVEventBatch",
    "KVEventIngestion",
    "KVIndex",
    "RedisIndex",
    "RemovedEvent",
    "SourceStatus",
    "StoredEvent",
    "UndecodableBatch",
    "decode_batch",
    "encode_batch",
    "encode_batch_legacy",
]
