"""``index.__all__`` is the public surface, every name resolves to what it names, and
importing ``index`` alone loads neither the rendering nor the event dependencies."""

from __future__ import annotations

import subprocess
import sys

import index


def test_exported_members() -> None:
    assert index.__all__ == sorted(index.__all__)
    assert set(index.__all__) == {
        "ClearedEvent", "DecodedBatch", "EngineKey", "EventIngestor", "IndexUnavailable",
        "InMemoryIndex", "InvalidCacheSalt", "InvalidPrompt", "KVEventBatch",
        "KVEventIngestion", "KVIndex", "Medium", "ModelNotServed", "ModelSpec",
        "ParityChecker", "PrefixHits", "Prompt", "RedisIndex", "RemoteRenderFailed",
        "RemoteRenderer", "RemovedEvent", "RenderError", "RenderUnsupported",
        "RendererRegistry", "ReplicaHit", "ReplicaId", "RequestKey", "SourceStatus",
        "StoredEvent", "UndecodableBatch", "block_keys", "decode_batch", "encode_batch",
        "encode_batch_legacy", "expected_cached_tokens", "replica_id_for_rank", "root_key",
        "validate_cache_salt",
    }
    assert set(index.__all__) == set(index._WHERE)
    for name in index.__all__:
        value = getattr(index, name)
        assert getattr(value, "__name__", name) == name


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        index.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_is_lazy() -> None:
    heavy = "('zmq', 'redis', 'jinja2', 'tokenizers')"
    code = f"import index, sys; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
