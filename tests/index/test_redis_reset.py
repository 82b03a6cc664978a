"""Replica identity in the shared Redis index survives Redis losing everything.

Two routers share a Redis index and ingest real ZMQ event streams.  Redis is flushed
mid-run and the replicas are registered again in another order (so bit positions move);
every replica's blocks, those stored before the flush included, must come back under the
right replica, as both routers see them.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import zmq.asyncio

from index.events import BlockStored
from index.ingestion import KVEventIngestion, LeaseSettings, SourceSpec
from index.redis_store import RedisIndex
from index.subscriber import SubscriberSettings
from kvkeys.keys import block_keys
from kvkeys.types import PrefixHits, ReplicaHit, ReplicaId
from replica.sim.kv_publisher import KVEventPublisher

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
NS = "kvreset"
BS = 4
FAST = SubscriberSettings(
    idle_poll_s=0.02, replay_timeout_s=0.3, replay_total_s=2.0, recover_interval_s=0.05,
    resync_min_interval_s=0.0, backoff_base_s=0.02, backoff_cap_s=0.2,
)  # fmt: skip


def tokens(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BS)]


def stored(seed: int, blocks: int) -> BlockStored:
    hashes: list[int | bytes] = [seed * 100 + i for i in range(blocks)]
    return BlockStored(hashes, None, tokens(seed, blocks), BS, None, "GPU", None)


@dataclass
class Router:
    index: RedisIndex
    ingestion: KVEventIngestion
    task: asyncio.Task[None]


async def eventually(cond: Any, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@pytest.fixture
async def redis_server(private_redis: Any) -> AsyncIterator[str]:
    yield private_redis.url


async def register(url: str, order: list[ReplicaId]) -> None:
    """Hand out bit positions in ``order`` (a clear is a replica's first write)."""
    idx = RedisIndex.from_url(url, key_prefix=NS, op_timeout_s=1.0)
    try:
        for rid in order:
            await idx.clear(rid)
    finally:
        await idx.aclose()


@pytest.mark.parametrize("lease", [True, False])
async def test_blocks_come_back_under_the_right_replica_after_a_flush(
    redis_server: str, lease: bool
) -> None:
    url = redis_server
    sync = redis.Redis.from_url(url)
    ctx = zmq.asyncio.Context()
    # Sizes differ per replica, so a block attributed to the wrong one shows.
    blocks = {A: 2, B: 3, C: 4}
    seeds = {A: 1, B: 2, C: 3}
    await register(url, [A, B, C])
    assert sync.hgetall(f"{NS}:rid") == {b"a": b"0", b"b": b"1", b"c": b"2"}
    async with contextlib.AsyncExitStack() as stack:
        pubs: dict[ReplicaId, KVEventPublisher] = {}
        for rid in (A, B, C):
            pubs[rid] = await stack.enter_async_context(KVEventPublisher(
                "tcp://127.0.0.1:0", bind=True, context=ctx, buffer_steps=100,
                replay_endpoint="tcp://127.0.0.1:0"))  # fmt: skip
        specs = {rid: SourceSpec(rid, model="m", endpoint=p.endpoint,
                                 replay_endpoint=p.resolved_replay_endpoint)
                 for rid, p in pubs.items()}  # fmt: skip
        # Two routers; with leases both ingest every replica (one holds each lease), in
        # opposite orders; without, each ingests its own replicas.
        plans = ([[A, B, C], [C, B, A]] if lease else [[B, A], [C]])
        routers: list[Router] = []
        for n, plan in enumerate(plans):
            idx = RedisIndex.from_url(url, key_prefix=NS, op_timeout_s=1.0, epoch_check_s=0.2)
            stack.push_async_callback(idx.aclose)
            ls = None
            if lease:
                client = aioredis.Redis.from_url(url)
                stack.push_async_callback(client.aclose)
                ls = LeaseSettings(client, key_prefix=NS, ttl_s=1.5, owner=f"router{n}",
                                   status_interval_s=0.1)  # fmt: skip
            ing = KVEventIngestion(idx, [specs[r] for r in plan], settings=FAST, lease=ls,
                                   context=ctx)  # fmt: skip
            task = asyncio.create_task(ing.run())
            routers.append(Router(idx, ing, task))

        async def stop() -> None:
            for r in routers:
                r.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await r.task

        stack.push_async_callback(stop)

        async def attributed(seed: int, rid: ReplicaId, n: int) -> bool:
            keys = block_keys(tokens(seed, n), BS, model="m")
            for r in routers:
                hits: PrefixHits = await r.index.lookup(keys)
                if hits.by_replica != {rid: ReplicaHit(gpu_blocks=n)}:
                    return False
            return True

        async def all_back(extra: int = 0) -> bool:
            for rid in (A, B, C):
                if not await attributed(seeds[rid], rid, blocks[rid]):
                    return False
                if extra and not await attributed(seeds[rid] + extra, rid, blocks[rid]):
                    return False
            return True

        async def everyone_live() -> bool:
            return all(
                any((st := r.ingestion.status(rid)) is not None and st.state == "live"
                    for r in routers)
                for rid in (A, B, C)
            )  # fmt: skip

        await eventually(everyone_live)
        for rid in (A, B, C):
            await pubs[rid].publish([stored(seeds[rid], blocks[rid])])
        await eventually(all_back)

        # Redis loses everything, and (atomically, so no router writes first) another
        # router registers the replicas again in another order: a and c swap bits.
        with sync.pipeline(transaction=True) as pipe:
            pipe.flushall()
            pipe.hset(f"{NS}:meta", mapping={"stride": 256, "layout": 2, "next_rid": 3,
                                             "epoch": uuid.uuid4().hex})  # fmt: skip
            pipe.hset(f"{NS}:rid", mapping={"c": 0, "b": 1, "a": 2})
            pipe.hset(f"{NS}:rname", mapping={0: "c", 1: "b", 2: "a"})
            pipe.execute()
        # A new store on one replica while the others stay idle.
        await pubs[A].publish([stored(seeds[A] + 10, blocks[A])])
        await eventually(lambda: all_back())
        await eventually(lambda: attributed(seeds[A] + 10, A, blocks[A]))
        # And after the rebuild, new events keep going to the right replica.
        for rid in (A, B, C):
            await pubs[rid].publish([stored(seeds[rid] + 20, blocks[rid])])
        await eventually(lambda: all_back(extra=20))
    ctx.destroy(linger=0)
    sync.close()
