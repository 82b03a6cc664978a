"""``kvkeys``: the shared kernel, block keys and the ids they are stored under.

``kvkeys.keys`` is the block-key specification (kvroute's chained request keys over token
ids); ``kvkeys.types`` holds the identifiers and values both the prompt pipeline and the
index speak (``ReplicaId``, ``EngineKey``, ``RequestKey``, ``Medium``, ``PrefixHits``).
It imports nothing of ours, so ``prompt`` and ``index`` can both depend on it without
depending on each other.
"""

from __future__ import annotations

from kvkeys.keys import block_keys, expected_cached_tokens, root_key
from kvkeys.types import (
    EngineKey,
    Medium,
    PrefixHits,
    ReplicaHit,
    ReplicaId,
    RequestKey,
    replica_id_for_rank,
)

__all__ = [
    "EngineKey",
    "Medium",
    "PrefixHits",
    "ReplicaHit",
    "ReplicaId",
    "RequestKey",
    "block_keys",
    "expected_cached_tokens",
    "replica_id_for_rank",
    "root_key",
]
