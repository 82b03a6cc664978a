"""RedisIndex specifics: key layout, TTLs, one round trip, outages, lease takeover."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import zmq.asyncio

from index.events import BlockRemoved, BlockStored
from index.ingestion import KVEventIngestion, LeaseSettings, SourceSpec
from index.lease import RedisLease, run_with_lease
from index.memory import InMemoryIndex
from index.redis_store import RedisIndex
from index.store import IndexUnavailable
from index.subscriber import ConnectSubscriber, EventSource, SubscriberSettings
from kvkeys.keys import block_keys
from kvkeys.types import EngineKey, Medium, ReplicaHit, ReplicaId, RequestKey
from replica.sim.kv_publisher import KVEventPublisher

A, B = ReplicaId("a"), ReplicaId("b")
FAST = SubscriberSettings(
    idle_poll_s=0.02, replay_timeout_s=0.3, replay_total_s=2.0, recover_interval_s=0.05
)


def chain(n: int, seed: int = 0) -> list[RequestKey]:
    return block_keys([seed * 1000 + i for i in range(4 * n)], 4, model="m")


def ek(keys: list[RequestKey]) -> list[EngineKey]:
    return [EngineKey(k ^ 0xABCDEF) for k in keys]


async def eventually(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@pytest.fixture
async def rindex(redis_url: str, redis_namespace: str) -> AsyncIterator[RedisIndex]:
    idx = RedisIndex.from_url(redis_url, key_prefix=redis_namespace, op_timeout_s=2.0, ttl_s=600)
    yield idx
    await idx.aclose()


@pytest.fixture
def sync_redis(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def hexkey(k: int) -> str:
    return f"{k:016x}"


async def test_key_layout_and_ttls(rindex: RedisIndex, sync_redis: redis.Redis) -> None:
    ns = rindex.ns
    keys = chain(2)
    k0, k1 = hexkey(keys[0]), hexkey(keys[1])
    e0, e1 = (hexkey(e) for e in ek(keys))
    await rindex.add(A, ek(keys), keys)
    await rindex.add(B, ek(keys[:1]), keys[:1], Medium.CPU)
    found = {k.decode() for k in sync_redis.scan_iter(match=f"{ns}:*")}
    assert found == {
        f"{ns}:meta", f"{ns}:rid", f"{ns}:rname", f"{ns}:m:{k0}", f"{ns}:m:{k1}",
        f"{ns}:e:a", f"{ns}:r:a", f"{ns}:e:b", f"{ns}:r:b",
    }  # fmt: skip
    assert sync_redis.hmget(f"{ns}:meta", ["stride", "layout"]) == [b"256", b"2"]
    assert sync_redis.hgetall(f"{ns}:rid") == {b"a": b"0", b"b": b"1"}
    # Bit tier * stride + rid: A on GPU at bit 0, B on CPU at bit 256 + 1.
    assert sync_redis.getbit(f"{ns}:m:{k0}", 0) == 1
    assert sync_redis.getbit(f"{ns}:m:{k0}", 257) == 1
    assert sync_redis.bitcount(f"{ns}:m:{k0}") == 2
    # Engine key -> "request key, reference counts per tier"; request key + tier -> count.
    assert sync_redis.hget(f"{ns}:e:a", e1) == f"{k1} 1 0 0".encode()
    assert sync_redis.hget(f"{ns}:e:b", e0) == f"{k0} 0 1 0".encode()
    assert sync_redis.hget(f"{ns}:r:b", f"{k0}1") == b"1"
    for key in (f"{ns}:m:{k0}", f"{ns}:e:a", f"{ns}:e:b", f"{ns}:r:a"):
        assert 0 < sync_redis.ttl(key) <= 600
    # Everything removed: the per-block keys go away, the per-replica hashes empty out.
    await rindex.evict(A, ek(keys))
    await rindex.evict(B, ek(keys[:1]), Medium.CPU)
    assert not sync_redis.exists(f"{ns}:m:{k0}", f"{ns}:m:{k1}")
    assert sync_redis.hlen(f"{ns}:e:a") == 0 and sync_redis.hlen(f"{ns}:r:b") == 0
    assert await rindex.blocks(A) == 0


async def test_a_namespace_of_another_layout_is_refused(
    redis_url: str, redis_namespace: str, sync_redis: redis.Redis
) -> None:
    # A namespace written by kvroute's first layout (decimal keys) has no layout field.
    sync_redis.hset(f"{redis_namespace}:meta", mapping={"stride": "256", "next_rid": "1"})
    idx = RedisIndex.from_url(redis_url, key_prefix=redis_namespace)
    try:
        keys = chain(1)
        with pytest.raises(ValueError, match="layout"):
            await idx.add(A, ek(keys), keys)
    finally:
        await idx.aclose()


async def test_lookup_is_one_round_trip(rindex: RedisIndex, sync_redis: redis.Redis) -> None:
    keys = chain(50)
    await rindex.add(A, ek(keys), keys)
    await rindex.lookup(keys)  # names cached, script loaded

    def calls() -> dict[str, int]:
        stats = sync_redis.info("commandstats")
        return {k: v["calls"] for k, v in stats.items() if k != "cmdstat_info"}

    before = calls()
    hits = await rindex.lookup(keys)
    after = calls()
    assert hits.by_replica == {A: ReplicaHit(50)}
    changed = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    # The MGET inside the script counts too; the client sent exactly one EVALSHA.
    assert changed.pop("cmdstat_evalsha") == 1
    assert set(changed) <= {"cmdstat_mget"}


async def test_stride_is_fixed_per_namespace(redis_url: str, redis_namespace: str) -> None:
    small = RedisIndex.from_url(redis_url, key_prefix=redis_namespace, max_replicas=2)
    other = RedisIndex.from_url(redis_url, key_prefix=redis_namespace, max_replicas=4)
    try:
        keys = chain(1)
        await small.add(A, ek(keys), keys)
        await small.add(B, ek(keys), keys)
        with pytest.raises(IndexUnavailable, match="max_replicas"):
            await small.add(ReplicaId("c"), ek(keys), keys)
        with pytest.raises(ValueError, match="max_replicas=2"):
            await other.add(A, ek(keys), keys)
    finally:
        await small.aclose()
        await other.aclose()


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """SIGSTOP a server: connections stay open, nothing answers."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def recovered(idx: RedisIndex, keys: list[RequestKey], timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return (await idx.lookup(keys)).blocks(A)
        except IndexUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


