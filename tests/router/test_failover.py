"""Failover before the first byte, and what happens after it."""

from __future__ import annotations

import aiohttp
import orjson

from tests.ports import free_port
from tests.router.conftest import StartFakes, StartRouter
from tests.router.helpers import chat, scrape


def _labels(**kw: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(kw.items()))


async def test_connect_refused_fails_over(fakes: StartFakes, start_router: StartRouter,
                                          client: aiohttp.ClientSession) -> None:
    gone, good = await fakes(2)
    # slow probes: the router still believes the stopped replica is up
    url = await start_router([gone, good], health={"interval_s": 60})
    await gone.stop()
    for stream in (False, True, False):
        async with client.post(url + "/v1/chat/completions", json=chat(stream=stream)) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvroute-replica"] == f"127.0.0.1:{good.port}"
            await resp.read()
    metrics = await scrape(client, url)
    gone_id = f"127.0.0.1:{gone.port}"
    assert metrics[("router_upstream_requests_total",
                    _labels(replica=gone_id, outcome="connect_error"))] == 2
    # two connect errors are two passive failures: the replica is now down
    assert metrics[("router_replica_healthy", _labels(replica=gone_id))] == 0


async def test_5xx_before_first_byte_fails_over(fakes: StartFakes, start_router: StartRouter,
                                                client: aiohttp.ClientSession) -> None:
    bad, good = await fakes(2)
    bad.behaviour.status = 503
    url = await start_router([bad, good])
    for stream in (False, True, False, True):
        async with client.post(url + "/v1/chat/completions", json=chat(stream=stream)) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvroute-replica"] == f"127.0.0.1:{good.port}"
            await resp.read()
    metrics = await scrape(client, url)
    bad_id = f"127.0.0.1:{bad.port}"
    assert metrics[("router_failovers_total", _labels(replica=bad_id))] == 2
    assert metrics[("router_upstream_requests_total",
                    _labels(replica=bad_id, outcome="http_5xx"))] == 2


async def test_last_5xx_is_passed_through(fakes: StartFakes, start_router: StartRouter,
                                          client: aiohttp.ClientSession) -> None:
    a, b = await fakes(2)
    a.behaviour.status = b.behaviour.status = 500
    url = await start_router([a, b])
    async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 500
        assert (await resp.json())["error"]["message"] == "fake 500"
    assert len(a.completions()) == 1 and len(b.completions()) == 1


async def test_4xx_is_passed_through_without_failover(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    a, b = await fakes(2)
    a.behaviour.status = b.behaviour.status = 400
    url = await start_router([a, b])
    async with client.post(url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["message"] == "fake 400"
    assert len(a.completions()) + len(b.completions()) == 1


async def test_timeout_before_first_byte_fails_over_then_504(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    slow, good = await fakes(2)
    slow.behaviour.headers_delay_s = 1.0
    url = await start_router([slow, good],
                             timeouts={"stream_read_s": 0.2, "non_stream_read_s": 0.2})
    for stream in (True, False):
        async with client.post(url + "/v1/chat/completions", json=chat(stream=stream),
                               headers={"X-KVRoute-Policy": "round_robin"}) as resp:
            assert resp.status == 200
            await resp.read()
    good.behaviour.headers_delay_s = 1.0
    async with client.post(url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        assert resp.status == 504
        body = await resp.json()
        assert body["error"]["code"] == "replica_timeout"
        assert set(body["error"]) == {"message", "type", "param", "code"}


async def test_all_connect_errors_give_502(fakes: StartFakes, start_router: StartRouter,
                                           client: aiohttp.ClientSession) -> None:
    a, b = await fakes(2)
    url = await start_router([a, b], health={"interval_s": 60, "passive_failures": False})
    await a.stop()
    await b.stop()
    async with client.post(url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        assert resp.status == 502
        body = await resp.json()
        assert body["error"]["code"] == "replica_unavailable"
        assert body["error"]["type"] == "upstream_error"


async def test_no_healthy_replica_gives_503(start_router: StartRouter,
                                            client: aiohttp.ClientSession) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    url = await start_router([dead], health={"interval_s": 60})
    # the start-up probe round already found it down
    async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"].isdigit()
        assert (await resp.json())["error"]["code"] == "no_healthy_replica"
    async with client.get(url + "/ready") as resp:
        assert resp.status == 503


async def test_mid_stream_failure_ends_with_sse_error(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (fake,) = await fakes(1)
    fake.behaviour.chunks = 5
    fake.behaviour.drop_after_chunks = 2
    url = await start_router([fake])
    async with client.post(url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        assert resp.status == 200
        data = await resp.read()
    events = [e for e in data.split(b"\n\n") if e]
    assert len(events) == 3
    assert b"r0-0" in events[0] and b"r0-1" in events[1]
    last = orjson.loads(events[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "replica_failed"
    assert set(last["error"]) == {"message", "type", "param", "code"}
    metrics = await scrape(client, url)
    assert metrics[("router_upstream_requests_total",
                    _labels(replica=f"127.0.0.1:{fake.port}", outcome="midstream_error"))] == 1
    assert sum(v for (n, _), v in metrics.items() if n == "router_inflight_requests") == 0


async def test_mid_stream_timeout_ends_with_sse_error(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (fake,) = await fakes(1)
    fake.behaviour.chunk_delay_s = 1.0
    url = await start_router([fake], timeouts={"stream_read_s": 0.2})
    async with client.post(url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        data = await resp.read()
    events = [e for e in data.split(b"\n\n") if e]
    assert len(events) == 2
    assert orjson.loads(events[-1][6:])["error"]["code"] == "replica_timeout"
