"""The fleet hands a router to a benchmark only once every KV event source it lists is
live: a router serves after its start-up sync window even while it is still replaying
the replicas' event history (``bench.fleet.wait_kv_live``), against a real HTTP server
on loopback that answers ``/ready`` as the router does."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import web

from bench.fleet import FleetError, wait_kv_live
from tests.loopback_app import serve_app


class ReadyEndpoint:
    """``/ready`` whose sources report the next state of a script at each call (the
    last one repeats)."""

    def __init__(self, states: list[dict[str, str]]) -> None:
        self._states: Iterator[dict[str, str]] = iter(states)
        self._last = states[-1]
        self.calls = 0

    async def ready(self, request: web.Request) -> web.Response:
        self.calls += 1
        sources = next(self._states, self._last)
        return web.json_response({"ready": True, "kv_events": {"ok": True,
                                                               "sources": sources}})


def _serve(endpoint: ReadyEndpoint) -> contextlib.AbstractAsyncContextManager[str]:
    app = web.Application()
    app.router.add_get("/ready", endpoint.ready)
    return serve_app(app)


@pytest.fixture
async def replaying() -> AsyncIterator[tuple[str, ReadyEndpoint]]:
    """Two sources: one live at once, one replaying for three more answers."""
    endpoint = ReadyEndpoint([
        {"a": "starting", "b": "starting"},
        {"a": "live", "b": "resyncing"},
        {"a": "live", "b": "resyncing"},
        {"a": "live", "b": "live"},
    ])
    async with _serve(endpoint) as url:
        yield url, endpoint


async def test_waits_until_every_source_is_live(replaying: tuple[str, ReadyEndpoint]) -> None:
    url, endpoint = replaying
    await wait_kv_live(url, time.monotonic() + 10)
    assert endpoint.calls == 4


async def test_a_router_without_event_sources_is_not_waited_for() -> None:
    endpoint = ReadyEndpoint([{}])
    async with _serve(endpoint) as url:
        await wait_kv_live(url, time.monotonic() + 10)
    assert endpoint.calls == 1


async def test_a_source_that_never_gets_live_fails_with_its_state() -> None:
    endpoint = ReadyEndpoint([{"a": "live", "b": "degraded"}])
    async with _serve(endpoint) as url:
        with pytest.raises(FleetError, match="'b': 'degraded'"):
            await wait_kv_live(url, time.monotonic() + 0.3)
    assert endpoint.calls > 1


async def test_a_dead_router_is_reported_at_once(
    replaying: tuple[str, ReadyEndpoint],
) -> None:
    url, endpoint = replaying

    def died() -> None:
        raise FleetError("router exited with status 1")

    with pytest.raises(FleetError, match="exited"):
        await wait_kv_live(url, time.monotonic() + 10, check=died)
    assert endpoint.calls == 0