async def test_paused_redis_degrades_fast_and_recovers(private_redis: Any) -> None:
    idx = RedisIndex.from_url(private_redis.url, key_prefix="kvt", op_timeout_s=0.05)
    try:
        keys = chain(5)
        await idx.add(A, ek(keys), keys)
        assert (await idx.lookup(keys)).blocks(A) == 5
        with paused(private_redis.process.pid):
            for _ in range(3):
                t0 = time.monotonic()
                with pytest.raises(IndexUnavailable):
                    await idx.lookup(keys)
                assert time.monotonic() - t0 < 0.5
        assert await recovered(idx, keys) == 5
    finally:
        await idx.aclose()


async def test_killed_redis_fails_fast_and_reconnects(redis_server_factory: Any) -> None:
    server = redis_server_factory(None)
    idx = RedisIndex.from_url(server.url, key_prefix="kvt", op_timeout_s=0.05)
    try:
        keys = chain(3)
        await idx.add(A, ek(keys), keys)
        server.stop()
        t0 = time.monotonic()
        with pytest.raises(IndexUnavailable):
            await idx.lookup(keys)
        with pytest.raises(IndexUnavailable):
            await idx.add(A, ek(keys), keys)
        assert time.monotonic() - t0 < 1.0
        redis_server_factory(server.port)  # back, empty (no persistence)
        assert await recovered(idx, keys) == 0
        await idx.add(A, ek(keys), keys)
        assert (await idx.lookup(keys)).blocks(A) == 3
    finally:
        await idx.aclose()


