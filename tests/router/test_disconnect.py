"""A client that goes away cancels the upstream request, and the accounting returns to 0."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.router.conftest import StartFakes, StartRouter
from tests.router.helpers import chat, inflight, scrape


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
    while seen.ended is None and time.monotonic() - t_close < 2:
        await asyncio.sleep(0.01)
    assert seen.cancelled
    assert seen.ended is not None and seen.ended - t_close < 1.0
    await asyncio.sleep(0.05)
    assert await inflight(client, url) == 0
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
        while seen.ended is None and time.monotonic() - t_close < 2:
            await asyncio.sleep(0.01)
        assert seen.cancelled and seen.ended is not None and seen.ended - t_close < 1.0
        await asyncio.sleep(0.05)
        assert await inflight(client, url) == 0
