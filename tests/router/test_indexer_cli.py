"""``kvroute indexer`` (``run_indexer``): the same KV stack as ``serve``, without the proxy.
A simulated replica (real ZMQ events) feeds it; its ``/status`` and ``/metrics`` show the
source live and the blocks applied; cancelling it stops everything cleanly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from replica.sim.server import start_sim
from replica.vllm.tiny_tokenizer import build_tokenizer
from router.config import RouterSettings
from router.indexer_cli import run_indexer
from tests.ports import free_port

MODEL = "sim-llama"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"), template="llama3")


async def _poll(http: aiohttp.ClientSession, url: str, done: str) -> str:
    """GET ``url`` until its body contains ``done`` (the test's timeout bounds it)."""
    while True:
        try:
            async with http.get(url) as resp:
                text = await resp.text()
                if done in text:
                    return text
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.05)


async def test_indexer_ingests_a_replica_and_stops_on_cancel(tokenizer_dir: Path) -> None:
    async with start_sim(tokenizer_dir, model=MODEL, time_scale=0.002) as sim, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        settings = RouterSettings.model_validate({
            "replicas": [{"id": "r0", "url": sim.url, "models": [MODEL],
                          "kv_events_endpoint": sim.kv_events_endpoint,
                          "replay_endpoint": sim.replay_endpoint}],
            "index": {"backend": "memory"},
        })  # fmt: skip
        port = free_port()
        indexer = asyncio.create_task(run_indexer(settings, metrics_port=port))
        base = f"http://127.0.0.1:{port}"
        status = await _poll(http, f"{base}/status", '"live"')
        assert '"r0"' in status
        body = {"model": MODEL, "max_tokens": 2,
                "messages": [{"role": "user", "content": "hello there " * 40}]}
        async with http.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        await _poll(http, f"{base}/metrics",
                    'router_kv_events_blocks_total{op="stored",replica="r0"}')
        indexer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await indexer
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(f"{base}/status"):
                pass
