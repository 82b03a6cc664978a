"""``index.__all__`` is the public surface, every name resolves to what it names, and
importing ``index`` loads none of the prompt pipeline (Jinja, tokenizers)."""

from __future__ import annotations

import subprocess
import sys

import index


def test_exported_members() -> None:
    assert index.__all__ == sorted(index.__all__)
    assert set(index.__all__) == {
        "ClearedEvent", "DecodedBatch", "EventIngestor", "IndexUnavailable", "InMemoryIndex",
        "KVEventBatch", "KVEventIngestion", "KVIndex", "RedisIndex", "RemovedEvent",
        "SourceStatus", "StoredEvent", "UndecodableBatch", "decode_batch", "encode_batch",
        "encode_batch_legacy",
    }
    for name in index.__all__:
        value = getattr(index, name)
        assert getattr(value, "__name__", name) == name


def test_index_does_not_load_the_prompt_pipeline() -> None:
    heavy = "('prompt', 'jinja2', 'tokenizers')"
    code = f"import index, sys; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
