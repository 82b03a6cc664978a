"""Tenant cache salts with the kv policy end to end: simulated vLLM replicas (real HTTP,
real ZMQ KV events), the router with API keys, and the check that each prediction uses
the salt the router actually forwarded (so it matches what the replica reports)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from replica.sim.server import start_sim
from replica.vllm.tiny_tokenizer import build_tokenizer
from router.app import create_app
from router.config import RouterSettings
from tests.router.server import run_server

MODEL = "sim-llama"
SYSTEM = "You are the shared assistant. " + " ".join(
    f"Rule {i}: answer carefully and cite section {i}." for i in range(60))
KEYS = {"a": "sk-tenant-a-1111", "b": "sk-tenant-b-2222"}
TIMEOUT = aiohttp.ClientTimeout(total=30)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"), template="llama3")


@pytest.fixture
async def fleet(tokenizer_dir: Path) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    async with AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(
            start_sim(tokenizer_dir, model=MODEL, num_blocks=4096, time_scale=0.002, seed=i))
            for i in range(2)]
        settings = RouterSettings.model_validate({
            "replicas": [{"url": s.url, "id": f"r{i}", "models": [MODEL],
                          "kv_events_endpoint": s.kv_events_endpoint,
                          "replay_endpoint": s.replay_endpoint}
                         for i, s in enumerate(sims)],
            "policy": "kv",
            "health": {"interval_s": 0.2},
            "scoring": {"models": [{"name": MODEL, "block_size": 16,
                                    "tokenizer": str(tokenizer_dir)}],
                        "discover_kv_events": False, "scrape": {"interval_s": 0.2}},
            "auth": {
                "keys": [{"sha256": hashlib.sha256(k.encode()).hexdigest(), "tenant": t}
                         for t, k in KEYS.items()],
                "tenants": [{"name": "a", "trusted": True}, {"name": "b", "trusted": True}],
            },
        })
        url = await stack.enter_async_context(
            run_server(create_app(settings, registry=CollectorRegistry())))
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=TIMEOUT))
        yield url, http


def _body(user: str, salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    if salt is not None:
        body["cache_salt"] = salt
    return body


async def _send(url: str, http: aiohttp.ClientSession, tenant: str, user: str,
                salt: str | None = None) -> tuple[int, int]:
    """(predicted, reported) cached tokens of one request."""
    async with http.post(url + "/v1/chat/completions", json=_body(user, salt),
                         headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as resp:
        assert resp.status == 200, await resp.text()
        predicted = int(resp.headers.get("x-kvroute-predicted-cached-tokens", "0"))
        usage = (await resp.json())["usage"]
    return predicted, (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def _indexed(url: str, http: aiohttp.ClientSession, tenant: str, user: str,
                   salt: str | None = None) -> int:
    """Wait until ``/debug/route`` (which applies the tenant's salt too) predicts a hit
    for the request: its blocks' KV events have reached the index."""
    async with asyncio.timeout(15):
        while True:
            async with http.post(url + "/debug/route", json=_body(user, salt),
                                 headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as resp:
                assert resp.status == 200
                predicted: int = (await resp.json())["predicted_cached_tokens"] or 0
            if predicted > 0:
                return predicted
            await asyncio.sleep(0.05)


async def test_tenants_do_not_share_blocks_and_predictions_use_the_forwarded_salt(
        fleet: tuple[str, aiohttp.ClientSession]) -> None:
    url, http = fleet
    assert await _send(url, http, "a", "first question") == (0, 0)
    expected = await _indexed(url, http, "a", "second question")
    # Same tenant, same system prompt: a hit, predicted exactly.
    predicted, cached = await _send(url, http, "a", "second question")
    assert predicted == cached == expected > 0
    # Another tenant with the very same prompt: nothing shared, nothing predicted.
    assert await _send(url, http, "b", "second question") == (0, 0)
    # A client's own salt is a sub-namespace of its tenant's: a miss at first, then hits
    # predicted with the namespaced salt the replica hashed (not the client's raw one).
    assert await _send(url, http, "a", "third question", salt="team-x") == (0, 0)
    expected = await _indexed(url, http, "a", "fourth question", salt="team-x")
    predicted, cached = await _send(url, http, "a", "fourth question", salt="team-x")
    assert predicted == cached == expected > 0
    # Tenant b naming tenant a's salt (or a's sub-salt) reaches neither.
    assert await _send(url, http, "b", "fifth question", salt="a") == (0, 0)
    assert await _send(url, http, "b", "sixth question", salt="team-x") == (0, 0)
