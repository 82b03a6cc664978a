"""The kv policy while the fleet changes: simulated vLLM replicas (real HTTP, real ZMQ KV
events found at ``/kv_event_sources``) join, leave and restart under the same address
with conversations running; no request is lost and predictions are exact after each
change."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as redis
import yaml
from prometheus_client import CollectorRegistry

from replica.sim.server import SimHandle, start_sim
from replica.vllm.tiny_tokenizer import build_tokenizer
from router.app import create_app
from router.config import RouterSettings
from tests.ports import free_port
from tests.router.server import run_server
from tests.router.test_kv_integration import MODEL, Conversation, Fleet, Turn, send
from tests.router.test_membership import _eq, eventually, healthy, states

TIMEOUT = aiohttp.ClientTimeout(total=30)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"), template="llama3")


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


def sim(tok: Path, seed: int, **kw: Any) -> Any:
    return start_sim(tok, model=MODEL, num_blocks=4096, time_scale=0.002, seed=seed, **kw)


def write_fleet(path: Path, sims: dict[str, SimHandle]) -> None:
    path.write_text(yaml.safe_dump({"replicas": [{"url": s.url, "id": rid}
                                                 for rid, s in sims.items()]}))


async def _router(stack: AsyncExitStack, tok: Path, fleet: Path,
                  index: dict[str, Any] | None = None) -> Fleet:
    settings = RouterSettings.model_validate({
        "policy": "kv",
        "index": index or {"backend": "memory"},
        "health": {"interval_s": 0.1},
        "membership": {"file": str(fleet), "file_poll_s": 0.05, "drain_timeout_s": 10},
        "scoring": {"models": [{"name": MODEL, "block_size": 16, "tokenizer": str(tok)}],
                    "scrape": {"interval_s": 0.2}},
    })
    prom = CollectorRegistry()
    url = await stack.enter_async_context(
        run_server(create_app(settings, registry=prom, sighup=False)))
    http = await stack.enter_async_context(aiohttp.ClientSession(timeout=TIMEOUT))
    return Fleet([], url, http, prom, settings)


async def live(f: Fleet, replica: str) -> bool:
    """The replica is healthy and its event stream is connected (so a prediction for
    it can be exact)."""
    return (replica in await healthy(f.http, f.router)
            and f.metric("router_kv_events_connected", replica=replica) == 1)


async def turns(f: Fleet, convs: Sequence[Conversation], n: int, tag: str,
                pause_s: float = 0.03) -> list[Turn]:
    """``n`` turns of every conversation, ``pause_s`` between a conversation's turns.
    Turns whose predictions are judged pause longer: a turn's KV events reach the router
    a moment after its response, which a loaded machine stretches to hundreds of ms."""
    out: list[Turn] = []

    async def one(c: Conversation) -> None:
        for t in range(n):
            out.append(await send(f, c, f"{tag} question {t} " + "explain " * 6,
                                  stream=t % 2 == 1, ask_usage=True))
            await asyncio.sleep(pause_s)

    await asyncio.gather(*(one(c) for c in convs))
    return out


def exact(ts: Sequence[Turn]) -> float:
    return sum(t.predicted == t.cached for t in ts) / len(ts)


async def test_join_and_leave_with_conversations_running(
    stack: AsyncExitStack, tokenizer_dir: Path, tmp_path: Path
) -> None:
    sims = {f"r{i}": await stack.enter_async_context(sim(tokenizer_dir, i)) for i in range(3)}
    fleet = tmp_path / "fleet.yaml"
    write_fleet(fleet, {"r0": sims["r0"], "r1": sims["r1"]})
    f = await _router(stack, tokenizer_dir, fleet)
    await eventually(lambda: _all_live(f, ["r0", "r1"]))
    convs = [Conversation(system=f"Member test {i}. " * 20, session=f"m{i}") for i in range(8)]
    await turns(f, convs, 2, "before")

    # r2 joins while every conversation keeps talking; new ones come in too
    running = asyncio.create_task(turns(f, convs, 3, "join"))
    write_fleet(fleet, sims)
    await eventually(lambda: _all_live(f, ["r2"]))
    fresh = [Conversation(system=f"Newcomer {i}. " * 20, session=f"n{i}") for i in range(9)]
    await turns(f, fresh, 1, "first")
    during_join = await running
    assert "r2" in {c.turns[0].replica for c in fresh}  # it takes new conversations
    settled = await turns(f, convs + fresh, 2, "after-join", pause_s=0.5)
    assert exact(settled) >= 0.95, [(t.replica, t.predicted, t.cached) for t in settled]

    # r0 leaves while the conversations keep talking (its sessions move, none fails)
    on_r0 = [c for c in convs + fresh if c.turns[-1].replica == "r0"]
    assert on_r0
    running = asyncio.create_task(turns(f, convs + fresh, 3, "leave"))
    write_fleet(fleet, {"r1": sims["r1"], "r2": sims["r2"]})
    await eventually(lambda: _eq(healthy(f.http, f.router), {"r1", "r2"}))
    await eventually(lambda: _eq(states(f.http, f.router),
                                 {"healthy": 2.0, "draining": 0.0, "unhealthy": 0.0}))
    during_leave = await running
    assert len(during_join) == 8 * 3 and len(during_leave) == 17 * 3  # none lost
    after = await turns(f, convs + fresh, 2, "after-leave", pause_s=0.5)
    assert "r0" not in {t.replica for t in after}
    assert exact(after) >= 0.95, [(t.replica, t.predicted, t.cached) for t in after]
    # the sessions that were on r0 moved; most others stayed where their cache is (the
    # kv policy may still move one when the newcomers load its replica)
    others = [c for c in convs + fresh if c not in on_r0]
    stayed = [c for c in others if c.turns[-1].replica == c.turns[-6].replica]
    assert len(stayed) >= 0.75 * len(others), [[t.replica for t in c.turns] for c in others]
    assert f.metric("router_index_blocks", replica="r0") == 0
    assert f.metric("router_kv_events_connected", replica="r0") == 0


async def test_restart_under_the_same_address_clears_stale_entries(
    stack: AsyncExitStack, tokenizer_dir: Path, tmp_path: Path
) -> None:
    port, events, replay = free_port(), free_port(), free_port()
    pinned = {"port": port, "kv_events_endpoint": f"tcp://*:{events}",
              "replay_endpoint": f"tcp://*:{replay}"}
    r0 = await stack.enter_async_context(sim(tokenizer_dir, 0))
    restarted = AsyncExitStack()
    r1 = await restarted.enter_async_context(sim(tokenizer_dir, 1, **pinned))
    fleet = tmp_path / "fleet.yaml"
    write_fleet(fleet, {"r0": r0, "r1": r1})
    f = await _router(stack, tokenizer_dir, fleet)
    await eventually(lambda: _all_live(f, ["r0", "r1"]))
    convs = [Conversation(system=f"Restart test {i}. " * 20, session=f"x{i}") for i in range(6)]
    await turns(f, convs, 2, "before")
    assert any(c.turns[-1].replica == "r1" for c in convs)
    resyncs = _resyncs(f, "r1")

    # r1 restarts (empty cache, event sequence from 0) under the same address, quickly,
    # with traffic running: nothing fails (failover while it is down)
    running = asyncio.create_task(turns(f, convs, 4, "restart"))
    await asyncio.sleep(0.1)
    await restarted.aclose()
    await asyncio.sleep(0.3)
    await stack.enter_async_context(sim(tokenizer_dir, 1, **pinned))
    during = await running
    assert len(during) == 6 * 4
    await eventually(lambda: _all_live(f, ["r1"]))
    # A restart shorter than the disconnect grace is seen in the engine's first events
    # (sequence back to 0): until then r1's old entries stand (a turn routed there may be
    # over-predicted once); then they are cleared and rebuilt from the new engine.
    for i in range(2):  # round robin: one of these reaches r1 whatever the index says
        await send(f, Conversation(system="Anyone there?", session=f"rr{i}"), "hello",
                   stream=False, policy="round_robin")
    await eventually(lambda: _resyncs(f, "r1") > resyncs)
    after = await turns(f, convs, 2, "after", pause_s=0.5)
    assert exact(after) >= 0.95, [(t.replica, t.predicted, t.cached) for t in after]


def _resyncs(f: Fleet, replica: str) -> float:
    return sum(f.metric("router_kv_events_resyncs_total", replica=replica, reason=r)
               for r in ("restart", "reconnect", "disconnected", "history_lost", "no_replay",
                         "replay_failed"))


async def _all_live(f: Fleet, replicas: list[str]) -> bool:
    return all([await live(f, r) for r in replicas])


async def test_routers_on_one_redis_index_follow_the_same_file_and_the_leases_follow(
    stack: AsyncExitStack, tokenizer_dir: Path, tmp_path: Path, redis_url: str,
    redis_namespace: str,
) -> None:
    sims = {f"r{i}": await stack.enter_async_context(sim(tokenizer_dir, i)) for i in range(3)}
    fleet = tmp_path / "fleet.yaml"
    write_fleet(fleet, {"r0": sims["r0"], "r1": sims["r1"]})
    index = {"backend": "redis", "url": redis_url, "key_prefix": redis_namespace + ":",
             "op_timeout_s": 1.0}
    a = await _router(stack, tokenizer_dir, fleet, index)
    b = await _router(stack, tokenizer_dir, fleet, index)
    client = redis.Redis.from_url(redis_url, socket_timeout=2.0)
    stack.push_async_callback(client.aclose)

    async def leased(replica: str) -> bool:
        return bool(await client.exists(f"{redis_namespace}:lease:src:{replica}"))

    await eventually(lambda: _all_live(a, ["r0", "r1"]))
    await eventually(lambda: _all_live(b, ["r0", "r1"]))
    assert await leased("r0") and await leased("r1") and not await leased("r2")

    write_fleet(fleet, sims)  # r2 joins both routers; one of them ingests it
    await eventually(lambda: _all_live(a, ["r2"]))
    await eventually(lambda: _all_live(b, ["r2"]))
    await eventually(lambda: leased("r2"))
    convs = [Conversation(system=f"Two routers {i}. " * 20, session=f"t{i}") for i in range(6)]
    for turn in range(4):  # turns alternate between the routers
        for c in convs:
            await send(a if turn % 2 == 0 else b, c, f"turn {turn} " * 6, stream=False)
        await asyncio.sleep(0.2)
    later = [c.turns[i] for c in convs for i in range(1, 4)]
    assert exact(later) >= 0.95, [(t.replica, t.predicted, t.cached) for t in later]

    write_fleet(fleet, {"r1": sims["r1"], "r2": sims["r2"]})  # r0 leaves both
    await eventually(lambda: _eq(healthy(a.http, a.router), {"r1", "r2"}))
    await eventually(lambda: _eq(healthy(b.http, b.router), {"r1", "r2"}))
    await eventually(lambda: _not(leased("r0")))  # its ingester let the lease go
    after = [await send(b, c, "after r0 left " * 4, stream=False) for c in convs]
    assert "r0" not in {t.replica for t in after} and exact(after) >= 0.95


async def _not(value: Any) -> bool:
    return not await value
