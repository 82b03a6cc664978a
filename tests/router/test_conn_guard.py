"""Slow, idle, too many and oversized clients (``router.conn_guard``), over real sockets:
the router under uvicorn with the guards ``kvroute serve`` installs, raw TCP clients on
loopback that stall where a slowloris would, and ``kvroute serve`` itself for the file
descriptor count."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.config import ConnectionSettings
from tests.ports import free_port
from tests.router.conftest import StartFakes
from tests.router.fake_replica import FakeReplica
from tests.router.helpers import chat, router_settings, scrape
from tests.router.server import run_server

# Short timeouts so the tests are quick; the asserts leave seconds of slack for a loaded
# machine (they check that a stalled connection is closed, never how fast).
FAST = {"header_timeout_s": 0.5, "body_timeout_s": 0.5, "idle_timeout_s": 0.5}
WAIT_S = 20.0

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _router(stack: AsyncExitStack, fake: FakeReplica, **limits: Any) -> str:
    app = create_app(router_settings([fake]), registry=CollectorRegistry())
    return await stack.enter_async_context(
        run_server(app, connections=ConnectionSettings(**{**FAST, **limits})))


async def _connect(url: str) -> Conn:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _until_eof(conn: Conn) -> bytes:
    """Everything the server sends until it closes (bounded by the test's timeout)."""
    reader, writer = conn
    data = b""
    try:
        while chunk := await reader.read(65536):
            data += chunk
    except ConnectionResetError:
        pass
    writer.close()
    return data


async def _all_closed(conns: list[Conn]) -> list[bytes]:
    async with asyncio.timeout(WAIT_S):
        return await asyncio.gather(*(_until_eof(c) for c in conns))


async def _is_open(conn: Conn) -> bool:
    try:
        return bool(await asyncio.wait_for(conn[0].read(1), 0.2))
    except TimeoutError:
        return True
    except ConnectionResetError:
        return False


def _error(answer: bytes, status: int) -> dict[str, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), head
    assert b"connection: close" in head.lower()
    error: dict[str, Any] = orjson.loads(body)["error"]
    assert set(error) >= {"message", "type", "code"}
    return error


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


async def test_stalled_headers_get_408_and_are_closed(
        fakes: StartFakes, stack: AsyncExitStack, client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await _router(stack, fake)
    conns = [await _connect(url) for _ in range(30)]
    for _, writer in conns:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    answers = await _all_closed(conns)
    for answer in answers:
        assert _error(answer, 408)["code"] == "request_timeout"
    assert fake.seen == []
    metrics = await scrape(client, url)
    assert metrics[("router_connections_refused_total", (("reason", "header_timeout"),))] == 30


async def test_headers_trickled_byte_by_byte_still_hit_the_deadline(
        fakes: StartFakes, stack: AsyncExitStack) -> None:
    """The header deadline is for the whole header block, not a gap between reads."""
    (fake,) = await fakes(1)
    url = await _router(stack, fake)
    conn = await _connect(url)
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 400 + b"\r\n\r\n"

    async def trickle() -> None:
        for i in range(len(request)):
            conn[1].write(request[i:i + 1])
            await asyncio.sleep(0.02)  # 8 s in all, 16 times the deadline

    task = asyncio.create_task(trickle())
    try:
        answer = await _all_closed([conn])
    finally:
        task.cancel()
    assert _error(answer[0], 408)["code"] == "request_timeout"


async def test_stalled_body_is_closed_and_never_forwarded(
        fakes: StartFakes, stack: AsyncExitStack) -> None:
    (fake,) = await fakes(1)
    url = await _router(stack, fake)
    conns = [await _connect(url) for _ in range(20)]
    for _, writer in conns:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                     b'{"model": "m", ')
    answers = await _all_closed(conns)
    for answer in answers:
        assert _error(answer, 408)["code"] == "request_timeout"
    assert fake.seen == []


async def test_idle_connections_are_closed(fakes: StartFakes, stack: AsyncExitStack) -> None:
    """Connections that never send a request, or only blank lines, are closed."""
    (fake,) = await fakes(1)
    url = await _router(stack, fake)
    silent = [await _connect(url) for _ in range(50)]
    blank = await _connect(url)

    async def crlf() -> None:
        while True:
            blank[1].write(b"\r\n")
            await asyncio.sleep(0.1)

    task = asyncio.create_task(crlf())
    try:
        answers = await _all_closed([*silent, blank])
    finally:
        task.cancel()
    assert answers == [b""] * 51


async def test_keep_alive_and_normal_requests_still_work(
        fakes: StartFakes, stack: AsyncExitStack) -> None:
    (fake,) = await fakes(1)
    url = await _router(stack, fake, idle_timeout_s=5.0)
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as http:
        for _ in range(3):
            headers = {f"X-H{i}": "v" * 50 for i in range(60)}
            async with http.post(url + "/v1/chat/completions", json=chat(),
                                 headers=headers) as resp:
                assert resp.status == 200
                await resp.read()
    assert len(fake.seen) == 3
    assert fake.seen[0].headers["X-H59"] == "v" * 50


async def test_idle_after_a_response_and_pipelined_requests(
        fakes: StartFakes, stack: AsyncExitStack) -> None:
    """The idle deadline also follows a response (it replaces uvicorn's keep-alive
    timer), and two pipelined requests are both answered before the close."""
    (fake,) = await fakes(1)
    url = await _router(stack, fake)
    conn = await _connect(url)
    conn[1].write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
    answer = (await _all_closed([conn]))[0]
    assert answer.count(b"HTTP/1.1 200 ") == 2
    assert answer.count(b'"object":"list"') == 2


async def test_long_streams_outlive_every_deadline(
        fakes: StartFakes, stack: AsyncExitStack) -> None:
    """A response that takes longer than all the timeouts is not cut."""
    (fake,) = await fakes(1)
    fake.behaviour.chunks = 4
    fake.behaviour.chunk_delay_s = 0.5  # 2.5 s in all, five times every deadline
    url = await _router(stack, fake)
    async with aiohttp.ClientSession() as http, \
            http.post(url + "/v1/chat/completions", json=chat(stream=True)) as resp:
        assert resp.status == 200
        body = await resp.read()
    assert body.rstrip().endswith(b"data: [DONE]")
    assert body.count(b"data: ") == 6


async def test_connections_past_the_cap_are_closed(
        fakes: StartFakes, stack: AsyncExitStack, client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await _router(stack, fake, max_connections=10, idle_timeout_s=60.0,
                        header_timeout_s=60.0)
    conns = [await _connect(url) for _ in range(30)]
    await asyncio.sleep(0.5)
    still_open = [c for c in conns if await _is_open(c)]
    assert len(still_open) == 10
    for _, writer in conns:
        writer.close()
    await asyncio.sleep(0.2)
    async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 200
    metrics = await scrape(client, url)
    assert metrics[("router_connections_refused_total", (("reason", "max_connections"),))] == 20


@pytest.mark.parametrize("headers", [
    [(b"X-Big", b"a" * (1 << 20))],                          # one 1 MB header
    [(b"X-H%d" % i, b"v") for i in range(5000)],             # 5,000 headers
    [(b"X-H%d" % i, b"v") for i in range(150)],              # many, but small in all
], ids=["1MB", "5000", "150"])
async def test_oversized_headers_get_431_and_are_not_forwarded(
        fakes: StartFakes, stack: AsyncExitStack, client: aiohttp.ClientSession,
        headers: list[tuple[bytes, bytes]]) -> None:
    (fake,) = await fakes(1)
    url = await _router(stack, fake, max_header_bytes=32 * 1024, max_headers=100,
                        idle_timeout_s=5.0, header_timeout_s=10.0)
    body = orjson.dumps(chat())
    request = b"".join([
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",
        *(name + b": " + value + b"\r\n" for name, value in headers),
        b"Content-Length: %d\r\n\r\n" % len(body), body,
    ])
    conn = await _connect(url)

    async def send() -> None:
        try:
            conn[1].write(request)
            await conn[1].drain()
        except ConnectionError:
            pass  # the router stopped reading: expected

    task = asyncio.create_task(send())
    answer = (await _all_closed([conn]))[0]
    await task
    assert _error(answer, 431)["code"] == "headers_too_large"
    assert fake.seen == []
    metrics = await scrape(client, url)
    assert metrics[("router_connections_refused_total", (("reason", "headers_too_large"),))] == 1


# ---------------------------------------------------------------- kvroute serve: fds


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextmanager
def _serve(replica: str, port: int) -> Iterator[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env.update({"KVROUTE_CONNECTIONS__MAX_CONNECTIONS": "20",
                "KVROUTE_CONNECTIONS__HEADER_TIMEOUT_S": "1",
                "KVROUTE_HEALTH__INTERVAL_S": "0.2"})
    kvroute = os.path.join(os.path.dirname(sys.executable), "kvroute")
    proc = subprocess.Popen(
        [kvroute, "serve", "--host", "127.0.0.1", "--port", str(port), "--replica", replica,
         "--policy", "round_robin", "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
async def test_kvroute_serve_fds_stay_bounded_under_slowloris(
        fakes: StartFakes, client: aiohttp.ClientSession) -> None:
    """300 connections stalled mid-headers: the router process holds at most
    ``max_connections`` of them, and none once the header deadline has passed."""
    (fake,) = await fakes(1)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _serve(fake.url, port) as proc:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, "kvroute serve exited"
            try:
                async with client.get(url + "/ready") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, "kvroute serve did not become ready"
            await asyncio.sleep(0.05)
        await client.close()  # its keep-alive connection would count
        await asyncio.sleep(0.2)
        baseline = _fds(proc.pid)
        conns = []
        for _ in range(300):
            conn = await _connect(url)
            conn[1].write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
            conns.append(conn)
        # Slack of 2 for the router's own upstream connections (probes, model reads).
        peak = _fds(proc.pid)
        assert peak <= baseline + 20 + 2
        await _all_closed(conns)
        async with asyncio.timeout(WAIT_S):
            while _fds(proc.pid) > baseline + 2:
                await asyncio.sleep(0.1)
