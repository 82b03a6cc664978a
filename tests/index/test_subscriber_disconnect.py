"""A dead engine's entries leave the index after ``disconnect_grace_s``; a blip does not
clear.  Real ZMQ sockets on loopback, ``KVEventPublisher`` as the engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from index.event_applier import BatchResult
from index.events import BlockStored
from index.memory import InMemoryIndex
from index.subscriber import BindSubscriber, ConnectSubscriber, EventSource, SubscriberSettings
from kvkeys.keys import block_keys
from kvkeys.types import ReplicaId
from replica.sim.kv_publisher import KVEventPublisher
from tests.ports import free_port

R = ReplicaId("r1")
MODEL = "m"
BS = 4
TOPIC = "kv@r1@m"


def settings(grace: float) -> SubscriberSettings:
    return SubscriberSettings(
        idle_poll_s=0.02,
        replay_timeout_s=0.3,
        replay_total_s=2.0,
        recover_interval_s=0.05,
        disconnect_grace_s=grace,
    )


def prompt(seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(3 * BS)]


def store(seed: int) -> BlockStored:
    return BlockStored([seed * 100 + i for i in range(3)], None, prompt(seed), BS, None,
                       "GPU", None)  # fmt: skip


async def held(index: InMemoryIndex, seed: int) -> int:
    return (await index.lookup(block_keys(prompt(seed), BS, model=MODEL))).blocks(R)


async def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def held_becomes(index: InMemoryIndex, seed: int, blocks: int, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while await held(index, seed) != blocks:
        if loop.time() > deadline:
            raise AssertionError(f"block count of {seed} never became {blocks}")
        await asyncio.sleep(0.01)




class Recorder:
    """An ``IngestObserver`` keeping the resync reasons."""

    def __init__(self) -> None:
        self.resyncs: list[str] = []

    def batch_applied(self, replica: ReplicaId, result: BatchResult) -> None:
        pass

    def gap(self, replica: ReplicaId) -> None:
        pass

    def dropped(self, replica: ReplicaId, reason: str, count: int = 1) -> None:
        pass

    def resync(self, replica: ReplicaId, reason: str) -> None:
        self.resyncs.append(reason)


@dataclass
class Rig:
    ctx: zmq.asyncio.Context
    endpoint: str
    replay_endpoint: str
    index: InMemoryIndex
    sub: ConnectSubscriber
    obs: Recorder

    def engine(self) -> KVEventPublisher:
        """A publisher (not started) on the fixed endpoints: a fresh engine, seq from 0."""
        return KVEventPublisher(self.endpoint, bind=True, replay_endpoint=self.replay_endpoint,
                                topic=TOPIC, buffer_steps=100, context=self.ctx)  # fmt: skip


async def start(pub: KVEventPublisher) -> None:
    """Start ``pub``, retrying while the previous one's ports are still being released."""
    for _ in range(50):
        try:
            await pub.start()
            return
        except zmq.ZMQError:
            await pub.aclose()
            await asyncio.sleep(0.02)
    await pub.start()


@contextlib.asynccontextmanager
async def rig(grace: float) -> AsyncIterator[tuple[Rig, KVEventPublisher]]:
    ctx = zmq.asyncio.Context()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    index = InMemoryIndex()
    obs = Recorder()
    sub = ConnectSubscriber(EventSource(R, MODEL, endpoint, replay, "kv@r1"), index, ctx,
                            settings=settings(grace), observer=obs)  # fmt: skip
    r = Rig(ctx, endpoint, replay, index, sub, obs)
    pub = r.engine()
    await start(pub)
    task = asyncio.create_task(sub.run())
    try:
        await eventually(lambda: sub.status.connected and sub.status.state == "live")
        yield r, pub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pub.aclose()
        ctx.destroy(linger=0)


