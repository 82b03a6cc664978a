"""Health checking with hysteresis, recovery, and the models union."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from kvkeys.types import ReplicaId
from router.config import ReplicaSettings
from router.replica_registry import ReplicaRegistry
from tests.router.conftest import StartFakes, StartRouter
from tests.router.helpers import chat

A, B = ReplicaId("a:1"), ReplicaId("b:1")


def _registry() -> ReplicaRegistry:
    return ReplicaRegistry(
        [ReplicaSettings(url="http://a:1"), ReplicaSettings(url="http://b:1", models=["m"])],
        fails_to_down=3, successes_to_up=2,
    )


def test_first_probe_is_taken_as_is_then_hysteresis() -> None:
    reg = _registry()
    changes: list[tuple[ReplicaId, bool]] = []
    reg.on_health_change(lambda r, ok: changes.append((r, ok)))
    assert reg.healthy_ids() == (A, B)  # optimistic until probed
    assert reg.record_probe(A, False) is False  # the first result counts at once
    assert reg.healthy_ids() == (B,)
    assert reg.record_probe(A, True) is None  # 1 of 2 successes
    assert reg.record_probe(A, False) is None  # streak broken
    assert reg.record_probe(A, True) is None
    assert reg.record_probe(A, True) is True
    assert reg.healthy_ids() == (A, B)
    assert reg.record_probe(B, True) is None  # first probe, already healthy
    for _ in range(2):
        assert reg.record_probe(B, False) is None
    assert reg.record_probe(B, False) is False
    assert changes == [(A, False), (A, True), (B, False)]


def test_candidates_and_models() -> None:
    reg = _registry()
    assert reg.candidates("m") == ((A, B), True)  # A's models are unknown: it may serve m
    reg.set_models(A, [{"id": "x"}])
    assert reg.candidates("m") == ((B,), True)
    assert reg.candidates("zzz") == ((), False)
    reg.set_models(B, [{"id": "ignored"}])  # configured models are never overwritten
    assert reg[B].models == ("m",)
    reg.record_probe(B, False)
    assert reg.candidates("m") == ((), True)
    assert reg.candidates(None) == ((A,), True)
    assert [c["id"] for c in reg.model_cards()] == ["x"]


async def _until(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_unhealthy_replica_gets_no_traffic_and_recovers(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    a, b = await fakes(2)
    url = await start_router([a, b], health={"interval_s": 0.1, "fails_to_down": 3})
    a_id = f"127.0.0.1:{a.port}"

    async def healthy_ids() -> list[str]:
        async with client.get(url + "/ready") as resp:
            ids: list[str] = (await resp.json())["healthy_replicas"]
            return ids

    a.behaviour.healthy = False
    hits = a.health_hits
    # hysteresis: one failed probe is not enough
    await _until(lambda: a.health_hits >= hits + 1)
    assert a_id in await healthy_ids()
    await _until(lambda: a.health_hits >= hits + 4)
    assert a_id not in await healthy_ids()
    before = len(a.completions())
    for _ in range(4):
        async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
            assert resp.headers["x-kvroute-replica"] == f"127.0.0.1:{b.port}"
    assert len(a.completions()) == before

    a.behaviour.healthy = True
    hits = a.health_hits
    await _until(lambda: a.health_hits >= hits + 3)
    assert a_id in await healthy_ids()
    replicas = set()
    for _ in range(4):
        async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
            replicas.add(resp.headers["x-kvroute-replica"])
    assert a_id in replicas


async def test_models_union_of_healthy_replicas(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    a, b = await fakes(2)
    a.behaviour.models = ["m", "x"]
    b.behaviour.models = ["m", "y"]
    url = await start_router([a, b])

    async def model_ids() -> list[str]:
        async with client.get(url + "/v1/models") as resp:
            data = await resp.json()
            assert data["object"] == "list"
            return sorted(card["id"] for card in data["data"])

    assert await model_ids() == ["m", "x", "y"]
    # requests for x only go to a
    for _ in range(3):
        async with client.post(url + "/v1/chat/completions", json=chat(model="x")) as resp:
            assert resp.headers["x-kvroute-replica"] == f"127.0.0.1:{a.port}"
    a.behaviour.healthy = False
    await _until(lambda: a.health_hits >= 3)
    deadline = time.monotonic() + 3
    while await model_ids() != ["m", "y"]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    async with client.post(url + "/v1/chat/completions", json=chat(model="x")) as resp:
        assert resp.status == 503  # known model, but its only replica is down
    async with client.post(url + "/v1/chat/completions", json=chat(model="zz")) as resp:
        assert resp.status == 404
