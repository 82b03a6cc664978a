"""Fixtures for the router tests: fake replicas and the router under a real uvicorn.

``fakes(n)`` starts ``n`` ``FakeReplica``s; ``start_router(replicas, **settings)`` builds
the app (fresh Prometheus registry, fast health checking) and serves it on a free port;
both are torn down at the end of the test.  ``client`` is an aiohttp session.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.plugins import PolicyFactory
from tests.router.fake_replica import FakeReplica
from tests.router.helpers import router_settings
from tests.router.server import run_server

StartFakes = Callable[[int], Awaitable[list[FakeReplica]]]
StartRouter = Callable[..., Awaitable[str]]


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


@pytest.fixture
async def fakes(stack: AsyncExitStack) -> StartFakes:
    async def start(n: int) -> list[FakeReplica]:
        return [await stack.enter_async_context(FakeReplica(f"r{i}")) for i in range(n)]

    return start


@pytest.fixture
async def start_router(stack: AsyncExitStack) -> StartRouter:
    async def start(
        replicas: Sequence[FakeReplica | str],
        *,
        policy_factories: Mapping[str, PolicyFactory] | None = None,
        registry: CollectorRegistry | None = None,
        **overrides: Any,
    ) -> str:
        settings = router_settings(replicas, **overrides)
        app = create_app(settings, registry=registry or CollectorRegistry(),
                         policy_factories=policy_factories)
        return await stack.enter_async_context(run_server(app))

    return start


@pytest.fixture
async def client(stack: AsyncExitStack) -> aiohttp.ClientSession:
    return await stack.enter_async_context(aiohttp.ClientSession())
