"""The proxy's happy paths: streaming byte for byte and chunk by chunk, non-streaming,
request ids and routing headers, passthrough of other ``/v1/*`` paths."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import orjson

from aio.clock_warp import ClockWarp
from tests.router.conftest import StartFakes, StartRouter
from tests.router.helpers import chat, measure_ttfb, scrape


async def _raw_stream(client: aiohttp.ClientSession, url: str, body: bytes) -> tuple[bytes, int]:
    async with client.post(url + "/v1/chat/completions", data=body,
                           headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200
        data = await resp.read()
        return data, resp.status


async def test_stream_is_byte_exact(fakes: StartFakes, start_router: StartRouter,
                                    client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake])
    body = orjson.dumps(chat(stream=True))
    direct, _ = await _raw_stream(client, fake.url, body)
    routed, _ = await _raw_stream(client, url, body)
    assert routed == direct
    assert routed.endswith(b"data: [DONE]\n\n")
    # the body went upstream unchanged
    assert fake.completions()[-1].body == body


async def test_stream_chunks_arrive_before_upstream_finishes(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (fake,) = await fakes(1)
    fake.behaviour.chunks = 4
    fake.behaviour.chunk_delay_s = 0.2
    url = await start_router([fake])
    t0 = time.monotonic()
    async with client.post(url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        first = await resp.content.readuntil(b"\n\n")
        t_first = time.monotonic() - t0
        assert b"r0-0" in first
        arrivals = [t_first]
        while True:
            event = await resp.content.readuntil(b"\n\n")
            arrivals.append(time.monotonic() - t0)
            if event == b"data: [DONE]\n\n":
                break
    # The first event is relayed at once: it reached the client while the replica was
    # still streaming (it sleeps 0.2 s between events, on this same event loop), not
    # after the whole stream; the events arrive spread out, not in one buffer.  Asserted
    # against the replica's own clock, not a latency bound, so load cannot fail it.
    ended = fake.completions()[-1].ended
    assert ended is not None
    assert t0 + t_first < ended, (t_first, ended - t0)
    assert arrivals[-1] - arrivals[0] > 0.2, arrivals
    assert arrivals == sorted(arrivals) and len(arrivals) == 6


async def test_ttfb_through_router_close_to_direct(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    """No Nagle or buffering stall: the first streamed byte is not delayed by the router."""
    (fake,) = await fakes(1)
    fake.behaviour.chunks = 1
    fake.behaviour.chunk_delay_s = 0.05
    url = await start_router([fake])
    body = orjson.dumps(chat(stream=True))
    direct, routed, gap = await measure_ttfb(client, fake.url, url, body)
    # A Nagle stall holds the body ~40 ms behind the headers on every try; scheduling
    # noise on a busy box does not, so the best of up to 20 tries (until both hold) sees
    # through it.
    assert gap < 0.02, gap
    assert routed < direct + 0.03, (routed, direct)


async def test_non_streaming(fakes: StartFakes, start_router: StartRouter,
                             client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake])
    async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 200
        direct_like = await resp.json()
        assert resp.headers["Content-Type"].startswith("application/json")
    assert direct_like["choices"][0]["message"]["content"] == "from r0"
    async with client.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
        assert resp.status == 200


async def test_request_id_and_routing_headers(fakes: StartFakes, start_router: StartRouter,
                                              client: aiohttp.ClientSession) -> None:
    a, b = await fakes(2)
    url = await start_router([a, b])
    async with client.post(url + "/v1/chat/completions", json=chat(),
                           headers={"X-Request-Id": "abc-123"}) as resp:
        assert resp.headers.getall("x-request-id") == ["abc-123"]
        replica = resp.headers["x-kvroute-replica"]
        assert resp.headers["x-kvroute-reason"] == "rotation"
        assert "x-kvroute-predicted-cached-tokens" not in resp.headers
    served = a if a.completions() else b
    assert replica == f"127.0.0.1:{served.port}"
    assert served.completions()[-1].headers["X-Request-Id"] == "abc-123"
    async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
        generated = resp.headers["x-request-id"]
        assert len(generated) == 32 and int(generated, 16) >= 0
    other = b if served is a else a
    assert other.completions()[-1].headers["X-Request-Id"] == generated
    async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
        assert resp.headers["x-request-id"] != generated  # one per request


async def test_round_robin_spreads_and_policy_header_overrides(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    a, b = await fakes(2)
    url = await start_router([a, b])
    for _ in range(4):
        async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
            await resp.read()
    assert len(a.completions()) == 2 and len(b.completions()) == 2
    async with client.post(url + "/v1/chat/completions", json=chat(),
                           headers={"X-KVRoute-Policy": "least_loaded"}) as resp:
        assert resp.headers["x-kvroute-reason"] == "least_in_flight"
        # the policy header is not forwarded upstream
    last = max(a.seen + b.seen, key=lambda s: s.started)
    assert "X-KVRoute-Policy" not in last.headers
    metrics = await scrape(client, url)
    assert metrics[("router_decisions_total",
                    (("policy", "least_loaded"), ("reason", "least_in_flight")))] == 1


async def test_least_loaded_avoids_busy_replica(fakes: StartFakes, start_router: StartRouter,
                                                client: aiohttp.ClientSession) -> None:
    a, b = await fakes(2)
    a.behaviour.chunk_delay_s = b.behaviour.chunk_delay_s = 0.3
    url = await start_router([a, b], policy="least_loaded")
    async with client.post(url + "/v1/chat/completions", json=chat(stream=True)) as busy:
        await busy.content.readany()
        first = busy.headers["x-kvroute-replica"]
        for _ in range(3):
            async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.headers["x-kvroute-replica"] != first
                await resp.read()


async def test_other_v1_paths_pass_through(fakes: StartFakes, start_router: StartRouter,
                                           client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake])
    async with client.post(url + "/v1/tokenize?x=1&y=%20", data=b'{"prompt":"p"}') as resp:
        assert resp.status == 200
        data = await resp.json()
        assert resp.headers["x-kvroute-replica"] == f"127.0.0.1:{fake.port}"
    assert data == {"path": "/v1/tokenize", "method": "POST", "query": "x=1&y=%20",
                    "replica": "r0", "body": '{"prompt":"p"}'}
    async with client.get(url + "/v1/whatever") as resp:
        assert (await resp.json())["method"] == "GET"


async def test_concurrent_streams_are_independent(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    a, b = await fakes(2)
    a.behaviour.chunk_delay_s = b.behaviour.chunk_delay_s = 0.02
    url = await start_router([a, b])

    async def one(i: int) -> bytes:
        async with client.post(url + "/v1/chat/completions", json=chat(stream=True),
                               headers={"X-Request-Id": f"r{i}"}) as resp:
            assert resp.headers["x-request-id"] == f"r{i}"
            return await resp.read()

    results = await asyncio.gather(*(one(i) for i in range(20)))
    assert all(r.endswith(b"data: [DONE]\n\n") and r.count(b"data: ") == 5 for r in results)


async def test_time_scale_puts_the_routers_timings_in_the_replicas_time(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # Replicas simulated 10x faster than real time: 50 ms of wall time is half a second
    # of theirs, and that is what the router measures (and its policies learn from).
    (fake,) = await fakes(1)
    fake.behaviour.headers_delay_s = 0.05
    url = await start_router([fake], time_scale=0.1)
    async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 200
    samples = await scrape(client, url)
    total = sum(v for (name, _), v in samples.items()
                if name == "router_request_duration_seconds_sum")
    assert 0.5 <= total < 5.0, total


async def test_the_judgement_clock_moves_with_a_benchmarks_clock_warp(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    # A benchmark skipping idle time moves the replicas' clocks and the router's together
    # (``RouterSettings.clock_file``): a second skipped while this request waits is ten
    # of the replicas' seconds at time scale 0.1, on top of the 50 ms it really waited.
    warp = ClockWarp.create(tmp_path / "warp")
    (fake,) = await fakes(1)
    fake.behaviour.headers_delay_s = 0.05
    url = await start_router([fake], time_scale=0.1, clock_file=warp.path)

    async def skip_while_waiting() -> None:
        await asyncio.sleep(0.02)
        warp.advance(1.0)

    skipping = asyncio.create_task(skip_while_waiting())
    async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 200
    await skipping
    samples = await scrape(client, url)
    total = sum(v for (name, _), v in samples.items()
                if name == "router_request_duration_seconds_sum")
    assert 10.5 <= total < 15.0, total
