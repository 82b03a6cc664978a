"""Replicas that join and leave at run time: the file source (SIGHUP and change
detection), DNS re-resolution with an injected resolver, and draining, through the real
router app under uvicorn in front of fake replicas."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.config import RouterSettings
from router.membership_sources import Resolver
from tests.ports import free_port
from tests.router.fake_replica import Behaviour, FakeReplica
from tests.router.helpers import FAST_HEALTH, chat, scrape
from tests.router.server import run_server


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


async def _router(stack: AsyncExitStack, *, resolver: Resolver | None = None,
                  sighup: bool = True, **settings: Any) -> tuple[str, aiohttp.ClientSession]:
    data: dict[str, Any] = {"health": dict(FAST_HEALTH), "policy": "round_robin", **settings}
    app = create_app(RouterSettings.model_validate(data), registry=CollectorRegistry(),
                     resolver=resolver, sighup=sighup)
    url = await stack.enter_async_context(run_server(app))
    http = await stack.enter_async_context(
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)))
    return url, http


async def eventually(check: Callable[[], Any], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def healthy(http: aiohttp.ClientSession, url: str) -> set[str]:
    async with http.get(url + "/ready") as resp:
        return set((await resp.json())["healthy_replicas"])


async def states(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    m = await scrape(http, url)
    return {dict(labels)["state"]: v for (name, labels), v in m.items()
            if name == "router_replicas"}


async def replica_series(http: aiohttp.ClientSession, url: str, replica: str) -> list[str]:
    m = await scrape(http, url)
    return sorted({name for (name, labels), _ in m.items() if dict(labels).get("replica")
                   == replica})


async def post(http: aiohttp.ClientSession, url: str, **extra: Any) -> tuple[int, str, bytes]:
    async with http.post(url + "/v1/chat/completions", json=chat(**extra)) as resp:
        body = await resp.read()
        return resp.status, resp.headers.get("x-kvroute-replica", ""), body


def write_fleet(path: Path, replicas: Sequence[FakeReplica]) -> None:
    path.write_text(yaml.safe_dump({"replicas": [{"url": r.url, "id": r.name}
                                                 for r in replicas]}))


async def test_sighup_rereads_the_membership_file(stack: AsyncExitStack, tmp_path: Path) -> None:
    r0, r1 = [await stack.enter_async_context(FakeReplica(f"r{i}")) for i in range(2)]
    fleet = tmp_path / "fleet.yaml"
    write_fleet(fleet, [r0])
    url, http = await _router(stack, membership={"file": str(fleet), "file_poll_s": 3600})
    await eventually(lambda: _eq(healthy(http, url), {"r0"}))

    write_fleet(fleet, [r0, r1])
    await asyncio.sleep(0.2)
    assert await healthy(http, url) == {"r0"}  # no poll for an hour: only SIGHUP reloads
    os.kill(os.getpid(), signal.SIGHUP)
    await eventually(lambda: _eq(healthy(http, url), {"r0", "r1"}))
    replicas = {(await post(http, url))[1] for _ in range(4)}
    assert replicas == {"r0", "r1"}

    # a file that does not validate changes nothing
    fleet.write_text("replicas: [{url: 'ftp://nowhere'}]\n")
    os.kill(os.getpid(), signal.SIGHUP)
    await asyncio.sleep(0.3)
    assert await healthy(http, url) == {"r0", "r1"}

    write_fleet(fleet, [r1])
    os.kill(os.getpid(), signal.SIGHUP)
    await eventually(lambda: _eq(healthy(http, url), {"r1"}))
    await eventually(lambda: _eq(states(http, url),
                                 {"healthy": 1.0, "draining": 0.0, "unhealthy": 0.0}))
    assert await replica_series(http, url, "r0") == []  # its series went with it
    m = await scrape(http, url)
    changes = {tuple(v for _, v in labels): value for (name, labels), value in m.items()
               if name == "router_membership_changes_total"}
    assert changes == {("added", "file"): 2.0, ("removed", "file"): 1.0}


async def test_file_changes_are_picked_up_without_a_signal(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    r0, r1 = [await stack.enter_async_context(FakeReplica(f"r{i}")) for i in range(2)]
    fleet = tmp_path / "fleet.yaml"
    write_fleet(fleet, [r0])
    url, http = await _router(stack, sighup=False,
                              membership={"file": str(fleet), "file_poll_s": 0.05})
    await eventually(lambda: _eq(healthy(http, url), {"r0"}))
    write_fleet(fleet, [r1])
    await eventually(lambda: _eq(healthy(http, url), {"r1"}))
    assert {(await post(http, url))[1] for _ in range(3)} == {"r1"}


async def test_dns_name_is_re_resolved(stack: AsyncExitStack) -> None:
    port = free_port()
    fakes = [await stack.enter_async_context(
        FakeReplica(f"d{i}", host=f"127.0.0.{i + 1}", port=port)) for i in range(3)]
    ids = [f"127.0.0.{i + 1}:{port}" for i in range(3)]
    answer: list[str] | Exception = ["127.0.0.1", "127.0.0.2"]
    asked: list[tuple[str, int]] = []

    async def resolver(name: str, p: int) -> list[str]:
        asked.append((name, p))
        if isinstance(answer, Exception):
            raise answer
        return list(answer)

    dns = {"name": "vllm.fleet.test", "port": port, "interval_s": 0.05}
    url, http = await _router(stack, resolver=resolver,
                              membership={"dns": [dns], "drain_timeout_s": 2})
    assert asked[0] == ("vllm.fleet.test", port)
    await eventually(lambda: _eq(healthy(http, url), set(ids[:2])))
    assert {(await post(http, url))[1] for _ in range(4)} == set(ids[:2])

    answer = ["127.0.0.3", "127.0.0.2"]  # a pod replaced by another
    await eventually(lambda: _eq(healthy(http, url), set(ids[1:])))
    await eventually(lambda: _eq(states(http, url),
                                 {"healthy": 2.0, "draining": 0.0, "unhealthy": 0.0}))
    before = len(fakes[0].completions())
    assert {(await post(http, url))[1] for _ in range(4)} == set(ids[1:])
    assert len(fakes[0].completions()) == before

    # a failing or empty resolution keeps the last known replicas
    n = len(asked)
    answer = OSError("SERVFAIL")
    await eventually(lambda: len(asked) > n + 2)
    answer = []
    await eventually(lambda: len(asked) > n + 5)
    assert await healthy(http, url) == set(ids[1:])
    m = await scrape(http, url)
    assert m[("router_membership_changes_total", (("change", "added"), ("source", "dns")))] == 3
    assert m[("router_membership_changes_total", (("change", "removed"), ("source", "dns")))] == 1


async def test_a_leaving_replica_drains_its_in_flight_requests(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    slow = Behaviour(chunks=12, chunk_delay_s=0.1)
    r0 = await stack.enter_async_context(FakeReplica("r0", slow))
    r1 = await stack.enter_async_context(FakeReplica("r1"))
    fleet = tmp_path / "fleet.yaml"
    write_fleet(fleet, [r0])
    url, http = await _router(stack, sighup=False, membership={
        "file": str(fleet), "file_poll_s": 0.05, "drain_timeout_s": 30})
    await eventually(lambda: _eq(healthy(http, url), {"r0"}))
    streams = [asyncio.create_task(post(http, url, stream=True)) for _ in range(3)]
    await eventually(lambda: len(r0.completions()) == 3)

    write_fleet(fleet, [r1])
    await eventually(lambda: _eq(healthy(http, url), {"r1"}))
    assert (await states(http, url))["draining"] == 1  # r0: streams still running
    answers = [await post(http, url) for _ in range(4)]  # new requests: r1 only
    assert {a[1] for a in answers} == {"r1"} and {a[0] for a in answers} == {200}
    assert not any(t.done() for t in streams)

    done = await asyncio.gather(*streams)
    for status, replica, body in done:  # every in-flight stream finished, whole
        assert status == 200 and replica == "r0" and body.endswith(b"data: [DONE]\n\n")
    await eventually(lambda: _eq(states(http, url),
                                 {"healthy": 1.0, "draining": 0.0, "unhealthy": 0.0}))
    assert await replica_series(http, url, "r0") == []


async def test_the_drain_is_bounded_by_its_timeout(stack: AsyncExitStack, tmp_path: Path) -> None:
    fakes = [await stack.enter_async_context(
        FakeReplica(f"r{i}", Behaviour(chunks=20, chunk_delay_s=0.1))) for i in range(2)]
    fleet = tmp_path / "fleet.yaml"
    write_fleet(fleet, fakes)
    url, http = await _router(stack, sighup=False, membership={
        "file": str(fleet), "file_poll_s": 0.05, "drain_timeout_s": 0.3})
    await eventually(lambda: _eq(healthy(http, url), {"r0", "r1"}))
    stream = asyncio.create_task(post(http, url, stream=True))
    await eventually(lambda: sum(len(f.completions()) for f in fakes) == 1)
    leaving, staying = fakes if fakes[0].completions() else fakes[::-1]
    write_fleet(fleet, [staying])
    # removed after 0.3 s although its stream (2 s) still runs ...
    await eventually(lambda: _eq(states(http, url),
                                 {"healthy": 1.0, "draining": 0.0, "unhealthy": 0.0}))
    assert not stream.done()
    # ... which is not cut: it finishes on its own
    status, replica, body = await stream
    assert status == 200 and replica == leaving.name and body.endswith(b"data: [DONE]\n\n")


async def _eq(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


def test_the_ring_moves_about_one_in_n_sessions_on_join_and_leave() -> None:
    from kvkeys.types import ReplicaId
    from router.affinity import AffinityRing

    ring = AffinityRing(vnodes=160)
    four = [ReplicaId(f"r{i}") for i in range(4)]
    five = [*four, ReplicaId("r4")]
    keys = [f"session-{i}" for i in range(4000)]
    before = {k: ring.first(k, four) for k in keys}
    joined = {k: ring.first(k, five) for k in keys}
    moved = [k for k in keys if before[k] != joined[k]]
    assert all(joined[k] == "r4" for k in moved)  # only to the newcomer
    assert 0.12 < len(moved) / len(keys) < 0.28  # about 1/5
    left = {k: ring.first(k, five[1:]) for k in keys}  # r0 leaves the five
    moved = [k for k in keys if joined[k] != left[k]]
    assert all(joined[k] == "r0" for k in moved)  # only r0's sessions move
    assert 0.12 < len(moved) / len(keys) < 0.28
