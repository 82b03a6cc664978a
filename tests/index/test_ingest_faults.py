"""Malformed KV events and crashing subscribers, over real ZMQ sockets in vLLM's encoding.

One bad event is dropped and counted while everything else goes on; a removal that
cannot be read leaves a hole, so its source is rebuilt; a source whose subscriber dies is
restarted on its own, without stopping any other source.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import pytest
import zmq.asyncio

from index.event_applier import BatchResult
from index.events import BlockRemoved, BlockStored, KVEvent
from index.ingestion import KVEventIngestion, SourceSpec
from index.memory import InMemoryIndex
from index.store import IndexOp
from index.subscriber import SubscriberSettings
from kvkeys.keys import block_keys
from kvkeys.types import ReplicaId
from replica.sim.kv_publisher import KVEventPublisher

A, B = ReplicaId("a"), ReplicaId("b")
MODEL = "m"
BS = 4
FAST = SubscriberSettings(
    idle_poll_s=0.02,
    replay_timeout_s=0.3,
    replay_total_s=2.0,
    resync_min_interval_s=0.0,
    recover_interval_s=0.05,
    backoff_base_s=0.02,
    backoff_cap_s=0.2,
    restart_healthy_after_s=0.5,
)


def prompt(seed: int, blocks: int = 3) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BS)]


def store(seed: int, blocks: int = 3, parent: int | None = None) -> BlockStored:
    hashes: list[int | bytes] = [seed * 100 + i for i in range(blocks)]
    return BlockStored(hashes, parent, prompt(seed, blocks), BS, None, "GPU", None)


async def held(index: InMemoryIndex, replica: ReplicaId, seed: int, blocks: int = 3) -> int:
    keys = block_keys(prompt(seed, blocks), BS, model=MODEL)
    return (await index.lookup(keys)).blocks(replica)


async def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def eventually_held(
    index: InMemoryIndex, replica: ReplicaId, seed: int, want: int, timeout: float = 10.0
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while await held(index, replica, seed) != want:
        if loop.time() > deadline:
            raise AssertionError(f"{replica} holds {await held(index, replica, seed)} blocks "
                                 f"of prompt {seed}, not {want}")  # fmt: skip
        await asyncio.sleep(0.01)


class Recorder:
    """An ``IngestObserver`` that remembers what it was told, per replica."""

    def __init__(self) -> None:
        self.drops: list[tuple[ReplicaId, str]] = []
        self.resyncs: list[tuple[ReplicaId, str]] = []

    def batch_applied(self, replica: ReplicaId, result: BatchResult) -> None:
        self.drops.extend((replica, reason) for reason in result.dropped)

    def gap(self, replica: ReplicaId) -> None:
        pass

    def dropped(self, replica: ReplicaId, reason: str, count: int = 1) -> None:
        self.drops.append((replica, reason))

    def resync(self, replica: ReplicaId, reason: str) -> None:
        self.resyncs.append((replica, reason))


@dataclass
class Fleet:
    pubs: dict[ReplicaId, KVEventPublisher]
    index: InMemoryIndex
    ingestion: KVEventIngestion
    obs: Recorder
    task: asyncio.Task[None]

    async def publish(self, replica: ReplicaId, *events: KVEvent) -> int:
        return await self.pubs[replica].publish(list(events))

    def live(self, replica: ReplicaId) -> bool:
        st = self.ingestion.status(replica)
        return st is not None and st.state == "live" and st.connected

    async def applied_through(self, replica: ReplicaId, seq: int) -> None:
        def done() -> bool:
            st = self.ingestion.status(replica)
            return st is not None and st.last_seq is not None and st.last_seq >= seq

        await eventually(done)


@contextlib.asynccontextmanager
async def fleet(index: InMemoryIndex | None = None) -> AsyncIterator[Fleet]:
    ctx = zmq.asyncio.Context()
    pubs: dict[ReplicaId, KVEventPublisher] = {}
    for rid in (A, B):
        pub = KVEventPublisher("tcp://127.0.0.1:0", bind=True, topic=f"kv@{rid}@m",
                               replay_endpoint="tcp://127.0.0.1:0", buffer_steps=100,
                               context=ctx)  # fmt: skip
        await pub.start()
        pubs[rid] = pub
    idx = index or InMemoryIndex()
    obs = Recorder()
    specs = [
        SourceSpec(rid, model=MODEL, endpoint=p.endpoint,
                   replay_endpoint=p.resolved_replay_endpoint)  # fmt: skip
        for rid, p in pubs.items()
    ]
    ing = KVEventIngestion(idx, specs, settings=FAST, observer=obs, context=ctx)
    task = asyncio.create_task(ing.run())
    f = Fleet(pubs, idx, ing, obs, task)
    try:
        await eventually(lambda: f.live(A) and f.live(B))
        yield f
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for pub in pubs.values():
            await pub.aclose()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("bad_token", [-1, 2**32, 2**63])
async def test_an_out_of_range_token_id_is_dropped_and_every_source_goes_on(
    bad_token: int,
) -> None:
    async with fleet() as f:
        bad = store(7)
        bad.token_ids[5] = bad_token
        await f.publish(A, bad)
        # The bad event's batch neighbours, later batches and the other replica go on.
        await f.publish(A, store(1))
        seq_b = await f.publish(B, store(2))
        await f.applied_through(B, seq_b)
        await eventually_held(f.index, A, 1, 3)
        await eventually_held(f.index, B, 2, 3)
        assert await held(f.index, A, 7) == 0
        assert (A, "invalid_token_ids") in f.obs.drops
        assert f.live(A) and f.live(B)
        st = f.ingestion.status(A)
        assert st is not None and st.invalid_events == 1
        assert f.ingestion.health().ok


async def test_a_malformed_hash_drops_only_its_event_and_orphans_its_children() -> None:
    async with fleet() as f:
        bad = BlockStored([b""], None, prompt(7, 1), BS, None, "GPU", None)
        seq = await f.publish(A, bad, store(1))
        await f.applied_through(A, seq)
        assert await held(f.index, A, 1) == 3
        assert (A, "invalid_block_hashes") in f.obs.drops
        # A child of a dropped store names a parent the index never got.
        bad_parent = BlockStored([901], 7.5, prompt(8, 1), BS, None, "GPU", None)  # type: ignore[arg-type]
        seq = await f.publish(A, bad_parent, store(2))
        await f.applied_through(A, seq)
        assert await held(f.index, A, 2) == 3
        assert (A, "invalid_parent_block_hash") in f.obs.drops


async def test_children_of_an_invalid_store_are_dropped_without_a_futile_rebuild() -> None:
    async with fleet() as f:
        bad = store(7, blocks=1)
        bad.token_ids[0] = -5
        await f.publish(A, bad)
        child = store(8, blocks=1, parent=700)
        for _ in range(4):
            await f.publish(A, child)
        seq = await f.publish(A, store(1))
        await f.applied_through(A, seq)
        assert await held(f.index, A, 1) == 3
        assert [r for r in f.obs.drops if r == (A, "invalid_parent")] == [(A, "invalid_parent")] * 4
        assert f.obs.resyncs == []  # the hole is known: no rebuild that would hit it again


async def test_a_removal_that_cannot_be_read_rebuilds_its_source() -> None:
    async with fleet() as f:
        await f.applied_through(A, await f.publish(A, store(1)))
        await f.applied_through(B, await f.publish(B, store(1)))
        assert await held(f.index, A, 1) == 3
        # Which blocks went is unknown: keeping block 1 would predict a hit that is gone.
        await f.publish(A, BlockRemoved(["100"], "GPU"))  # type: ignore[list-item]
        seq = await f.publish(A, store(2))
        await f.applied_through(A, seq)
        await eventually_held(f.index, A, 1, 0)
        await eventually_held(f.index, A, 2, 3)
        assert (A, "invalid_event") in f.obs.resyncs
        assert (A, "invalid_block_hashes") in f.obs.drops
        assert await held(f.index, B, 1) == 3  # the other replica is untouched
        await eventually(lambda: f.live(A))


class CrashingIndex(InMemoryIndex):
    """Fault injection: ``apply`` for one replica raises a bug-like error ``crashes`` times."""

    def __init__(self, victim: ReplicaId, crashes: int) -> None:
        super().__init__()
        self.victim = victim
        self.crashes = crashes

    async def apply(self, replica: ReplicaId, ops: Sequence[IndexOp]) -> None:
        if replica == self.victim and self.crashes > 0:
            self.crashes -= 1
            raise RuntimeError("injected bug")
        await super().apply(replica, ops)


async def test_a_crashing_subscriber_is_restarted_and_never_stops_another() -> None:
    index = CrashingIndex(A, crashes=0)
    async with fleet(index) as f:
        index.crashes = 2
        await f.publish(A, store(1))  # crashes A's subscriber (and its restart's first rebuild)
        await eventually(lambda: f.ingestion.health().restarts.get("kv:a", 0) >= 1)
        await f.applied_through(B, await f.publish(B, store(2)))
        assert await held(f.index, B, 2) == 3
        # A is restarted with backoff, rebuilds from replay and is live again.
        await eventually(lambda: index.crashes == 0 and f.live(A))
        await eventually_held(f.index, A, 1, 3)
        await f.applied_through(A, await f.publish(A, store(3)))
        assert await held(f.index, A, 3) == 3
        await eventually(lambda: f.ingestion.health().ok)
        assert not f.task.done()


async def test_health_reports_a_source_that_keeps_failing() -> None:
    index = CrashingIndex(A, crashes=0)
    async with fleet(index) as f:
        index.crashes = 10**9
        await f.publish(A, store(1))
        await eventually(lambda: not f.ingestion.health().ok)
        health = f.ingestion.health()
        assert "kv:a" in health.failing and "injected bug" in health.failing["kv:a"]
        await f.applied_through(B, await f.publish(B, store(2)))
        index.crashes = 0
        await eventually(lambda: f.ingestion.health().ok and f.live(A))

