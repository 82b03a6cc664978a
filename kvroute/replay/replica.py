"""One simulated replica in a virtual-time replay, and its KV events into the index.

``VirtualReplica`` owns a scheduler and block pool (``replica.sim.scheduler``,
``replica.sim.block_pool``: the same code the HTTP simulated replica runs) and steps it
when the replay's event loop says so.  After each step the pool's events take the
production path into the router's index: vLLM 0.32 structs (``replica.sim.event_sink``),
msgpack encoding and decoding (``index.events``), and the event ingestor
(``index.event_applier``), which resolves engine hashes to request keys through the token ids
the events carry.  The router learns of a block exactly one engine step after it was
scheduled, as it would with a zero-latency event stream.  The same events, when asked,
count the fleet's copies of blocks (``kvroute.replay.copies``).
"""

from __future__ import annotations

from dataclasses import dataclass

from index.event_applier import EventIngestor
from index.events import KVEventBatch, decode_batch, encode_batch
from index.memory import InMemoryIndex
from index.status import SourceStatus
from kvkeys.types import ReplicaId, RequestKey
from kvroute.replay.copies import BlockCopies
from replica.sim.block_pool import BlockPool, make_engine_hasher
from replica.sim.event_sink import to_wire
from replica.sim.profiles import Profile
from replica.sim.scheduler import Scheduler, SimRequest, StepPlan

__all__ = ["VirtualReplica"]


@dataclass(slots=True)
class _Busy:
    plan: StepPlan
    end: float


class VirtualReplica:
    """A scheduler over a block pool, stepped by the replay (see the module docstring)."""

    def __init__(
        self,
        replica_id: ReplicaId,
        *,
        model: str,
        profile: Profile,
        num_blocks: int,
        block_size: int,
        vocab: list[int],
        index: InMemoryIndex,
        seed: int = 0,
        copies: BlockCopies | None = None,
    ) -> None:
        self.id = replica_id
        self.model = model
        self.pool = BlockPool(num_blocks, block_size, hasher=make_engine_hasher(seed ^ 0x5EED))
        self.scheduler = Scheduler(self.pool, profile, model=model, vocab=vocab)
        self.max_model_len = min(profile.max_model_len, (num_blocks - 1) * block_size)
        self.ingestor = EventIngestor(index, replica_id, model)
        self.busy: _Busy | None = None
        self.batches = 0
        self._copies = copies

    def status(self) -> SourceStatus:
        """The event source's status as the ingestion would report it: live, no lag."""
        return SourceStatus(replica=self.id, model=self.model, endpoint=None, state="live",
                            connected=True, receive_lag_s=0.0, batches=self.batches,
                            block_size=self.pool.block_size)

    def keys(self, req_tokens: list[int], cache_salt: str | None) -> list[RequestKey]:
        """The engine's content keys for a prompt."""
        return self.scheduler.make_keys(req_tokens, cache_salt=cache_salt, lora_name=None)

    def add(self, req: SimRequest, now: float) -> None:
        """Queue a request that arrived at ``now``."""
        self.scheduler.add(req, now)

    def start_step(self, now: float) -> float | None:
        """Plan the next step at ``now`` if idle and there is work; its end time."""
        if self.busy is not None or not self.scheduler.has_work:
            return None
        plan = self.scheduler.schedule(now)
        if not plan.scheduled:
            return None
        end = now + plan.duration_s
        self.busy = _Busy(plan, end)
        return end

    async def finish_step(self, now: float) -> tuple[list[SimRequest], int]:
        """Apply the step that ends at ``now``: the requests that produced a token, and
        the blocks the step stored (its events are in the index when this returns)."""
        busy = self.busy
        assert busy is not None and busy.end == now
        self.busy = None
        outputs = self.scheduler.finish_step(busy.plan, now)
        events = self.pool.take_events()
        stored = 0
        if events and self._copies is not None:
            self._copies.apply(self.id, events, now)
        if events:
            batch = KVEventBatch(ts=now, events=[to_wire(e) for e in events],
                                 data_parallel_rank=None)
            result = await self.ingestor.apply(decode_batch(encode_batch(batch)))
            self.batches += 1
            stored = result.blocks_stored
        return outputs, stored
