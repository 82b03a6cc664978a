"""Bind mode (engines connect to us, topics name replicas) and discovery from a replica URL."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from index.discovery import (
    DiscoveryError,
    discover_sources,
    offset_endpoint_port,
    parse_event_sources,
    resolve_endpoint,
)
from index.events import BlockStored
from index.ingestion import KVEventIngestion, SourceSpec
from index.memory import InMemoryIndex
from index.subscriber import BindSubscriber, EventSource, SubscriberSettings
from kvkeys.keys import block_keys
from kvkeys.types import ReplicaId, replica_id_for_rank
from replica.sim.kv_publisher import KVEventPublisher
from tests.loopback_app import serve_app

BS = 4
FAST = SubscriberSettings(idle_poll_s=0.02, replay_timeout_s=0.3, replay_total_s=2.0)


def store(seed: int) -> BlockStored:
    tokens = [seed * 1000 + i for i in range(2 * BS)]
    return BlockStored([seed * 10, seed * 10 + 1], None, tokens, BS, None, "GPU", None)


async def held(index: InMemoryIndex, replica: ReplicaId, seed: int, model: str) -> int:
    keys = block_keys([seed * 1000 + i for i in range(2 * BS)], BS, model=model)
    return (await index.lookup(keys)).blocks(replica)


async def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def test_bind_mode_routes_by_topic() -> None:
    ctx = zmq.asyncio.Context()
    index = InMemoryIndex()
    a, b = ReplicaId("pod-a"), ReplicaId("pod-b")
    sub = BindSubscriber("tcp://127.0.0.1:0", {}, index, ctx, settings=FAST)
    task = asyncio.create_task(sub.run())
    pubs: dict[str, KVEventPublisher] = {}
    try:
        await asyncio.wait_for(sub.ready.wait(), 5)
        assert sub.bound_endpoint is not None
        for topic in ("kv@pod-a@m", "kv@pod-b@m", "kv@stranger@m"):
            # vLLM's rule: a non-wildcard tcp endpoint makes the engine connect to us.
            pubs[topic] = KVEventPublisher(sub.bound_endpoint, topic=topic, context=ctx,
                                           replay_endpoint="tcp://127.0.0.1:0")  # fmt: skip
            await pubs[topic].start()
        for topic, rid in (("kv@pod-a@m", a), ("kv@pod-b@m", b)):
            src = EventSource(rid, "m", None, pubs[topic].resolved_replay_endpoint, topic)
            sub.add_source(topic, src)
        await eventually(lambda: all(r.status.connected for r in sub.runners.values()))
        await asyncio.sleep(0.2)  # let the subscription reach the publishers (slow joiner)
        await pubs["kv@pod-a@m"].publish([store(1)])
        await pubs["kv@pod-b@m"].publish([store(2)])
        await pubs["kv@stranger@m"].publish([store(3)])
        pubs["kv@pod-a@m"].drop_next(1)
        await pubs["kv@pod-a@m"].publish([store(4)])  # a gap, replayed from pod-a's ROUTER
        await pubs["kv@pod-a@m"].publish([store(5)])
        st = sub.statuses()
        await eventually(lambda: sub.statuses()[a].last_seq == 2 and sub.unmapped >= 1)
        await eventually(lambda: sub.statuses()[b].last_seq == 0)
        st = sub.statuses()
        assert st[a].gaps == 1 and st[b].gaps == 0
        assert [await held(index, a, s, "m") for s in (1, 2, 3, 4, 5)] == [2, 0, 0, 2, 2]
        assert [await held(index, b, s, "m") for s in (1, 2, 3)] == [0, 2, 0]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for p in pubs.values():
            await p.aclose()
        ctx.destroy(linger=0)


def test_parse_event_sources_rules() -> None:
    body = {
        "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
              "replay_endpoint": "tcp://*:5567", "topic": "t"},
        "1": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
              "replay_endpoint": "tcp://*:5567", "topic": "t"},
        "2": {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": "tcp://router.example:7000", "topic": "kv@x@m"},
        "3": {"enable_kv_cache_events": False, "endpoint": "tcp://*:1"},
    }  # fmt: skip
    found = parse_event_sources(body, "http://10.0.0.5:8000", ReplicaId("r"), "m",
                                bind_endpoints={"tcp://router.example:7000"})  # fmt: skip
    assert [(d.mode, d.dp_rank) for d in found] == [("connect", 0), ("connect", 1), ("bind", 2)]
    # Not one of ours to bind: a resolved tcp://*:0 (node ip and port) we connect to.
    plain = parse_event_sources(body, "http://10.0.0.5:8000", ReplicaId("r"), "m")
    assert plain[2].mode == "connect" and plain[2].source.endpoint == "tcp://router.example:7000"
    r0, r1, r2 = (d.source for d in found)
    assert (r0.replica, r0.endpoint, r0.replay_endpoint) == (
        "r", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5567")  # fmt: skip
    # Same unresolved endpoint on rank 1: vLLM's port + rank rule.
    assert (r1.replica, r1.endpoint, r1.replay_endpoint) == (
        replica_id_for_rank(ReplicaId("r"), 1),
        "tcp://10.0.0.5:5558",
        "tcp://10.0.0.5:5568",
    )
    assert r2.endpoint is None and found[2].bind_endpoint == "tcp://router.example:7000"
    assert r2.topic == "kv@x@m"
    assert resolve_endpoint("tcp://[::]:5", "::1") == "tcp://[::1]:5"
    assert resolve_endpoint("tcp://0.0.0.0:5", "h") == "tcp://h:5"
    assert resolve_endpoint("ipc:///tmp/x", "h") == "ipc:///tmp/x"
    assert offset_endpoint_port("inproc://x", 2) == "inproc://x_dp2"
    assert offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"
    with pytest.raises(ValueError):
        offset_endpoint_port("ipc:///tmp/x", 1)
    bad_bodies: list[Any] = [[], {"x": {}}, {"0": 5}, {"0": {"enable_kv_cache_events": True}}]
    for bad in bad_bodies:
        with pytest.raises(DiscoveryError):
            parse_event_sources(bad, "http://h:1", ReplicaId("r"), "m")


@contextlib.asynccontextmanager
async def fake_replica(sources: dict[str, Any] | None) -> AsyncIterator[str]:
    """A live HTTP server that answers like vLLM 0.31+ (``None``: like an older vLLM)."""

    async def kv_event_sources(request: web.Request) -> web.Response:
        if sources is None:
            return web.Response(status=404)
        return web.json_response(sources)

    async def models(request: web.Request) -> web.Response:
        cards = [{"id": "lora-x", "parent": "base-model"}, {"id": "base-model", "parent": None}]
        return web.json_response({"object": "list", "data": cards})

    app = web.Application()
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_get("/v1/models", models)
    async with serve_app(app) as url:
        yield url


async def test_discovery_from_replica_url_subscribes_every_dp_rank() -> None:
    ctx = zmq.asyncio.Context()
    async with contextlib.AsyncExitStack() as stack:
        pubs = [
            await stack.enter_async_context(
                KVEventPublisher("tcp://127.0.0.1:0", bind=True, data_parallel_rank=rank,
                                 replay_endpoint="tcp://127.0.0.1:0", context=ctx))
            for rank in (0, 1)
        ]  # fmt: skip
        # The engine reports wildcard endpoints; discovery puts the URL's host in.
        sources = {
            str(rank): {
                "enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
                "endpoint": "tcp://*:" + p.endpoint.rsplit(":", 1)[1],
                "replay_endpoint": "tcp://*:" + str(p.resolved_replay_endpoint).rsplit(":", 1)[1],
            }
            for rank, p in enumerate(pubs)
        }  # fmt: skip
        for rank, p in enumerate(pubs):
            await p.publish([store(rank + 1)])  # before the router even starts
        url = await stack.enter_async_context(fake_replica(sources))
        index = InMemoryIndex()
        ingestion = KVEventIngestion(
            index, [SourceSpec(ReplicaId("r"), url=url)], settings=FAST, context=ctx
        )
        task = asyncio.create_task(ingestion.run())
        try:
            r0, r1 = ReplicaId("r"), replica_id_for_rank(ReplicaId("r"), 1)
            await eventually(lambda: {r0, r1} <= set(ingestion.statuses()))
            await eventually(lambda: all(ingestion.statuses()[r].last_seq == 0 for r in (r0, r1)))
            assert ingestion.sources[r0].model == "base-model"
            assert ingestion.sources[r1].endpoint == pubs[1].endpoint
            await pubs[1].publish([store(3)])
            await eventually(lambda: ingestion.statuses()[r1].last_seq == 1)
            assert await held(index, r0, 1, "base-model") == 2
            assert await held(index, r1, 2, "base-model") == 2
            assert await held(index, r1, 3, "base-model") == 2
            assert await held(index, r0, 2, "base-model") == 0
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    ctx.destroy(linger=0)


async def test_discovery_errors() -> None:
    async with aiohttp.ClientSession() as http:
        async with fake_replica(None) as url:
            with pytest.raises(DiscoveryError) as info:
                await discover_sources(http, url, ReplicaId("r"), "m")
            assert info.value.unsupported
        with pytest.raises(DiscoveryError) as info:
            await discover_sources(http, "http://127.0.0.1:1", ReplicaId("r"), "m", timeout_s=1)
        assert not info.value.unsupported
