"""What the simulated block pool reports, as plain values: the ``BlockStored``,
``BlockRemoved`` and ``AllBlocksCleared`` of vLLM's KV events before they are encoded
(``replica.sim.event_sink`` encodes them).  The pool and its host tier both emit them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvkeys.types import RequestKey

__all__ = ["MEDIUM_CPU", "MEDIUM_GPU", "Cleared", "PoolEvent", "Removed", "Stored"]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


@dataclass(frozen=True, slots=True)
class Stored:
    """``BlockStored``: a run of blocks of one request that just became full."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[list[str] | None] | None = None
    """One entry per block (0.32: ``to_event_extra_keys``); ``None`` for token-less events."""
    keys: list[RequestKey] = field(default_factory=list)
    """kvroute's request keys of the same blocks (not on the wire; for tests)."""


@dataclass(frozen=True, slots=True)
class Removed:
    """``BlockRemoved``: cached blocks that were evicted from ``medium``."""

    block_hashes: list[int]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class Cleared:
    """``AllBlocksCleared``: the prefix cache was reset."""


PoolEvent = Stored | Removed | Cleared
