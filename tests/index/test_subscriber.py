"""The ZMQ subscriber against a publisher speaking vLLM's framing, over real TCP sockets."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import pytest
import zmq
import zmq.asyncio

from aio.backoff import Backoff
from index.event_applier import BatchResult
from index.events import AllBlocksCleared, BlockRemoved, BlockStored
from index.memory import InMemoryIndex
from index.store import IndexOp, IndexUnavailable
from index.subscriber import (
    ConnectSubscriber,
    EventSource,
    SubscriberSettings,
    fetch_replay,
)
from kvkeys.keys import block_keys
from kvkeys.types import ReplicaId
from replica.sim.kv_publisher import KVEventPublisher

R = ReplicaId("r1")
MODEL = "m"
BS = 4
FAST = SubscriberSettings(
    idle_poll_s=0.02,
    replay_timeout_s=0.3,
    replay_total_s=2.0,
    resync_min_interval_s=0.0,
    recover_interval_s=0.05,
)


def prompt(seed: int, blocks: int = 3) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BS)]


def store(seed: int, blocks: int = 3) -> BlockStored:
    hashes: list[int | bytes] = [seed * 100 + i for i in range(blocks)]
    return BlockStored(hashes, None, prompt(seed, blocks), BS, None, "GPU", None)


def remove(seed: int, blocks: int = 3) -> BlockRemoved:
    return BlockRemoved([seed * 100 + i for i in range(blocks)], "GPU")


async def held(index: InMemoryIndex, seed: int, blocks: int = 3) -> int:
    keys = block_keys(prompt(seed, blocks), BS, model=MODEL)
    return (await index.lookup(keys)).blocks(R)


async def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


class Recorder:
    """An ``IngestObserver`` that remembers what it was told."""

    def __init__(self) -> None:
        self.applied: list[BatchResult] = []
        self.gaps = 0
        self.drops: list[str] = []
        self.resyncs: list[str] = []

    def batch_applied(self, replica: ReplicaId, result: BatchResult) -> None:
        self.applied.append(result)

    def gap(self, replica: ReplicaId) -> None:
        self.gaps += 1

    def dropped(self, replica: ReplicaId, reason: str, count: int = 1) -> None:
        self.drops.append(reason)

    def resync(self, replica: ReplicaId, reason: str) -> None:
        self.resyncs.append(reason)


class FlakyIndex(InMemoryIndex):
    """Fault injection: an in-memory index that can be made unreachable."""

    down = False

    async def apply(self, replica: ReplicaId, ops: Sequence[IndexOp]) -> None:
        if self.down:
            raise IndexUnavailable("injected outage")
        await super().apply(replica, ops)

    async def clear(self, replica: ReplicaId) -> None:
        if self.down:
            raise IndexUnavailable("injected outage")
        await super().clear(replica)


@dataclass
class Rig:
    pub: KVEventPublisher
    index: InMemoryIndex
    sub: ConnectSubscriber
    obs: Recorder

    async def publish(self, *events: BlockStored | BlockRemoved | AllBlocksCleared) -> int:
        return await self.pub.publish(list(events))

    async def applied_through(self, seq: int) -> None:
        await eventually(
            lambda: self.sub.status.last_seq is not None and self.sub.status.last_seq >= seq
        )


@contextlib.asynccontextmanager
async def rig(
    *,
    replay: bool = True,
    replay_endpoint: str | None = None,
    index: InMemoryIndex | None = None,
    legacy: bool = False,
    settings: SubscriberSettings = FAST,
) -> AsyncIterator[Rig]:
    ctx = zmq.asyncio.Context()
    pub = KVEventPublisher(
        "tcp://127.0.0.1:0",
        bind=True,
        replay_endpoint="tcp://127.0.0.1:0" if replay else None,
        topic="kv@r1@m",
        buffer_steps=100,
        legacy_encoding=legacy,
        legacy_replay=legacy,
        context=ctx,
    )
    await pub.start()
    idx = index or InMemoryIndex()
    obs = Recorder()
    src = EventSource(
        R, MODEL, pub.endpoint, replay_endpoint or pub.resolved_replay_endpoint, "kv@r1"
    )
    sub = ConnectSubscriber(src, idx, ctx, settings=settings, observer=obs)
    task = asyncio.create_task(sub.run())
    try:
        await eventually(lambda: sub.status.connected and sub.status.state == "live")
        yield Rig(pub, idx, sub, obs)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pub.aclose()
        ctx.destroy(linger=0)
    assert sub.status.state == "stopped" and not sub.status.connected


async def test_live_events_are_applied_and_status_tracks_them() -> None:
    async with rig() as r:
        await r.publish(store(1))
        seq = await r.publish(store(2), remove(1))
        await r.applied_through(seq)
        assert await held(r.index, 1) == 0
        assert await held(r.index, 2) == 3
        st = r.sub.status
        assert st.last_seq == 1 and st.batches == 2 and st.block_size == BS
        assert st.gaps == 0 and st.resyncs == 0 and st.undecodable == 0
        assert st.receive_lag_s is not None and st.receive_lag_s >= 0
        assert st.last_event_wall is not None and st.last_reset_monotonic is not None
        assert [res.applied["BlockStored"] for res in r.obs.applied] == [1, 1]


async def test_history_published_before_subscribing_is_replayed_from_zero() -> None:
    ctx = zmq.asyncio.Context()
    async with KVEventPublisher(
        "tcp://127.0.0.1:0", bind=True, replay_endpoint="tcp://127.0.0.1:0", context=ctx
    ) as pub:
        for seed in (1, 2, 3):
            await pub.publish([store(seed)])
        index = InMemoryIndex()
        src = EventSource(R, MODEL, pub.endpoint, pub.resolved_replay_endpoint)
        sub = ConnectSubscriber(src, index, ctx, settings=FAST)
        task = asyncio.create_task(sub.run())
        await eventually(lambda: sub.status.last_seq == 2)
        assert [await held(index, s) for s in (1, 2, 3)] == [3, 3, 3]
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    ctx.destroy(linger=0)


async def test_a_replay_is_applied_from_its_last_clear_and_gives_the_loop_back() -> None:
    # An engine's buffer after a prefix-cache reset: 100 batches the clear supersedes,
    # the clear (with a store after it in the same batch), then 98 more.
    ctx = zmq.asyncio.Context()
    async with KVEventPublisher(
        "tcp://127.0.0.1:0", bind=True, replay_endpoint="tcp://127.0.0.1:0",
        buffer_steps=500, context=ctx,
    ) as pub:
        for seed in range(1, 101):
            await pub.publish([store(seed)])
        await pub.publish([store(500), AllBlocksCleared(), store(101)])
        for seed in range(102, 200):
            last = await pub.publish([store(seed)])
        ticks = 0
        seen: list[int] = []

        class Ticks(Recorder):
            def batch_applied(self, replica: ReplicaId, result: BatchResult) -> None:
                super().batch_applied(replica, result)
                seen.append(ticks)

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        index, obs = InMemoryIndex(), Ticks()
        src = EventSource(R, MODEL, pub.endpoint, pub.resolved_replay_endpoint)
        settings = dataclasses.replace(FAST, replay_slice_s=0.0)
        sub = ConnectSubscriber(src, index, ctx, settings=settings, observer=obs)
        ticker = asyncio.create_task(tick())
        task = asyncio.create_task(sub.run())
        await eventually(lambda: sub.status.last_seq == last)
        assert [await held(index, s) for s in (1, 100, 500)] == [0, 0, 0]
        assert [await held(index, s) for s in (101, 150, 199)] == [3, 3, 3]
        # Only the clear's batch and those after it were applied, the loop ran between
        # every two of them.
        assert len(obs.applied) == 99 and obs.applied[0].cleared
        assert all(b > a for a, b in itertools.pairwise(seen))
        for t in (task, ticker):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
    ctx.destroy(linger=0)


async def test_gap_is_filled_by_replay() -> None:
    async with rig() as r:
        await r.publish(store(1))
        r.pub.drop_next(1)
        await r.publish(store(2))  # never sent live
        seq = await r.publish(store(3))
        await r.applied_through(seq)
        assert [await held(r.index, s) for s in (1, 2, 3)] == [3, 3, 3]
        assert r.sub.status.gaps == 1 and r.obs.gaps == 1
        assert r.sub.status.resyncs == 0


async def test_a_first_batch_lost_live_is_replayed() -> None:
    # The start's replay found an empty buffer, so nothing is applied yet; the engine's
    # first batch then misses the subscriber (a PUB socket drops what it sends before
    # the subscription reaches it): the next batch's seq 1 is a gap from 0.
    async with rig() as r:
        assert r.sub.status.last_seq is None
        r.pub.drop_next(1)
        await r.publish(store(1))  # seq 0: never sent live
        seq = await r.publish(store(2))
        await r.applied_through(seq)
        assert [await held(r.index, s) for s in (1, 2)] == [3, 3]
        assert r.sub.status.gaps == 1 and r.obs.gaps == 1
        assert r.sub.status.resyncs == 0


async def test_without_a_replay_a_first_batch_lost_live_stays_lost_quietly() -> None:
    # Nothing to fill the gap with, and nothing applied to clear: the batch that arrives
    # is applied, and no gap or resync is counted (a router starting beside a running
    # engine without a replay socket sees this every time).
    async with rig(replay=False) as r:
        r.pub.drop_next(1)
        await r.publish(store(1))
        seq = await r.publish(store(2))
        await r.applied_through(seq)
        assert [await held(r.index, s) for s in (1, 2)] == [0, 3]
        assert r.sub.status.gaps == 0 and r.sub.status.resyncs == 0


async def test_gap_with_legacy_encoding_and_replay_format() -> None:
    async with rig(legacy=True) as r:
        await r.publish(store(1))
        r.pub.drop_next(2)
        await r.publish(store(2))
        await r.publish(remove(1))
        seq = await r.publish(store(3))
        await r.applied_through(seq)
        assert [await held(r.index, s) for s in (1, 2, 3)] == [0, 3, 3]
        assert r.sub.status.gaps == 1


async def test_replay_that_lost_history_clears_the_replica() -> None:
    async with rig() as r:
        await r.applied_through(await r.publish(store(1)))
        r.pub.drop_next(1)
        await r.publish(remove(1))  # lost: never sent, and the buffer forgets it
        r.pub.forget()
        seq = await r.publish(store(2))
        await r.applied_through(seq)
        # Without the clear, block 1 would stay indexed although the engine removed it.
        assert await held(r.index, 1) == 0
        assert await held(r.index, 2) == 3
        assert r.sub.status.resyncs == 1 and r.obs.resyncs == ["history_lost"]


async def test_failed_replay_clears_and_repopulates() -> None:
    dead = "tcp://127.0.0.1:1"  # nothing listens there
    async with rig(replay_endpoint=dead) as r:
        await r.applied_through(await r.publish(store(1)))
        r.pub.drop_next(1)
        await r.publish(store(2))
        seq = await r.publish(store(3))
        await r.applied_through(seq)
        assert [await held(r.index, s) for s in (1, 2, 3)] == [0, 0, 3]
        assert r.obs.resyncs == ["replay_failed"]
        assert r.sub.status.last_error is not None


async def test_sequence_going_backwards_means_restart() -> None:
    async with rig() as r:
        await r.publish(store(1))
        await r.applied_through(await r.publish(store(2)))
        r.pub.restart()  # seq from 0 again, no AllBlocksCleared
        await r.publish(store(3))
        await eventually(lambda: r.obs.resyncs == ["restart"])
        await r.applied_through(0)
        await eventually(lambda: r.sub.status.batches >= 3)
        assert [await held(r.index, s) for s in (1, 2, 3)] == [0, 0, 3]
        seq = await r.publish(store(4))
        await r.applied_through(seq)
        assert await held(r.index, 4) == 3 and r.sub.status.gaps == 0


async def test_all_blocks_cleared_event() -> None:
    async with rig() as r:
        await r.publish(store(1))
        await r.applied_through(await r.publish(AllBlocksCleared(), store(2)))
        assert await held(r.index, 1) == 0 and await held(r.index, 2) == 3


async def test_poison_pill_is_counted_and_skipped() -> None:
    async with rig() as r:
        await r.pub.publish_raw(b"\xc1 not a batch")
        seq = await r.publish(store(1))
        await r.applied_through(seq)
        assert await held(r.index, 1) == 3
        assert r.sub.status.undecodable == 1 and r.obs.drops == ["undecodable"]
        assert r.sub.status.gaps == 0


async def test_index_outage_degrades_then_rebuilds_from_replay() -> None:
    index = FlakyIndex()
    async with rig(index=index) as r:
        await r.applied_through(await r.publish(store(1)))
        index.down = True
        await r.applied_through(await r.publish(store(2)))
        await eventually(lambda: r.sub.status.state == "degraded")
        assert "index_unavailable" in r.obs.drops
        index.down = False
        # The next housekeeping tick clears the replica and replays from 0.
        await eventually(lambda: r.sub.status.state == "live")
        assert r.obs.resyncs == ["index_outage"]
        assert [await held(index, s) for s in (1, 2)] == [3, 3]


async def test_repeated_unknown_parents_trigger_a_rebuild() -> None:
    async with rig() as r:
        await r.publish(store(1))
        orphan = BlockStored([777], 123456, prompt(9, 1), BS, None, "GPU", None)
        for _ in range(3):
            await r.publish(orphan)
        await eventually(lambda: r.obs.resyncs == ["unknown_parent"])
        # The rebuild replayed everything: block 1 is back, the orphans stay out.
        await eventually(lambda: r.sub.status.state == "live")
        assert await held(r.index, 1) == 3


async def test_fetch_replay_times_out_on_a_silent_peer() -> None:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    raw = router.getsockopt(zmq.LAST_ENDPOINT)
    endpoint = raw.decode() if isinstance(raw, bytes) else str(raw)
    try:
        with pytest.raises(Exception, match="timed out"):
            await fetch_replay(ctx, endpoint, 0, timeout_s=0.1, total_s=1.0)
    finally:
        router.close(linger=0)
        ctx.destroy(linger=0)


def test_backoff_grows_and_is_capped() -> None:
    b = Backoff(0.1, 1.0, rng=random.Random(0))
    assert b.compute(0) == 0.0
    waits = [b.compute(n) for n in range(1, 10)]
    assert all(0.05 <= w <= 1.0 for w in waits)
    assert max(waits[:2]) <= 0.2 and min(waits[5:]) >= 0.5
