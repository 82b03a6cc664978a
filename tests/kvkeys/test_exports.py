"""``kvkeys.__all__`` (the shared kernel) and ``aio.__all__`` (generic asyncio helpers) are
their public surfaces, and every name resolves to what it names."""

from __future__ import annotations

import aio
import kvkeys


def test_kvkeys_exported_members() -> None:
    assert kvkeys.__all__ == sorted(kvkeys.__all__)
    assert set(kvkeys.__all__) == {
        "EngineKey", "Medium", "PrefixHits", "ReplicaHit", "ReplicaId", "RequestKey",
        "block_keys", "expected_cached_tokens", "replica_id_for_rank", "root_key",
    }
    for name in kvkeys.__all__:
        assert getattr(getattr(kvkeys, name), "__name__", name) == name


def test_aio_exported_members() -> None:
    assert aio.__all__ == sorted(aio.__all__)
    assert set(aio.__all__) == {"Backoff", "TaskOwner", "cancel_and_wait", "reraise_if_cancelling"}
    for name in aio.__all__:
        assert getattr(getattr(aio, name), "__name__", name) == name
