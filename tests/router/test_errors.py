"""Every error the router answers itself: status, OpenAI-shaped body, no side effects on
requests in flight."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from router.errors import (
    BadRequest,
    BodyTooLarge,
    NoHealthyReplica,
    ReplicaTimeout,
    ReplicaUnavailable,
    RouterError,
    UnknownModel,
    UnknownPolicy,
    to_response,
)
from tests.router.conftest import StartFakes, StartRouter
from tests.router.helpers import chat


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (BadRequest("x"), 400, "invalid_request"),
        (UnknownPolicy("x"), 400, "unknown_policy"),
        (BodyTooLarge("x"), 413, "body_too_large"),
        (UnknownModel("x"), 404, "model_not_found"),
        (NoHealthyReplica("x", retry_after_s=3), 503, "no_healthy_replica"),
        (ReplicaUnavailable("x"), 502, "replica_unavailable"),
        (ReplicaTimeout("x"), 504, "replica_timeout"),
        (RouterError("x"), 500, "router_error"),
    ],
)
def test_handler_table(exc: RouterError, status: int, code: str) -> None:
    resp = to_response(exc)
    assert resp.status == status
    import orjson

    assert orjson.loads(resp.body)["error"]["code"] == code
    assert (dict(resp.headers).get(b"retry-after") == b"3") == isinstance(exc, NoHealthyReplica)


CASES: list[tuple[str, Any, dict[str, str], int, str]] = [
    ("/v1/chat/completions", b"{not json", {}, 400, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", {}, 400, "invalid_json"),
    ("/v1/chat/completions", b'{"model": "m"}', {}, 400, "missing_messages"),
    ("/v1/completions", b'{"model": "m"}', {}, 400, "missing_prompt"),
    ("/v1/chat/completions", b'{"model": 3, "messages": []}', {}, 400, "invalid_model"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [], "cache_salt": "a/b"}', {}, 400,
     "invalid_cache_salt"),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "cache_salt": ""}', {}, 400,
     "invalid_cache_salt"),
    ("/v1/chat/completions", b'{"model": "nope", "messages": []}', {}, 404, "model_not_found"),
    ("/v1/chat/completions", b'{"model": "m", "messages": []}', {"X-KVRoute-Policy": "zzz"},
     400, "unknown_policy"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [], "pad": "' + b"x" * 3000 + b'"}',
     {}, 413, "body_too_large"),
]


async def test_errors_do_not_disturb_streams_in_flight(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (fake,) = await fakes(1)
    fake.behaviour.chunks = 8
    fake.behaviour.chunk_delay_s = 0.05
    url = await start_router([fake], max_body_bytes=2048)
    direct_resp = await client.post(fake.url + "/v1/chat/completions", json=chat(stream=True))
    expected = await direct_resp.read()
    before = len(fake.completions())

    async with client.post(url + "/v1/chat/completions", json=chat(stream=True)) as stream:
        first = await stream.content.readuntil(b"\n\n")
        for path, body, headers, status, code in CASES:
            async with client.post(url + path, data=body, headers=headers) as resp:
                assert resp.status == status, (path, body[:40], await resp.text())
                err = (await resp.json())["error"]
                assert err["code"] == code
                assert set(err) == {"message", "type", "param", "code"}
                assert resp.headers["x-request-id"]
        rest = await stream.read()
    assert first + rest == expected
    # none of the bad requests reached the replica
    assert len(fake.completions()) == before + 1


async def test_body_too_large_without_content_length(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake], max_body_bytes=1000)

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b" " * 400
            await asyncio.sleep(0)

    async with client.post(url + "/v1/chat/completions", data=chunks()) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "body_too_large"
    assert fake.completions() == []


async def test_ready_and_health(fakes: StartFakes, start_router: StartRouter,
                                client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake])
    async with client.get(url + "/health") as resp:
        assert resp.status == 200
    async with client.get(url + "/ready") as resp:
        assert resp.status == 200
        assert (await resp.json())["healthy_replicas"] == [f"127.0.0.1:{fake.port}"]
