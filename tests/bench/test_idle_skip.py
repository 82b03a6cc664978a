"""Skipping a compressed benchmark's idle time: the runner's sleepers wake early when the
fleet is idle, never while a request is in flight, and a real simulated replica's clock
moves with the runner's, so a conversation's next turn finds what the replica held."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aio.clock_warp import ClockWarp
from bench.idle_skip import IdleSkipper
from bench.runner import RunConfig, Runner
from bench.trace import TraceRequest
from replica.sim.engine import EngineConfig
from replica.sim.server import SimHandle, start_sim


@pytest.fixture
def warp(tmp_path: Path) -> ClockWarp:
    return ClockWarp.create(tmp_path / "warp")


async def _sleep_with_skipper(clock: IdleSkipper, seconds: float) -> float:
    """Wall seconds ``clock.sleep_until(now + seconds)`` took, with its skipper running."""
    skipper = asyncio.create_task(clock.run())
    try:
        started = time.perf_counter()
        await clock.sleep_until(clock.now() + seconds)
        return time.perf_counter() - started
    finally:
        skipper.cancel()


async def test_an_idle_wait_is_skipped(warp: ClockWarp) -> None:
    clock = IdleSkipper(warp, lead_s=0.01)
    before = clock.now()
    wall = await _sleep_with_skipper(clock, 30.0)
    assert wall < 2.0
    assert clock.now() - before >= 30.0
    assert warp.offset() == pytest.approx(clock.skipped_s) and clock.skipped_s > 29.0


async def test_nothing_is_skipped_while_a_request_is_in_flight(warp: ClockWarp) -> None:
    clock = IdleSkipper(warp)
    with clock.busy():
        wall = await _sleep_with_skipper(clock, 0.3)
    assert wall >= 0.3 and clock.skipped_s == 0.0 == warp.offset()


async def test_a_short_gap_and_a_fresh_reply_are_waited_out(warp: ClockWarp) -> None:
    clock = IdleSkipper(warp, min_gap_s=0.5, settle_s=0.05)
    assert await _sleep_with_skipper(clock, 0.3) >= 0.3  # under min_gap_s
    with clock.busy():
        pass
    # Just idle: a far turn is not due before the fleet has settled.
    key_due = clock.now() + 10.0
    sleeper = asyncio.create_task(clock.sleep_until(key_due))
    await asyncio.sleep(0)
    assert clock.skip() == 0.0
    await asyncio.sleep(0.06)
    assert clock.skip() > 9.0
    await sleeper


async def test_without_a_warp_file_it_is_the_wall_clock() -> None:
    clock = IdleSkipper()
    assert await _sleep_with_skipper(clock, 0.2) >= 0.2
    assert clock.skipped_s == 0.0 and clock.skip() == 0.0


@pytest.fixture
async def replica(llama3_dir: Path, warp: ClockWarp) -> AsyncIterator[SimHandle]:
    engine = EngineConfig(model="m", num_blocks=256, time_scale=0.05, clock_file=str(warp.path))
    async with start_sim(llama3_dir, model="m", engine=engine) as handle:
        yield handle


async def test_a_replayed_think_time_is_skipped_and_the_replica_keeps_time(
    replica: SimHandle, warp: ClockWarp,
) -> None:
    # Two turns 60 simulated seconds apart: 3 s of wall time at 0.05, skipped.
    url = replica.url
    trace = [
        TraceRequest(session="s", turn=1, at=0.0, user="tell me about caches " * 30,
                     max_tokens=4, reply="caches keep blocks", system="be brief"),
        TraceRequest(session="s", turn=2, at=60.0, think_s=60.0, user="and eviction?",
                     max_tokens=4),
    ]
    cfg = RunConfig(url=url, model="m", time_scale=0.05, sim_timing=True,
                    clock_file=warp.path)
    started = time.perf_counter()
    async with Runner(cfg) as runner:
        results = await runner.run(trace)
    wall = time.perf_counter() - started
    first, second = sorted(results, key=lambda r: r.turn)
    assert first.ok and second.ok, results
    assert wall < 2.0, wall
    # In the run's clock the second turn went out a think time after the first reply.
    assert second.sent_s - (first.sent_s + (first.latency_s or 0)) >= 3.0
    assert warp.offset() > 2.5
    # The replica's engine clock moved with it (a minute of simulated time went by), its
    # simulated TTFT is a prefill's, not the skipped wait, and the conversation's blocks
    # were still there.
    assert replica.server.engine.now() >= 60.0
    assert second.sim_ttft_s is not None and second.sim_ttft_s < 1.0
    assert (second.cached_tokens or 0) > 0