def tokens(seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(8)]


def stored(seed: int) -> BlockStored:
    return BlockStored([seed * 10, seed * 10 + 1], None, tokens(seed), 4, None, "GPU", None)


async def test_nothing_stale_survives_an_outage(private_redis: Any) -> None:
    ctx = zmq.asyncio.Context()
    idx = RedisIndex.from_url(private_redis.url, key_prefix="kvt", op_timeout_s=0.1,
                              write_timeout_s=0.2)  # fmt: skip
    keys1 = block_keys(tokens(1), 4, model="m")
    keys2 = block_keys(tokens(2), 4, model="m")
    async with KVEventPublisher("tcp://127.0.0.1:0", bind=True, context=ctx,
                                replay_endpoint="tcp://127.0.0.1:0") as pub:  # fmt: skip
        src = EventSource(A, "m", pub.endpoint, pub.resolved_replay_endpoint)
        sub = ConnectSubscriber(src, idx, ctx, settings=FAST)
        task = asyncio.create_task(sub.run())
        try:
            await eventually(lambda: sub.status.connected and sub.status.state == "live")
            await pub.publish([stored(1)])
            await eventually(lambda: sub.status.last_seq == 0)
            assert (await idx.lookup(keys1)).blocks(A) == 2
            with paused(private_redis.process.pid):
                await pub.publish([BlockRemoved([10, 11], "GPU")])  # lost while Redis is away
                await pub.publish([stored(2)])
                await eventually(lambda: sub.status.state == "degraded")
            await eventually(lambda: sub.status.state == "live" and sub.status.resyncs == 1)
            assert (await idx.lookup(keys1)).blocks(A) == 0  # the removal was not lost
            assert (await idx.lookup(keys2)).blocks(A) == 2
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    await idx.aclose()
    ctx.destroy(linger=0)


