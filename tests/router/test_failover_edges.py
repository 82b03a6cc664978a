"""Failover edges: a replica that answers something that is not HTTP, and what the
response headers and the receipt say after a failover."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import aiohttp
import orjson

from kvkeys.types import ReplicaId
from router.plugins import PolicyContext
from router.policy import Decision, Policy, Receipt, RouteRequest
from tests.router.conftest import StartFakes, StartRouter
from tests.router.helpers import chat, scrape
from tests.router.test_kv_policy import Env, R, registry, req
from tests.router.test_kv_policy import chat as kv_chat

__all__ = ["registry"]  # the module fixture, shared with the kv policy's tests

_MODELS = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})


@asynccontextmanager
async def garbage_replica(answer: bytes) -> AsyncIterator[str]:
    """A replica whose ``/health`` and ``/v1/models`` are fine but which answers every
    other request with ``answer`` (not HTTP) and closes the connection."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                path = head.split(b" ", 2)[1]
                if path in (b"/health", b"/v1/models"):
                    body = b"" if path == b"/health" else _MODELS
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                    await writer.drain()
                    continue
                writer.write(answer)
                await writer.drain()
                break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


def _labels(**kw: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(kw.items()))


async def test_a_replica_answering_garbage_is_a_failed_attempt(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (good,) = await fakes(1)
    answers = [b"HTTP/1.1 abc garbage\r\n\r\n", b"SPDY/9 200 OK\r\n\r\n",
               b"HTTP/1.1 200 OK\r\nthis is not a header\r\n\r\n"]
    for answer in answers:
        async with garbage_replica(answer) as bad:
            # slow probes: only the failed attempts can tell the router it is down
            url = await start_router([bad, good], health={"interval_s": 60})
            for stream in (False, True, False, True):
                async with client.post(url + "/v1/chat/completions",
                                       json=chat(stream=stream)) as resp:
                    assert resp.status == 200, (answer, await resp.text())
                    assert resp.headers["x-kvroute-replica"] == f"127.0.0.1:{good.port}"
                    await resp.read()
            metrics = await scrape(client, url)
            bad_id = bad.removeprefix("http://")
            assert metrics[("router_upstream_requests_total",
                            _labels(replica=bad_id, outcome="bad_response"))] == 2, answer
            # two garbage answers are two passive failures: the replica is now down
            assert metrics[("router_replica_healthy", _labels(replica=bad_id))] == 0


class _Predicting:
    """Predicts 5 cached tokens on the first choice and 3 on the second."""

    name = "predicting"

    def __init__(self) -> None:
        self.receipts: list[Receipt] = []

    async def route(self, request: RouteRequest, candidates: Sequence[ReplicaId]) -> Decision:
        first, second = candidates
        return Decision((first, second), self.name, "kv_hit", prompt_tokens=11,
                        predicted_cached_tokens=5, want_usage=True,
                        predicted_by_replica={first: 5, second: 3})

    def record(self, request: RouteRequest, decision: Decision, receipt: Receipt) -> None:
        self.receipts.append(receipt)


async def test_headers_after_a_failover_describe_the_replica_that_answered(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    bad, good = await fakes(2)
    bad.behaviour.status = 503
    policy = _Predicting()

    def factory(ctx: PolicyContext) -> Policy:
        return policy

    url = await start_router([bad, good], policy="predicting",
                             policy_factories={"predicting": factory})
    for stream in (False, True):
        async with client.post(url + "/v1/chat/completions", json=chat(stream=stream)) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvroute-replica"] == f"127.0.0.1:{good.port}"
            assert resp.headers["x-kvroute-reason"] == "failover"
            assert resp.headers["x-kvroute-predicted-cached-tokens"] == "3"
            await resp.read()
    assert [r.replica for r in policy.receipts] == [f"127.0.0.1:{good.port}"] * 2
    good.behaviour.status, bad.behaviour.status = 503, 200
    async with client.post(url + "/v1/chat/completions", json=chat()) as resp:
        # no failover: the first choice's own reason and prediction
        assert resp.headers["x-kvroute-replica"] == f"127.0.0.1:{bad.port}"
        assert resp.headers["x-kvroute-reason"] == "kv_hit"
        assert resp.headers["x-kvroute-predicted-cached-tokens"] == "5"


async def test_the_receipt_of_a_failover_is_checked_against_its_replica(
    registry: object,
) -> None:
    env = Env(registry)  # type: ignore[arg-type]
    r = req(kv_chat("failover receipts", "a", "b"))
    await env.hold(R[1], req(kv_chat("failover receipts")))
    await env.hold(R[2], req(kv_chat("failover receipts")), blocks=2)
    d = await env.policy.route(r, R)
    assert d.replica == R[1] and d.predicted_cached_tokens
    second = d.predicted_for(R[2])
    assert second == 32  # the two blocks R[2] holds
    # R[1] failed before the first byte; R[2] answered with what was predicted for it
    env.policy.record(r, d, Receipt(R[2], True, prompt_tokens=500, cached_tokens=second))
    assert env.value("router_receipts_total", replica="r2", outcome="match") == 1
    assert env.value("router_receipt_prompt_tokens_total", replica="r2", kind="cached") == 32
    assert env.value("router_receipts_total", replica="r1", outcome="match") == 0
