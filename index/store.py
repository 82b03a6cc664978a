"""The index port: which replica holds which blocks, and in which tier.

Both backends (``InMemoryIndex``, ``RedisIndex``) implement ``KVIndex`` and pass one
contract suite (``tests/index/test_contract.py``).  Every mutation is idempotent per
(replica, medium, engine key) with reference counts, because vLLM may store the same
content twice and remove it once while a copy survives.

Ingestion applies one event batch as one ``apply`` call (a list of ``IndexOp``), which a
remote backend turns into one atomic round trip, and resolves parents with one
``request_keys`` call.  A backend that cannot be reached raises ``IndexUnavailable``
(within its configured timeout): readers treat it as "no information" and fall back,
writers resynchronise the replica once it is back.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvkeys.types import EngineKey, Medium, PrefixHits, ReplicaId, RequestKey


class IndexUnavailable(Exception):
    """The index backend cannot answer now (connection refused, timed out, ...).

    Never an HTTP error: the router counts it and routes without KV information."""


@dataclass(frozen=True, slots=True)
class AddOp:
    """``add``: blocks stored with tokens (engine keys paired with request keys)."""

    engine_keys: Sequence[EngineKey]
    request_keys: Sequence[RequestKey]
    medium: Medium = Medium.GPU


@dataclass(frozen=True, slots=True)
class AddByEngineKeyOp:
    """``add_by_engine_key``: a token-less store (offload tiers) of known blocks."""

    engine_keys: Sequence[EngineKey]
    medium: Medium


@dataclass(frozen=True, slots=True)
class EvictOp:
    """``evict``: ``BlockRemoved`` in one tier."""

    engine_keys: Sequence[EngineKey]
    medium: Medium = Medium.GPU


@dataclass(frozen=True, slots=True)
class ClearOp:
    """``clear``: ``AllBlocksCleared`` (or a resynchronisation)."""


IndexOp = AddOp | AddByEngineKeyOp | EvictOp | ClearOp


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

    async def request_keys(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey]
    ) -> list[RequestKey | None]:
        """``request_key`` for several engine keys at once (one round trip)."""
        ...

    async def apply(self, replica: ReplicaId, ops: Sequence[IndexOp]) -> None:
        """Apply ``ops`` in order, atomically with respect to readers where the backend
        allows (one event batch -> one call)."""
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
