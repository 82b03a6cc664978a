"""The simulated replica's KV events on the wire: pool events -> vLLM 0.32 structs -> ZMQ.

``PublisherSink`` is the engine's ``EventSink`` over ``replica.sim.kv_publisher``'s
``KVEventPublisher`` (vLLM's framing, sequence numbers and replay socket).  GPU events
carry ``group_idx=0`` and ``kv_cache_spec_kind="full_attention"`` like a plain
full-attention model's; ``lora_id`` is always ``None`` (the sim has no adapter ids).
The ``drop_events`` fault is applied here, through the publisher's ``drop_next``.
"""

from __future__ import annotations

from collections.abc import Sequence

from index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from replica.sim.block_pool import MEDIUM_GPU, Cleared, PoolEvent, Removed, Stored
from replica.sim.faults import Faults
from replica.sim.kv_publisher import KVEventPublisher


def to_wire(event: PoolEvent) -> KVEvent:
    """One pool event as vLLM 0.32's event struct."""
    if isinstance(event, Stored):
        gpu = event.medium == MEDIUM_GPU
        extra = (
            None
            if event.extra_keys is None
            else [tuple(k) if k is not None else None for k in event.extra_keys]
        )
        return BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=None,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=extra,
            group_idx=0,
            kv_cache_spec_kind="full_attention" if gpu else None,
        )
    if isinstance(event, Removed):
        return BlockRemoved(block_hashes=list(event.block_hashes), medium=event.medium, group_idx=0)
    assert isinstance(event, Cleared)
    return AllBlocksCleared()


class PublisherSink:
    """``EventSink`` that publishes each step's events as one vLLM ``KVEventBatch``."""

    def __init__(self, publisher: KVEventPublisher, faults: Faults) -> None:
        self.publisher = publisher
        self._faults = faults

    async def publish(self, events: Sequence[PoolEvent]) -> None:
        faults = self._faults
        if faults.drop_events > 0:
            faults.drop_events -= 1
            self.publisher.drop_next(1)
        await self.publisher.publish([to_wire(e) for e in events])
