"""What the look-ahead bus tests share (``test_outlook_peers``, ``test_outlook_redis``):
a look ahead over one replica ``A`` with a known pool, prompts, its pins, and a wait."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvkeys.types import ReplicaId
from prompt.keyer import Prompt
from router.fleet_outlook import FleetOutlook, OutlookSettings
from router.horizon import HorizonEstimator, PoolSample

A = ReplicaId("a")


def outlook() -> tuple[FleetOutlook, HorizonEstimator]:
    """A look ahead and its horizon, replica ``A``'s pool 1,000 blocks and empty."""
    h = HorizonEstimator()
    h.observe_scrape(A, PoolSample(t=100.0, block_size=16, num_gpu_blocks=1000, kv_usage=0.0,
                                   computed_prompt_tokens_total=None,
                                   generation_tokens_total=None))
    out = FleetOutlook(h, OutlookSettings(), prefill_tokens_per_s=1000.0, alpha=1.0, beta=1.0)
    return out, h


async def until(done: Callable[[], bool], poke: Callable[[], object] = lambda: None,
                timeout_s: float = 10.0) -> None:  # fmt: skip
    """Until ``done()``, calling ``poke()`` between looks; fails after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not done():
        assert loop.time() < deadline, "the other router never heard it"
        poke()
        await asyncio.sleep(0.01)


def prompt(tokens: int) -> Prompt:
    """A prompt of ``tokens`` tokens in blocks of 16."""
    return Prompt(token_ids=[1] * tokens, block_keys=[], block_size=16, model="m")


def pinned(out: FleetOutlook) -> float:
    """The blocks ``out`` holds pinned on ``A``."""
    pins = out._pinned.get(A)
    return pins.blocks if pins is not None else 0.0
