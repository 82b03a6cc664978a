"""The index port: which replica holds which blocks, and in which tier.

Both backends (``InMemoryIndex``, ``RedisIndex``) implement ``KVIndex`` and pass one
contract suite (``tests/index/test_contract.py``).  Every mutation is idempotent per
(replica, medium, engine key) with reference counts, because vLLM may store the same
content twice and remove it once while a copy survives.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from index.types import EngineKey, Medium, PrefixHits, ReplicaId, RequestKey


class KVIndex(Protocol):
    """Where a prompt's blocks are cached, fed by KV events, read on the request path."""

    async def lookup(
        self, keys: Sequence[RequestKey], *, among: Collection[ReplicaId] | None = None
    ) -> PrefixHits:
        """Per replica, the consecutive leading blocks of ``keys`` it holds, and where.

        Replicas holding nothing are absent.  ``among`` restricts the answer."""
        ...

    async def add(
        self,
        replica: ReplicaId,
        engine_keys: Sequence[EngineKey],
        request_keys: Sequence[RequestKey],
        medium: Medium = Medium.GPU,
    ) -> None:
        """Record that ``replica`` stored these blocks (pairwise) in ``medium``."""
        ...

    async def add_by_engine_key(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey], medium: Medium
    ) -> int:
        """Record a token-less store (an offload event) for blocks already known by their
        engine key; return how many resolved.  Unknown engine keys are ignored."""
        ...

    async def evict(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey], medium: Medium = Medium.GPU
    ) -> None:
        """Apply ``BlockRemoved``: drop one reference per key; unknown keys are ignored."""
        ...

    async def request_key(self, replica: ReplicaId, engine_key: EngineKey) -> RequestKey | None:
        """The request key ``replica`` stored under ``engine_key``, if any (to continue a
        chain from a ``BlockStored``'s parent)."""
        ...

    async def clear(self, replica: ReplicaId) -> None:
        """Forget everything ``replica`` holds (``AllBlocksCleared``, restart, removal)."""
        ...

    async def replicas(self) -> set[ReplicaId]:
        """Replicas that hold at least one block."""
        ...

    async def aclose(self) -> None:
        """Release connections; the index is unusable afterwards."""
        ...
