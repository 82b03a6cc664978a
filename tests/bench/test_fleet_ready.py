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


class WorkersEndpoint:
    """``/ready`` of ``kvroute serve --workers 2``: the kernel gives each new connection
    to one of the workers (here they take turns); worker 1's sources replay for its
    first ``behind`` answers."""

    def __init__(self, behind: int) -> None:
        self.behind = behind
        self.answers = {0: 0, 1: 0}
        self.peers: set[object] = set()
        self.calls = 0

    async def ready(self, request: web.Request) -> web.Response:
        self.calls += 1
        self.peers.add(request.transport.get_extra_info("peername") if request.transport
                       else None)
        worker = self.calls % 2
        self.answers[worker] += 1
        state = "resyncing" if worker == 1 and self.answers[1] <= self.behind else "live"
        return web.json_response({"ready": True, "worker": worker,
                                  "kv_events": {"ok": True, "sources": {"a": state}}})


async def test_several_workers_are_waited_for_each_on_a_new_connection() -> None:
    endpoint = WorkersEndpoint(behind=3)
    app = web.Application()
    app.router.add_get("/ready", endpoint.ready)
    async with serve_app(app) as url:
        await wait_kv_live(url, time.monotonic() + 10, workers=2)
    # worker 0 was live from its first answer; the wait went on until worker 1 was too
    assert endpoint.answers[1] == 4
    assert len(endpoint.peers) == endpoint.calls  # a new connection every time


async def test_one_worker_live_is_not_enough_for_two() -> None:
    endpoint = WorkersEndpoint(behind=10**6)
    app = web.Application()
    app.router.add_get("/ready", endpoint.ready)
    async with serve_app(app) as url:
        with pytest.raises(FleetError, match=r"workers live: \[0\] of 2"):
            await wait_kv_live(url, time.monotonic() + 0.5, workers=2)


async def test_a_dead_router_is_reported_at_once(
    replaying: tuple[str, ReadyEndpoint],
) -> None:
    url, endpoint = replaying

    def died() -> None:
        raise FleetError("router exited with status 1")

    with pytest.raises(FleetError, match="exited"):
        await wait_kv_live(url, time.monotonic() + 10, check=died)
    assert endpoint.calls == 0
