"""``index``: which KV blocks a request needs, and which replica holds them.

Two halves meet in ``index.keys`` (the block-key specification):

* rendering and tokenising exactly as vLLM does (``RendererRegistry`` -> ``Prompt``:
  token ids and chained block keys, ``cache_salt`` on block 0, LoRA on every block), with
  a replica's ``/tokenize`` as the fallback (``RemoteRenderer``) and a sampled parity check
  (``ParityChecker``);
* the index fed by vLLM's KV events (``decode_batch`` -> ``EventIngestor`` -> a
  ``KVIndex``: ``InMemoryIndex`` or ``RedisIndex``), with ZMQ subscription, replay and
  discovery run by ``KVEventIngestion``.

Public names are re-exported lazily so that importing one half does not load the other's
dependencies (Jinja and tokenizers, or ZMQ and Redis).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from index.ingest import EventIngestor
    from index.ingestion import KVEventIngestion
    from index.keys import block_keys, expected_cached_tokens, root_key
    from index.memory import InMemoryIndex
    from index.parity import ParityChecker
    from index.prompt import Prompt, validate_cache_salt
    from index.redis_store import RedisIndex
    from index.remote_render import RemoteRenderer
    from index.render_errors import (
        InvalidCacheSalt,
        InvalidPrompt,
        ModelNotServed,
        RemoteRenderFailed,
        RenderError,
        RenderUnsupported,
    )
    from index.renderer_registry import ModelSpec, RendererRegistry
    from index.status import SourceStatus
    from index.store import IndexUnavailable, KVIndex
    from index.types import (
        EngineKey,
        Medium,
        PrefixHits,
        ReplicaHit,
        ReplicaId,
        RequestKey,
        replica_id_for_rank,
    )

_WHERE = {
    "ClearedEvent": "index.events",
    "DecodedBatch": "index.events",
    "KVEventBatch": "index.events",
    "RemovedEvent": "index.events",
    "StoredEvent": "index.events",
    "UndecodableBatch": "index.events",
    "decode_batch": "index.events",
    "encode_batch": "index.events",
    "encode_batch_legacy": "index.events",
    "EventIngestor": "index.ingest",
    "KVEventIngestion": "index.ingestion",
    "block_keys": "index.keys",
    "expected_cached_tokens": "index.keys",
    "root_key": "index.keys",
    "InMemoryIndex": "index.memory",
    "ParityChecker": "index.parity",
    "Prompt": "index.prompt",
    "validate_cache_salt": "index.prompt",
    "RedisIndex": "index.redis_store",
    "RemoteRenderer": "index.remote_render",
    "InvalidCacheSalt": "index.render_errors",
    "InvalidPrompt": "index.render_errors",
    "ModelNotServed": "index.render_errors",
    "RemoteRenderFailed": "index.render_errors",
    "RenderError": "index.render_errors",
    "RenderUnsupported": "index.render_errors",
    "ModelSpec": "index.renderer_registry",
    "RendererRegistry": "index.renderer_registry",
    "SourceStatus": "index.status",
    "IndexUnavailable": "index.store",
    "KVIndex": "index.store",
    "EngineKey": "index.types",
    "Medium": "index.types",
    "PrefixHits": "index.types",
    "ReplicaHit": "index.types",
    "ReplicaId": "index.types",
    "RequestKey": "index.types",
    "replica_id_for_rank": "index.types",
}

__all__ = [
    "ClearedEvent",
    "DecodedBatch",
    "EngineKey",
    "EventIngestor",
    "InMemoryIndex",
    "IndexUnavailable",
    "InvalidCacheSalt",
    "InvalidPrompt",
    "KVEventBatch",
    "KVEventIngestion",
    "KVIndex",
    "Medium",
    "ModelNotServed",
    "ModelSpec",
    "ParityChecker",
    "PrefixHits",
    "Prompt",
    "RedisIndex",
    "RemoteRenderFailed",
    "RemoteRenderer",
    "RemovedEvent",
    "RenderError",
    "RenderUnsupported",
    "RendererRegistry",
    "ReplicaHit",
    "ReplicaId",
    "RequestKey",
    "SourceStatus",
    "StoredEvent",
    "UndecodableBatch",
    "block_keys",
    "decode_batch",
    "encode_batch",
    "encode_batch_legacy",
    "expected_cached_tokens",
    "replica_id_for_rank",
    "root_key",
    "validate_cache_salt",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'index' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
