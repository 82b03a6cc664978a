"""The simulated engine's clock at a fast time scale: steps shorter than the event loop's
timer resolution still take their simulated time, no more."""

from __future__ import annotations

import asyncio

import pytest

from replica.sim.engine import EngineConfig, SimEngine
from replica.sim.scheduler import SimRequest

VOCAB = list(range(100, 1100))


def _engine(time_scale: float) -> SimEngine:
    return SimEngine(EngineConfig(model="m", block_size=16, num_blocks=256,
                                  time_scale=time_scale), VOCAB)


def _request(eng: SimEngine, rid: str, max_tokens: int) -> SimRequest:
    prompt = list(range(1, 101))
    keys = eng.scheduler.make_keys(prompt, cache_salt=None, lora_name=None)
    return SimRequest(rid, prompt, max_tokens, keys=keys, cache_salt=None, seed=1)


def _virtual_latency(max_tokens: int) -> float:
    eng = _engine(0)
    req = _request(eng, "v", max_tokens)
    eng.scheduler.add(req, 0.0)
    while eng.scheduler.has_work:
        eng.step_virtual()
    assert req.finish_s is not None
    return req.finish_s - req.arrival_s


async def _scaled_latency(max_tokens: int, time_scale: float) -> float:
    eng = _engine(time_scale)
    done = asyncio.Event()
    req = _request(eng, "s", max_tokens)
    req.on_output = lambda r: done.set() if r.finished else None
    runner = asyncio.create_task(eng.run())
    try:
        eng.submit(req)
        await asyncio.wait_for(done.wait(), timeout=30)
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
    assert req.finish_s is not None
    return req.finish_s - req.arrival_s


async def test_steps_shorter_than_a_timer_tick_keep_their_simulated_duration() -> None:
    # 400 decode steps of about 5 ms, 0.25 ms of wall time each at 0.05: every sleep
    # until a step's end wakes up late (timers fire on whole milliseconds).  Counting
    # that lateness as idle time made the request take about four times its simulated
    # duration; back-to-back steps take it exactly, less a resynchronisation or two if
    # the machine stalls (the bound leaves room for several).
    virtual = _virtual_latency(400)
    scaled = await _scaled_latency(400, 0.05)
    assert virtual <= scaled < 1.5 * virtual

