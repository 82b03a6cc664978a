"""KV event ingestion as the router sees it: a malformed event on a real ZMQ stream does
not stop it, and a router whose ingestion fails says so in ``/ready`` and in metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry

from index.event_applier import BatchResult, EventIngestor
from index.events import BlockStored
from kvkeys.types import ReplicaId
from replica.sim.kv_publisher import KVEventPublisher
from router.app import create_app
from router.config import RouterSettings
from tests.router.fake_replica import FakeReplica
from tests.router.helpers import FAST_HEALTH
from tests.router.server import run_server

MODEL = "m"
BS = 4


@dataclass
class Setup:
    url: str
    http: aiohttp.ClientSession
    prom: CollectorRegistry
    pubs: dict[str, KVEventPublisher]

    def metric(self, name: str, **labels: str) -> float | None:
        return self.prom.get_sample_value(name, labels)

    async def ready(self) -> tuple[int, dict[str, Any]]:
        async with self.http.get(self.url + "/ready") as resp:
            return resp.status, await resp.json()


def store(seed: int, bad_token: int | None = None) -> BlockStored:
    tokens = [seed * 100 + i for i in range(2 * BS)]
    if bad_token is not None:
        tokens[1] = bad_token
    return BlockStored([seed * 10, seed * 10 + 1], None, tokens, BS, None, "GPU", None)


async def eventually(cond: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def setup_factory() -> AsyncIterator[Any]:
    async with AsyncExitStack() as stack:
        ctx = zmq.asyncio.Context()
        stack.callback(ctx.destroy, 0)

        async def start(**overrides: Any) -> Setup:
            fakes = [await stack.enter_async_context(FakeReplica(n)) for n in ("a", "b")]
            pubs: dict[str, KVEventPublisher] = {}
            replicas = []
            for fake in fakes:
                pub = KVEventPublisher("tcp://127.0.0.1:0", bind=True, context=ctx,
                                       replay_endpoint="tcp://127.0.0.1:0")  # fmt: skip
                await stack.enter_async_context(pub)
                pubs[fake.name] = pub
                replicas.append({"url": fake.url, "id": fake.name, "models": [MODEL],
                                 "kv_events_endpoint": pub.endpoint,
                                 "replay_endpoint": pub.resolved_replay_endpoint})  # fmt: skip
            settings = RouterSettings.model_validate({
                "replicas": replicas, "policy": "kv", "health": dict(FAST_HEALTH),
                "scoring": {"models": [{"name": MODEL, "block_size": BS}],
                            "scrape": {"enabled": False}},
                **overrides,
            })  # fmt: skip
            prom = CollectorRegistry()
            app = create_app(settings, registry=prom)
            url = await stack.enter_async_context(run_server(app))
            http = await stack.enter_async_context(aiohttp.ClientSession())
            return Setup(url, http, prom, pubs)

        yield start


def connected(s: Setup, replicas: Sequence[str] = ("a", "b")) -> bool:
    return all(s.metric("router_kv_events_connected", replica=r) == 1.0 for r in replicas)


async def test_a_malformed_event_leaves_every_stream_connected_and_ready(
    setup_factory: Any,
) -> None:
    s: Setup = await setup_factory()

    async def all_connected() -> bool:
        return connected(s)

    await eventually(all_connected)
    await s.pubs["a"].publish([store(1, bad_token=-1)])
    seq_a = await s.pubs["a"].publish([store(2)])
    seq_b = await s.pubs["b"].publish([store(3)])

    async def applied() -> bool:
        return (s.metric("router_kv_events_last_seq", replica="a") == seq_a
                and s.metric("router_kv_events_last_seq", replica="b") == seq_b)  # fmt: skip

    await eventually(applied)
    assert connected(s)
    assert s.metric("router_kv_events_dropped_total", replica="a",
                    reason="invalid_token_ids") == 1.0  # fmt: skip
    assert s.metric("router_kv_events_ingestion_up") == 1.0
    status, body = await s.ready()
    assert status == 200 and body["ready"] is True
    assert body["kv_events"]["ok"] is True and body["kv_events"]["connected"] == 2
    assert body["kv_events"]["sources"] == {"a": "live", "b": "live"}
    assert body["degraded"] == []


@pytest.mark.parametrize("require", [False, True])
async def test_a_failing_subscriber_shows_in_ready_and_metrics(
    setup_factory: Any, monkeypatch: pytest.MonkeyPatch, require: bool
) -> None:
    real_apply = EventIngestor.apply

    async def apply(self: EventIngestor, batch: Any) -> BatchResult:
        if self.replica == ReplicaId("a") and batch.events:
            raise RuntimeError("injected bug")
        return await real_apply(self, batch)

    monkeypatch.setattr(EventIngestor, "apply", apply)
    s: Setup = await setup_factory(readiness={"require_kv_events": require})

    async def all_connected() -> bool:
        return connected(s)

    await eventually(all_connected)
    await s.pubs["a"].publish([store(1)])

    async def down() -> bool:
        return s.metric("router_kv_events_ingestion_up") == 0.0

    await eventually(down)
    status, body = await s.ready()
    assert status == (503 if require else 200)
    assert body["degraded"] == ["kv_events"]
    assert body["kv_events"]["ok"] is False
    assert "injected bug" in body["kv_events"]["failing"]["kv:a"]
    restarts = s.metric("router_kv_events_source_restarts_total", source="kv:a")
    assert restarts is not None and restarts >= 1
    # The other replica's stream is untouched.
    seq_b = await s.pubs["b"].publish([store(3)])

    async def b_applied() -> bool:
        return s.metric("router_kv_events_last_seq", replica="b") == seq_b

    await eventually(b_applied)
