"""The look ahead shared between routers on one Redis index (``router.outlook_redis``):
buses on a real Redis channel, each applying the others' requests to its look ahead;
silent peers forgotten, junk on the channel skipped, Redis going away and coming back."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import pytest
import redis.asyncio as aioredis
import yaml

from router.fleet_outlook import FleetOutlook
from router.horizon import HorizonEstimator
from router.outlook_peers import PEER_SILENCE_S, OutlookPeers
from router.outlook_redis import RedisTransport
from tests.ports import free_port
from tests.router.fake_replica import FakeReplica
from tests.router.helpers import scrape
from tests.router.outlook_helpers import A, outlook, pinned, prompt, until


@dataclass
class _Router:
    outlook: FleetOutlook
    horizon: HorizonEstimator
    peers: OutlookPeers
    loops: list[asyncio.Task[None]]

    async def stop(self) -> None:
        for task in self.loops:
            task.cancel()
        await asyncio.gather(*self.loops, return_exceptions=True)
        self.loops = []
        await self.peers.transport.aclose()



async def _router(stack: AsyncExitStack, url: str, channel: str, sender: int,
                  silence_s: float = 5.0) -> _Router:  # fmt: skip
    out, h = outlook()
    peers = OutlookPeers(RedisTransport(url, channel, timeout_s=0.5), sender, lambda: 100.0,
                         known=lambda r: r == A, silence_s=silence_s)
    peers.attach(out)
    transport = peers.transport
    assert isinstance(transport, RedisTransport)
    loops = [asyncio.create_task(peers.run()), asyncio.create_task(peers.run_sync()),
             asyncio.create_task(transport.run_publisher())]
    r = _Router(out, h, peers, loops)
    stack.push_async_callback(r.stop)
    return r



async def _joined(routers: list[_Router]) -> None:
    """Until every router has heard every other (a subscriber misses what was published
    before it subscribed), then the counters start at zero."""
    def poke() -> None:
        for o in routers:
            o.peers._send(("s", o.peers.sender, []))

    for r in routers:
        await until(lambda r=r: len(r.peers.heard) == len(routers) - 1,  # type: ignore[misc]
                     poke)
    for r in routers:
        r.peers.received = 0




@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


@pytest.fixture
def channel() -> str:
    return f"kvt:{uuid.uuid4().hex[:12]}:outlook"


async def test_routers_on_one_channel_share_their_requests_and_nothing_echoes(
    stack: AsyncExitStack, redis_url: str, channel: str
) -> None:
    r0, r1, r2 = [await _router(stack, redis_url, channel, s) for s in (11, 22, 33)]
    await _joined([r0, r1, r2])
    r0.outlook.routed("req-1", "s1", A, prompt(800), [], None, 100.0)
    # the same client request id at another router is another request
    r1.outlook.routed("req-1", None, A, prompt(320), [], None, 100.0)
    await until(lambda: pinned(r2.outlook) == 70.0)
    await until(lambda: pinned(r0.outlook) == pinned(r1.outlook) == 70.0)
    r0.outlook.finished("req-1", "s1", A, 60, 0.2, 30, 102.0)
    await until(lambda: pinned(r2.outlook) == 20.0 and pinned(r1.outlook) == 20.0)
    assert r2.outlook.idle_runs.replica_of("s1") == A
    assert r2.horizon._r[A].released == 60.0
    assert len(r2.outlook._service) == 1
    # r1's own request is still pinned at r1 (r0's finish of its own "req-1" is r0's)
    assert pinned(r1.outlook) == 20.0 and len(r1.outlook._service) == 1
    # each router's own messages come back on the channel: skipped, not counted
    assert all(r.peers.invalid == 0 for r in (r0, r1, r2))


async def test_a_silent_peer_is_forgotten_with_its_pins(
    stack: AsyncExitStack, redis_url: str, channel: str
) -> None:
    r0 = await _router(stack, redis_url, channel, 1, silence_s=1.5)
    r1 = await _router(stack, redis_url, channel, 2, silence_s=1.5)
    await _joined([r0, r1])
    r1.outlook.routed("req-9", None, A, prompt(800), [], None, 100.0)
    await until(lambda: pinned(r0.outlook) == 50.0)
    await r1.stop()  # crashed or cut off: no finish, no more in-flight lists
    await asyncio.sleep(1.0)
    assert pinned(r0.outlook) == 50.0 and 2 in r0.peers.heard  # not silent for long yet
    await until(lambda: pinned(r0.outlook) == 0.0, timeout_s=5.0)
    assert r0.peers.heard == {}
    assert len(r0.outlook._service) == 0  # nothing learnt from a request never finished


async def test_junk_on_the_channel_is_counted_and_skipped(
    stack: AsyncExitStack, redis_url: str, channel: str
) -> None:
    r0 = await _router(stack, redis_url, channel, 1)
    r1 = await _router(stack, redis_url, channel, 2)
    await _joined([r0, r1])
    enc = msgspec.msgpack.encode
    junk = [
        b"\xc1",  # not msgpack: one invalid message, as it is not a batch
        enc([b"\x93\xa1r\x00\xa1x", enc(("q", 2))]),  # a batch of two bad messages
        enc([enc(("r", 2, "x", None, "a", float("nan"), None))]),  # NaN blocks
        enc([enc(("r", 2, "x", None, "a", 1e300, None))]),  # absurd blocks
        enc([enc(("f", 2, "x", None, "a", -1, None, None))]),  # negative release
        enc([enc(("r", 2, "x", None, "elsewhere", 5.0, None))]),  # a replica not ours (yet)
        enc([enc(("r", 2, "y" * 1000, None, "a", 5.0, None))]),  # an oversized id
    ]
    async with aioredis.Redis.from_url(redis_url) as client:
        for payload in junk:
            await client.publish(channel, payload)
    r1.outlook.routed("req-1", None, A, prompt(800), [], None, 100.0)
    await until(lambda: pinned(r0.outlook) == 50.0)
    assert r0.peers.invalid == 7 and r0.peers.unknown_replica == 1
    assert set(r0.outlook._pinned) == {A}


async def test_the_bus_survives_redis_going_away_and_talks_again_when_it_is_back(
    stack: AsyncExitStack, redis_server_factory: Callable[[int | None], object], channel: str
) -> None:
    port = free_port()
    server = redis_server_factory(port)
    url = f"redis://127.0.0.1:{port}/0"
    r0 = await _router(stack, url, channel, 1)
    r1 = await _router(stack, url, channel, 2)
    await _joined([r0, r1])
    server.stop()  # type: ignore[attr-defined]
    # routing goes on: sends queue (then drop), nothing raises, the loops keep running
    for i in range(20):
        r0.outlook.routed(f"lost-{i}", None, A, prompt(16), [], None, 100.0)
    await until(lambda: (r0.peers.transport.dropped or 0) > 0)  # counted, not queued
    assert all(not t.done() for r in (r0, r1) for t in r.loops)
    redis_server_factory(port)
    r0.outlook.routed("req-1", None, A, prompt(800), [], None, 100.0)
    # once both have resubscribed, r0's in-flight list reaches r1: every request of r0
    # still in flight is pinned there, sent again through the routed messages that follow
    await until(lambda: len(r1.peers.heard) == 1 and r1.peers.received > 0,
                 timeout_s=20.0)
    r0.outlook.routed("req-2", None, A, prompt(320), [], None, 100.0)
    await until(lambda: "\x001\x00req-2" in r1.outlook._in_flight, timeout_s=10.0)


async def test_two_routers_on_one_redis_index_hear_each_other_and_forget_a_dead_one(
    stack: AsyncExitStack, redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    """Two ``kvroute serve`` processes (two hosts' routers) on one Redis index find each
    other on the index's look-ahead channel; one killed outright is forgotten by the
    other within ``PEER_SILENCE_S`` (plus a list interval)."""
    fake = await stack.enter_async_context(FakeReplica("r0"))
    http = await stack.enter_async_context(aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=10)))
    admins = []
    procs = []
    for i in range(2):
        admin_port = free_port()
        config = {"replicas": [{"url": fake.url, "id": "r0"}], "policy": "kv",
                  "index": {"backend": "redis", "url": redis_url,
                            "key_prefix": redis_namespace + ":"},
                  "admin": {"enabled": True, "port": admin_port}}
        path = tmp_path / f"router{i}.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
        kvroute = os.path.join(os.path.dirname(sys.executable), "kvroute")
        proc = subprocess.Popen([kvroute, "serve", "--config", str(path), "--port",
                                 str(free_port()), "--log-level", "warning"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(_reap, proc)
        procs.append(proc)
        admins.append(f"http://127.0.0.1:{admin_port}")

    async def peers(admin: str) -> tuple[float, float, float]:
        try:
            m = await scrape(http, admin)
        except aiohttp.ClientError:
            return (-1.0, 0.0, 0.0)
        return (m.get(("router_outlook_peers", ()), -1.0),
                m.get(("router_outlook_peer_messages_total", (("outcome", "applied"),)), 0.0),
                m.get(("router_outlook_peer_messages_total", (("outcome", "invalid"),)), 0.0))

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        seen = [await peers(a) for a in admins]
        if all(n == 1.0 and applied > 0 for n, applied, _ in seen):
            break
        assert all(p.poll() is None for p in procs), "a router exited"
        assert loop.time() < deadline, seen
        await asyncio.sleep(0.2)
    assert all(invalid == 0 for _, _, invalid in seen)
    for admin in admins:
        m = await scrape(http, admin)
        assert m[("router_outlook_peer_sends_dropped_total", ())] == 0
    procs[0].kill()
    killed_at = loop.time()
    while (await peers(admins[1]))[0] != 0.0:
        assert loop.time() - killed_at < PEER_SILENCE_S + 5, "the dead router is still a peer"
        await asyncio.sleep(0.2)
    assert loop.time() - killed_at > PEER_SILENCE_S - 1  # forgotten for its silence


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