async def test_lease_exclusive_expiry_and_release(redis_url: str, redis_namespace: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    key = f"{redis_namespace}:lease:x"
    a = RedisLease(client, key, "a", ttl_s=1.0)
    b = RedisLease(client, key, "b", ttl_s=1.0)
    try:
        await client.ping()  # connect outside the lease's short timeouts
        assert await a.try_acquire() and a.valid()
        assert not await b.try_acquire()
        assert await a.try_acquire()  # re-acquiring our own lease renews it
        assert await a.renew() and await a.holder() == "a"
        await asyncio.sleep(1.05)  # a stops renewing (crashed or paused)
        assert not a.valid()
        assert await b.try_acquire() and await b.holder() == "b"
        assert not await a.renew() and not a.valid()
        await a.release()  # not ours any more: no effect
        assert await b.holder() == "b"
        await b.release()
        assert await b.holder() is None
    finally:
        await client.aclose()


async def test_run_with_lease_hands_over_on_cancel(redis_url: str, redis_namespace: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    key = f"{redis_namespace}:lease:y"
    running: list[str] = []

    def worker(name: str) -> Callable[[], Coroutine[Any, Any, None]]:
        async def work() -> None:
            running.append(name)
            try:
                await asyncio.Event().wait()
            finally:
                running.remove(name)

        return work

    tasks: dict[str, asyncio.Task[None]] = {}

    async def stop(name: str) -> None:
        tasks[name].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tasks[name]

    try:
        for name in ("a", "b"):
            lease = RedisLease(client, key, name, ttl_s=1.5)
            tasks[name] = asyncio.create_task(run_with_lease(lease, worker(name)))
            await eventually(lambda: bool(running))
        await asyncio.sleep(0.2)
        assert running == ["a"]  # b stands by
        await stop("a")  # releases the lease: b takes over well before it would expire
        t0 = time.monotonic()
        await eventually(lambda: running == ["b"])
        assert time.monotonic() - t0 < 1.4
        await stop("b")
        assert running == []
    finally:
        for name in tasks:
            await stop(name)
        await client.aclose()


async def test_two_ingesters_one_owner_and_takeover(redis_url: str, redis_namespace: str) -> None:
    ctx = zmq.asyncio.Context()
    client = aioredis.Redis.from_url(redis_url)
    keys = block_keys(tokens(1), 4, model="m")
    async with KVEventPublisher("tcp://127.0.0.1:0", bind=True, context=ctx,
                                replay_endpoint="tcp://127.0.0.1:0") as pub:  # fmt: skip
        spec = SourceSpec(A, model="m", endpoint=pub.endpoint,
                          replay_endpoint=pub.resolved_replay_endpoint)  # fmt: skip
        ingesters = []
        tasks = []
        for name in ("one", "two"):
            idx = RedisIndex.from_url(redis_url, key_prefix=redis_namespace, op_timeout_s=1.0)
            lease = LeaseSettings(client, key_prefix=redis_namespace, ttl_s=1.5, owner=name,
                                  status_interval_s=0.05)  # fmt: skip
            ing = KVEventIngestion(idx, [spec], settings=FAST, lease=lease, context=ctx)
            ingesters.append((ing, idx))
            tasks.append(asyncio.create_task(ing.run()))
            await asyncio.sleep(0.1)
        one, two = ingesters[0][0], ingesters[1][0]
        try:
            await eventually(lambda: (one.status(A) or _none()).state == "live")
            await pub.publish([stored(1)])
            await eventually(lambda: (one.status(A) or _none()).last_seq == 0)
            # The standby reads the owner's status through Redis.
            await eventually(
                lambda: (
                    (two.status(A) or _none()).owner == "one"
                    and (two.status(A) or _none()).last_seq == 0
                )
            )
            assert (await ingesters[1][1].lookup(keys)).blocks(A) == 2
            tasks[0].cancel()  # the owner goes away (its lease is released)
            with contextlib.suppress(asyncio.CancelledError):
                await tasks[0]
            await eventually(lambda: (two.status(A) or _none()).state == "live")
            await pub.publish([stored(2)])
            await eventually(lambda: (two.status(A) or _none()).last_seq == 1)
            # The new owner rebuilt from replay: both batches are indexed.
            assert (await ingesters[1][1].lookup(keys)).blocks(A) == 2
            keys2 = block_keys(tokens(2), 4, model="m")
            assert (await ingesters[1][1].lookup(keys2)).blocks(A) == 2
        finally:
            for t in tasks:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            for _, idx in ingesters:
                await idx.aclose()
    await client.aclose()
    ctx.destroy(linger=0)


def _none() -> Any:
    from index.status import SourceStatus

    return SourceStatus(ReplicaId("none"), "m", None, state="stopped")


async def test_start_up_refuses_a_namespace_it_cannot_share(
    redis_url: str, redis_namespace: str, sync_redis: redis.Redis
) -> None:
    from router.config import ConfigError
    from router.kv_stack import check_index

    await check_index(InMemoryIndex())  # nothing to check
    sync_redis.hset(f"{redis_namespace}:meta", mapping={"stride": "256", "next_rid": "3"})
    idx = RedisIndex.from_url(redis_url, key_prefix=redis_namespace)
    unreachable = RedisIndex.from_url("redis://127.0.0.1:1/0", key_prefix=redis_namespace)
    fresh = RedisIndex.from_url(redis_url, key_prefix=f"{redis_namespace}-fresh")
    try:
        with pytest.raises(ConfigError, match="index: .*layout"):
            await check_index(idx)
        await check_index(unreachable)  # degraded, not refused: the first write checks
        await check_index(fresh)
        assert sync_redis.hgetall(f"{redis_namespace}-fresh:meta") == {
            b"stride": b"256", b"layout": b"2"
        }
    finally:
        for i in (idx, unreachable, fresh):
            await i.aclose()
        sync_redis.delete(f"{redis_namespace}-fresh:meta")
