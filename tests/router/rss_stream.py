"""A router under a stream of distinct sessions and prompts, reporting its RSS.

Run as ``python -m tests.router.rss_stream N`` (a fresh process, so the figures are the
router's own): the real app under uvicorn on loopback, the ``kv`` policy rendering
locally with small memo budgets, two fake replicas; ``N`` chat requests, each a new
session (a distinct ``X-Session-ID`` and ``user``) with a distinct prompt of ~2 kB.
Prints one JSON line: the RSS in MiB after each fifth of the stream."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
import orjson
from prometheus_client import CollectorRegistry

from replica.vllm.tiny_tokenizer import build_tokenizer
from router.app import create_app
from tests.router.fake_replica import FakeReplica
from tests.router.helpers import router_settings
from tests.router.server import run_server

BUDGET = {
    "prompt_memory": {"piece_cache_tokens": 100_000, "word_cache_words": 5_000,
                      "turn_memo_bytes": 2_000_000, "key_memo_units": 10_000},
    "max_sessions": 2_000, "session_token_bytes": 2_000_000, "provisional_max_keys": 20_000,
}
"""About 15 MB of memos in all (see ``router.config``)."""


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


async def main(n: int) -> list[float]:
    tok = build_tokenizer(Path(tempfile.mkdtemp()), template="llama3")
    rng = random.Random(7)
    words = [f"{rng.choice('bcdfgklmnprst')}{i}x" for i in range(50_000)]
    async with AsyncExitStack() as stack:
        fakes = [await stack.enter_async_context(FakeReplica(f"r{i}")) for i in range(2)]
        settings = router_settings(
            fakes, policy="kv", health={"interval_s": 5.0},
            scoring={"models": [{"name": "m", "block_size": 16, "tokenizer": str(tok)}],
                     "discover_kv_events": False, "scrape": {"enabled": False}, **BUDGET},
        )
        url = await stack.enter_async_context(
            run_server(create_app(settings, registry=CollectorRegistry())))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        marks: list[float] = [rss_mib()]
        for i in range(n):
            text = " ".join(rng.choice(words) for _ in range(300))
            body = {"model": "m", "user": f"user-{i}-" + "u" * 200, "max_tokens": 2,
                    "messages": [{"role": "system", "content": f"system {i % 7}"},
                                 {"role": "user", "content": text}]}
            async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body),
                                 headers={"X-Session-ID": f"session-{i}-" + "s" * 500}) as r:
                assert r.status == 200, await r.text()
                await r.read()
            for fake in fakes:
                fake.seen.clear()  # the fakes keep every request; only the router counts
            if (i + 1) % (n // 5) == 0:
                marks.append(rss_mib())
        return marks


if __name__ == "__main__":
    print(orjson.dumps(asyncio.run(main(int(sys.argv[1])))).decode())
