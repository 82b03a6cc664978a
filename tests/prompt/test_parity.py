"""The parity checker finds rendering drift against a replica's ``/tokenize``."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from prompt.parity import Mismatch, ParityChecker, first_difference
from prompt.registry import ModelSpec, RendererRegistry
from prompt.remote_render import RemoteRenderer


@dataclass
class TokenizeReplica:
    """Answers ``/tokenize`` with the router's own renderer, optionally drifted."""

    registry: RendererRegistry
    url: str = ""
    drift_at: int | None = None
    extra_token: bool = False
    delay_s: float = 0.0
    calls: list[dict[str, Any]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(body)
        await asyncio.sleep(self.delay_s)
        if "messages" in body:
            ids = list(self.registry.render_chat(body).token_ids)
        else:
            ids = list(self.registry.render_completion(body)[0].token_ids)
        if self.drift_at is not None:
            ids[self.drift_at] += 1
        if self.extra_token:
            ids.append(7)
        return web.json_response({"count": len(ids), "max_model_len": 64, "tokens": ids})


@pytest.fixture
def registry(tiny_dirs: dict[str, Path]) -> RendererRegistry:
    return RendererRegistry([ModelSpec(name="m", block_size=4, tokenizer=tiny_dirs["llama3"])])


@pytest.fixture
async def replica(registry: RendererRegistry) -> AsyncIterator[TokenizeReplica]:
    fake = TokenizeReplica(registry)
    app = web.Application()
    app.router.add_post("/tokenize", fake.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    fake.url = str(server.make_url("")).rstrip("/")
    try:
        yield fake
    finally:
        await server.close()


@pytest.fixture
async def remote() -> AsyncIterator[RemoteRenderer]:
    async with aiohttp.ClientSession() as session:
        yield RemoteRenderer(session, timeout_s=0.5)


BODY: dict[str, Any] = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is a block hash?"},
    ],
}


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], []) is None


async def test_equal_renderings_match(
    registry: RendererRegistry, replica: TokenizeReplica, remote: RemoteRenderer
) -> None:
    checker = ParityChecker(remote, sample_rate=1.0)
    local = registry.render_chat(BODY)
    assert await checker.check_chat(replica.url, BODY, local) is None
    assert await checker.check_chat(replica.url, BODY, local) is None
    assert len(replica.calls) == 2  # parity checks never use the remote cache
    assert (checker.stats.checks, checker.stats.matches, checker.stats.mismatches) == (2, 2, 0)


async def test_drift_is_detected_counted_and_logged(
    registry: RendererRegistry,
    replica: TokenizeReplica,
    remote: RemoteRenderer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[Mismatch] = []
    checker = ParityChecker(remote, sample_rate=1.0, on_mismatch=seen.append)
    local = registry.render_chat(BODY)
    replica.drift_at = 9
    with caplog.at_level(logging.WARNING, logger="prompt.parity"):
        miss = await checker.check_chat(replica.url, BODY, local)
    assert miss is not None and seen == [miss]
    assert miss.position == 9 and miss.local_tokens == miss.remote_tokens == local.num_tokens
    assert miss.local_context == tuple(local.token_ids[5:14])
    assert miss.remote_context[4] == local.token_ids[9] + 1
    assert checker.stats.mismatches == 1
    assert "first_diff=9" in caplog.text and "what is" not in caplog.text  # ids, never text
    replica.drift_at = None
    replica.extra_token = True
    miss = await checker.check_chat(replica.url, BODY, local)
    assert miss is not None and miss.position == local.num_tokens
    assert miss.remote_tokens == local.num_tokens + 1


async def test_completion_prompts_are_checked_one_by_one(
    registry: RendererRegistry, replica: TokenizeReplica, remote: RemoteRenderer
) -> None:
    checker = ParityChecker(remote, sample_rate=1.0)
    body = {"model": "m", "prompt": ["alpha beta", "gamma"]}
    local = registry.render_completion(body)
    assert await checker.check_completion(replica.url, body, local) == []
    assert [c["prompt"] for c in replica.calls] == ["alpha beta", "gamma"]
    assert all(c["add_special_tokens"] is True for c in replica.calls)
    replica.drift_at = 0
    misses = await checker.check_completion(replica.url, body, local)
    assert [m.position for m in misses] == [0, 0]


async def test_unreproducible_requests_are_skipped(
    registry: RendererRegistry, replica: TokenizeReplica, remote: RemoteRenderer
) -> None:
    checker = ParityChecker(remote, sample_rate=1.0)
    truncated = {**BODY, "truncate_prompt_tokens": 5}
    assert await checker.check_chat(replica.url, truncated, registry.render_chat(truncated)) is None
    ids_body = {"model": "m", "prompt": [1, 2, 3]}
    assert (
        await checker.check_completion(replica.url, ids_body, registry.render_completion(ids_body))
        == []
    )
    assert checker.stats.skipped == 2 and replica.calls == []


async def test_failures_are_counted_never_raised(
    registry: RendererRegistry, replica: TokenizeReplica, remote: RemoteRenderer
) -> None:
    checker = ParityChecker(remote, sample_rate=1.0)
    replica.delay_s = 2.0
    assert await checker.check_chat(replica.url, BODY, registry.render_chat(BODY)) is None
    assert await checker.check_chat("http://127.0.0.1:1", BODY, registry.render_chat(BODY)) is None
    assert checker.stats.errors == 2 and checker.stats.checks == 0


async def test_sampling_rate_and_in_flight_bound(
    registry: RendererRegistry, replica: TokenizeReplica, remote: RemoteRenderer
) -> None:
    checker = ParityChecker(remote, sample_rate=0.25, rng=random.Random(7))
    hits = sum(checker.should_sample() for _ in range(4000))
    assert 850 < hits < 1150
    assert not ParityChecker(remote, sample_rate=0.0).should_sample()
    with pytest.raises(ValueError):
        ParityChecker(remote, sample_rate=1.5)

    bounded = ParityChecker(remote, sample_rate=1.0, max_in_flight=1)
    replica.delay_s = 0.2
    local = registry.render_chat(BODY)
    task = asyncio.create_task(bounded.check_chat(replica.url, BODY, local))
    while not replica.calls:
        await asyncio.sleep(0.01)
    assert not bounded.should_sample()
    assert bounded.stats.dropped == 1
    assert await task is None
    assert bounded.should_sample()