async def test_a_dead_engine_is_cleared_after_the_grace_and_rebuilt_when_back() -> None:
    grace = 1.0
    async with rig(grace) as (r, pub):
        await pub.publish([store(1)])
        await pub.publish([store(2)])
        await eventually(lambda: r.sub.status.last_seq == 1)
        assert await held(r.index, 1) == 3 and await held(r.index, 2) == 3
        reset_before = r.sub.status.last_reset_monotonic

        await pub.aclose()  # the engine dies
        loop = asyncio.get_running_loop()
        died = loop.time()
        await eventually(lambda: not r.sub.status.connected)
        await asyncio.sleep(0.2)
        still = await held(r.index, 1)
        # The grace runs from the disconnection, which came after ``died``: while less
        # than the grace has passed since ``died`` nothing may be cleared.  (A loaded
        # machine that got here later cannot tell, and only the clearing is checked.)
        if loop.time() - died < grace:
            assert still == 3, "cleared before the grace period ended"
        await held_becomes(r.index, 1, 0, timeout=grace + 5.0 - (loop.time() - died))
        assert await held(r.index, 2) == 0
        st = r.sub.status
        assert st.state == "disconnected" and not st.connected
        assert st.last_seq is None and st.resyncs == 1
        assert r.obs.resyncs == ["disconnected"]
        assert st.last_reset_monotonic is not None and reset_before is not None
        assert st.last_reset_monotonic > reset_before

        # A restarted engine on the same endpoints counts from 0 again; its first batch
        # is published before the subscriber is back (lost live), so only the replay
        # from 0 on reconnection can bring it in.
        pub2 = r.engine()
        await start(pub2)
        try:
            await pub2.publish([store(3)])
            await held_becomes(r.index, 3, 3, timeout=10.0)
            await eventually(lambda: r.sub.status.state == "live" and r.sub.status.connected)
            assert r.sub.status.last_seq == 0
            assert r.obs.resyncs == ["disconnected", "reconnect"]
            seq = await pub2.publish([store(4)])
            await eventually(lambda: r.sub.status.last_seq == seq)
            assert await held(r.index, 4) == 3
            assert [await held(r.index, s) for s in (1, 2)] == [0, 0]
            assert r.sub.status.gaps == 0
        finally:
            await pub2.aclose()


async def test_a_blip_shorter_than_the_grace_clears_nothing() -> None:
    grace = 2.0  # the blip must stay shorter than this however loaded the machine
    async with rig(grace) as (r, pub):
        await pub.publish([store(1)])
        await eventually(lambda: r.sub.status.last_seq == 0)
        loop = asyncio.get_running_loop()

        await pub.aclose()  # the same engine drops off the network briefly ...
        down = loop.time()
        await eventually(lambda: not r.sub.status.connected)
        await asyncio.sleep(0.1)
        await start(pub)  # ... and comes back with its sequence and replay buffer intact
        await eventually(lambda: r.sub.status.connected)
        assert loop.time() - down < grace
        seq = 0
        for seed in (2, 3):  # the first may be lost while the subscription propagates
            seq = await pub.publish([store(seed)])
        await eventually(lambda: r.sub.status.last_seq == seq)
        # Stay past the end of the grace period: nothing is cleared later either.
        await asyncio.sleep(max(0.0, grace + 0.3 - (loop.time() - down)))
        assert [await held(r.index, s) for s in (1, 2, 3)] == [3, 3, 3]
        st = r.sub.status
        assert st.state == "live" and st.connected and st.resyncs == 0
        assert r.obs.resyncs == []


async def test_bind_mode_clears_its_sources_once_no_engine_is_connected() -> None:
    # Bind mode sees only the bound SUB's peers as a whole (see ``index.subscriber``).
    grace = 0.5
    ctx = zmq.asyncio.Context()
    index = InMemoryIndex()
    replay = f"tcp://127.0.0.1:{free_port()}"
    sub = BindSubscriber("tcp://127.0.0.1:0", {TOPIC: EventSource(R, MODEL, None, replay, TOPIC)},
                         index, ctx, settings=settings(grace))  # fmt: skip
    task = asyncio.create_task(sub.run())
    pubs: list[KVEventPublisher] = []
    try:
        await asyncio.wait_for(sub.ready.wait(), 5)
        assert sub.bound_endpoint is not None

        def engine() -> KVEventPublisher:
            pubs.append(KVEventPublisher(sub.bound_endpoint or "", topic=TOPIC, context=ctx,
                                         replay_endpoint=replay, buffer_steps=100))  # fmt: skip
            return pubs[-1]

        def status() -> str:
            return sub.statuses()[R].state

        pub = engine()
        await start(pub)
        await eventually(lambda: sub.statuses()[R].connected and status() == "live")
        await pub.publish([store(1)])  # may be lost (slow joiner): replay brings it back
        await pub.publish([store(2)])
        try:
            await eventually(lambda: (sub.statuses()[R].last_seq or 0) >= 1, timeout=3.0)
        except AssertionError:
            # On a loaded machine both can precede the subscription: a later batch shows
            # the gap, and the replay brings every batch back.
            await pub.publish([store(4)])
        await eventually(lambda: (sub.statuses()[R].last_seq or 0) >= 1)
        await held_becomes(index, 1, 3, timeout=10.0)  # the replay of batch 0 lands too

        await pub.aclose()
        await held_becomes(index, 1, 0, timeout=grace + 5.0)
        assert status() == "disconnected" and sub.statuses()[R].resyncs == 1

        pub = engine()  # restarted: seq from 0
        await start(pub)
        await pub.publish([store(3)])
        await held_becomes(index, 3, 3, timeout=10.0)
        await eventually(lambda: status() == "live")
        assert [await held(index, s) for s in (1, 2)] == [0, 0]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for p in pubs:
            await p.aclose()
        ctx.destroy(linger=0)
