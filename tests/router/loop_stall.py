"""The router's worst event-loop stall under a mix of 6 MB and normal prompts.

Run as ``python -m tests.router.loop_stall [N_BIG] [N_SMALL]`` (a fresh process): the
real app under uvicorn on loopback, the ``kv`` policy rendering locally in front of two
fake replicas, and a ticker on the loop (a 1 ms timer: the stall is how late it fires,
and the CPU the loop's thread used meanwhile, which leaves out the time the machine gave
to other processes).  ``N_BIG`` chats of 6 MB of text among ``N_SMALL`` normal ones,
paced at 40 per second, in two cases: ``refused`` (the model's ``max_model_len`` is
known, so a prompt that cannot fit is vLLM's 400 from its length, before tokenising) and
``rendered`` (no length known: the render worker tokenises it within its budget, or the
request routes by affinity).  The clients run on the same loop (their share is a 6 MB
write per big request), so the figures are an upper bound.  Prints one JSON line per
case: worst, p99 and top-5 stalls in ms (wall and CPU) and the answers' statuses.
``--rendered-first`` swaps the cases (the first 6 MB request of a process is the slowest,
whichever case it is in).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from replica.vllm.tiny_tokenizer import build_tokenizer
from router.app import create_app
from tests.router.fake_replica import FakeReplica
from tests.router.helpers import router_settings
from tests.router.server import run_server
from tests.router.test_big_prompts import _chat, _mix, _text

BIG_CHARS = 6 * 10**6


class _Ticker:
    """Every tick's lateness (wall) and the loop thread's CPU time over the tick."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._stop = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop:
            t, c = loop.time(), time.thread_time()
            await asyncio.sleep(0.001)
            self.wall.append(max(0.0, loop.time() - t - 0.001))
            self.cpu.append(time.thread_time() - c)

    def stop(self) -> None:
        self._stop = True


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


async def case(tok: Path, name: str, n_big: int, n_small: int, **model: Any) -> dict[str, Any]:
    async with AsyncExitStack() as stack:
        fakes = [await stack.enter_async_context(FakeReplica(f"r{i}")) for i in range(2)]
        settings = router_settings(
            fakes, policy="kv", health={"interval_s": 5.0},
            scoring={"models": [{"name": "m", "block_size": 16, "tokenizer": str(tok), **model}],
                     "discover_kv_events": False, "scrape": {"enabled": False}},
        )  # fmt: skip
        url = await stack.enter_async_context(
            run_server(create_app(settings, registry=CollectorRegistry()))
        )
        big = [_chat(_text(BIG_CHARS, seed=i)) for i in range(n_big)]
        ticker = _Ticker()
        task = asyncio.get_running_loop().create_task(ticker.run())
        await asyncio.sleep(0.05)
        results = await _mix(url, big, n_small)
        ticker.stop()
        await task
    return {
        "case": name,
        "big_bytes": len(big[0]),
        "statuses": {f"{k} {s}": n for (k, s), n in Counter((k, s) for k, s, _ in results).items()},
        "worst_stall_ms": _ms(ticker.wall, 1.0),
        "p99_stall_ms": _ms(ticker.wall, 0.99),
        "worst_cpu_ms": _ms(ticker.cpu, 1.0),
        "p99_cpu_ms": _ms(ticker.cpu, 0.99),
        "top5_stall_ms": [round(1000 * w, 1) for w in sorted(ticker.wall)[-5:]],
        "ticks_over_20ms": sum(w > 0.02 for w in ticker.wall),
        "ticks": len(ticker.wall),
    }


async def main(n_big: int, n_small: int) -> None:
    tok = build_tokenizer(Path(tempfile.mkdtemp()), template="llama3")
    cases: list[tuple[str, dict[str, Any]]] = [
        ("refused", {"max_model_len": 8192}),
        ("rendered", {}),
    ]
    for name, model in cases[::-1] if "--rendered-first" in sys.argv else cases:
        print(orjson.dumps(await case(tok, name, n_big, n_small, **model)).decode(), flush=True)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:] if a.isdigit()]
    asyncio.run(main(*(args or [4, 60])))
