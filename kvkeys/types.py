"""Identifiers and values shared by every part of the index.

Three kinds of identifier meet here and must never be confused:

* ``ReplicaId``: the router's name for one event source (one vLLM server, or one
  data-parallel rank of it, see ``replica_id_for_rank``).
* ``EngineKey``: a block hash as vLLM publishes it in its KV events (the low 64 bits of
  the engine's digest).  Engine keys depend on the engine's hash algorithm and seed, so
  the router never computes them; it only stores them to apply ``BlockRemoved``.
* ``RequestKey``: kvroute's own chained block key (``kvkeys.keys``), computed the same way
  from a prompt and from the ``token_ids`` of a ``BlockStored`` event.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

ReplicaId = NewType("ReplicaId", str)
EngineKey = NewType("EngineKey", int)
RequestKey = NewType("RequestKey", int)


class Medium(enum.StrEnum):
    """Where a replica holds a block, fastest first.  vLLM's ``medium`` strings map here
    case-insensitively; ``None`` means the primary pool (``GPU``), as in vLLM."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"

    @classmethod
    def parse(cls, value: str | None) -> Medium:
        """Map a ``medium`` field from an event; unknown tiers count as storage."""
        if value is None:
            return cls.GPU
        try:
            return cls(value.upper())
        except ValueError:
            return cls.STORAGE


def replica_id_for_rank(replica: ReplicaId, dp_rank: int | None) -> ReplicaId:
    """The event-source id of one data-parallel rank; rank 0 (or none) is the replica."""
    if not dp_rank:
        return replica
    return ReplicaId(f"{replica}#dp{dp_rank}")


@dataclass(frozen=True, slots=True)
class ReplicaHit:
    """How much of a prompt's leading blocks one replica holds.

    ``gpu_blocks + cpu_blocks + storage_blocks`` consecutive leading blocks are held,
    each counted in the fastest tier that holds it.  The run stops at the first block
    the replica holds in no tier, because keys are chained.
    """

    gpu_blocks: int = 0
    cpu_blocks: int = 0
    storage_blocks: int = 0

    @property
    def blocks(self) -> int:
        """Consecutive leading blocks held in any tier."""
        return self.gpu_blocks + self.cpu_blocks + self.storage_blocks


@dataclass(frozen=True, slots=True)
class PrefixHits:
    """Result of one index lookup: a hit per replica that holds at least one block."""

    by_replica: dict[ReplicaId, ReplicaHit] = field(default_factory=dict)

    def blocks(self, replica: ReplicaId) -> int:
        """Leading blocks ``replica`` holds (0 when it holds none)."""
        hit = self.by_replica.get(replica)
        return hit.blocks if hit is not None else 0

    def best(self) -> int:
        """The longest run of leading blocks any replica holds."""
        return max((h.blocks for h in self.by_replica.values()), default=0)
