"""A client that goes away cancels the upstream request, and the accounting returns to 0."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from router.proxy import _WATCH_AFTER_S
from router.relay import watch_disconnect
from tests.router.conftest import StartFakes, StartRouter
from tests.router.helpers import chat, inflight, scrape


async def until_inflight(client: aiohttp.ClientSession, url: str, n: int,
                         timeout_s: float = 5.0) -> None:
    """Poll the router's in-flight gauge until it reads ``n`` (the accounting is released
    as the cancelled request unwinds, which a loaded machine may take a moment to run)."""
    deadline = time.monotonic() + timeout_s
    while (value := await inflight(client, url)) != n:
        assert time.monotonic() < deadline, f"in flight stayed at {value}, not {n}"
        await asyncio.sleep(0.02)


async def test_disconnect_mid_stream_cancels_upstream(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (fake,) = await fakes(1)
    fake.behaviour.chunks = 100
    fake.behaviour.chunk_delay_s = 0.05
    url = await start_router([fake])
    resp = await client.post(url + "/v1/chat/completions", json=chat(stream=True))
    await resp.content.readuntil(b"\n\n")
    assert await inflight(client, url) == 1
    resp.close()  # drop the connection mid-stream
    t_close = time.monotonic()
    seen = fake.completions()[-1]
    while seen.ended is None and time.monotonic() - t_close < 4:
        await asyncio.sleep(0.01)
    # cancelled, well before the 5 s the stream would still have run (loaded-machine room)
    assert seen.cancelled
    assert seen.ended is not None and seen.ended - t_close < 3.0
    await until_inflight(client, url, 0)
    metrics = await scrape(client, url)
    assert metrics[("router_client_disconnects_total", ())] == 1
    queued = [v for (n, _), v in metrics.items()
              if n in ("router_queued_prefill_tokens", "router_decoding_requests")]
    assert queued and all(v == 0 for v in queued)


async def test_disconnect_before_first_byte_cancels_upstream(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (fake,) = await fakes(1)
    fake.behaviour.headers_delay_s = 5.0
    url = await start_router([fake])
    for stream in (True, False):
        task = asyncio.create_task(
            client.post(url + "/v1/chat/completions", json=chat(stream=stream)))
        while len(fake.completions()) < (1 if stream else 2):
            await asyncio.sleep(0.01)
        assert await inflight(client, url) == 1
        task.cancel()
        t_close = time.monotonic()
        seen = fake.completions()[-1]
        while seen.ended is None and time.monotonic() - t_close < 4:
            await asyncio.sleep(0.01)
        # cancelled, well before the replica's 5 s header delay would have ended
        assert seen.cancelled and seen.ended is not None and seen.ended - t_close < 3.0
        await until_inflight(client, url, 0)


async def test_only_long_requests_get_a_watcher_task(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    """Answers that take 100 ms (what a loaded router sees at 128 requests in flight) get
    no watcher task; a request still running after ``_WATCH_AFTER_S`` gets exactly one."""
    (fake,) = await fakes(1)
    url = await start_router([fake])
    loop = asyncio.get_running_loop()
    watchers = 0
    previous = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        nonlocal watchers
        if getattr(coro, "__qualname__", "") == watch_disconnect.__qualname__:
            watchers += 1
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def ask(stream: bool) -> float:
        t0 = time.monotonic()
        async with client.post(url + "/v1/chat/completions", json=chat(stream=stream)) as resp:
            assert resp.status == 200
            await resp.read()
        return time.monotonic() - t0

    loop.set_task_factory(factory)
    try:
        fake.behaviour.headers_delay_s = 0.1
        took = await asyncio.gather(*(ask(stream=i % 2 == 0) for i in range(8)))
        # The router's timer runs within the client's round trip: a request the client
        # saw finish under _WATCH_AFTER_S cannot have had a watcher (on a quiet machine
        # none takes that long; a loaded one may stretch a few).
        assert watchers <= sum(t >= _WATCH_AFTER_S for t in took), (watchers, took)
        before = watchers
        fake.behaviour.headers_delay_s = _WATCH_AFTER_S + 0.2
        await ask(stream=True)
        assert watchers == before + 1
    finally:
        loop.set_task_factory(previous)
    assert await inflight(client, url) == 0
