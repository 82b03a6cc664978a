"""The simulated engine core: the scheduler's step loop on asyncio, in simulated time.

Contract:

* ``SimEngine.run()`` is the one task that steps the scheduler; its owner (the server's
  lifespan) cancels and awaits it.  No threads.
* Time: ``time_scale`` is wall-clock seconds per simulated second (1.0 = real time,
  0.01 = a hundred times faster).  ``time_scale == 0`` runs in *virtual* time: steps
  follow each other with no sleep, and the simulated clock only advances by step
  durations (used by benchmarks to measure the engine's CPU cost).
* Steps run back to back while requests run: the next step starts when the last one
  ended in simulated time, not when the loop wakes up.  The loop's timers fire on whole
  milliseconds, later than asked, and at a fast time scale a step lasts less than that
  (a 6 ms decode step is 0.6 ms of wall time at 0.1): starting each step at the wall
  clock's time counted every late wake-up as idle time, half the engine's capacity at
  0.1.  A request that arrives after a step's start joins a later step, as in the engine
  modelled (``Scheduler.schedule``).  A step that ends more than ``RESYNC_S`` of wall
  time late (a busy machine) puts the engine back on the wall clock: that time is lost,
  not compressed.
* ``clock_file`` (a ``aio.clock_warp`` file, set by a benchmark) adds its offset to the
  wall clock the engine reads: the benchmark moves it forward while the fleet is idle,
  so the simulated clock skips the wait for the trace's next turn.
* After each step the engine publishes that step's pool events as one batch through its
  ``EventSink`` (vLLM publishes one ``KVEventBatch`` per step that produced events),
  then wakes the requests that produced a token (``SimRequest.on_output``).
* ``reset_prefix_cache()`` mirrors vLLM's: it fails while requests hold blocks.

What it does not do: HTTP, tokenising, metrics exposition (``replica.sim.server``,
``replica.sim.metrics``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from aio.clock_warp import ClockWarp
from replica.sim.block_pool import BlockPool, make_engine_hasher
from replica.sim.offload import HostTier
from replica.sim.pool_events import PoolEvent
from replica.sim.profiles import Profile, get_profile
from replica.sim.scheduler import Scheduler, SimRequest


class EventSink(Protocol):
    """Where one step's KV events go (a ZMQ publisher in production, a list in tests)."""

    async def publish(self, events: Sequence[PoolEvent]) -> None:
        """Publish one step's events as one batch."""


class ListSink:
    """An ``EventSink`` that keeps every batch in memory (tests, benchmarks)."""

    def __init__(self) -> None:
        self.batches: list[list[PoolEvent]] = []

    async def publish(self, events: Sequence[PoolEvent]) -> None:
        self.batches.append(list(events))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes one simulated engine."""

    model: str
    block_size: int = 16
    num_blocks: int | None = None
    """Physical KV blocks, the null block included (vLLM's ``num_gpu_blocks``); the
    profile's figure when ``None``."""
    profile: str = "default"
    time_scale: float = 1.0
    seed: int = 0
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    cpu_offload_blocks: int = 0
    """Host-tier capacity in blocks (0: no host tier)."""
    cpu_offload_bandwidth: float = 25e9
    """Host-to-GPU copy bandwidth in bytes/s (PCIe 5 x16 is ~50 GB/s raw, ~25 effective)."""
    clock_file: str | None = None
    """A benchmark's shared clock offset (``aio.clock_warp``; module docstring)."""

    def resolved_profile(self) -> Profile:
        """The timing profile named by ``profile``."""
        return get_profile(self.profile)


RESYNC_S = 0.005
"""Wall seconds a step may end late before the engine's clock goes back to the wall
clock (module docstring): several timer ticks, less than the pause of a busy machine."""


class SimEngine:
    """Scheduler + pool + step loop; the part of a simulated replica without HTTP."""

    def __init__(
        self, config: EngineConfig, vocab: list[int], *, sink: EventSink | None = None
    ) -> None:
        if config.time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        profile = config.resolved_profile()
        self.config = config
        self.profile = profile
        num_blocks = config.num_blocks or profile.num_gpu_blocks(config.block_size)
        host = None
        if config.cpu_offload_blocks > 0:
            host = HostTier(
                config.cpu_offload_blocks,
                block_bytes=profile.kv_bytes_per_token * config.block_size,
                bandwidth_bytes_per_s=config.cpu_offload_bandwidth,
            )
        self.pool = BlockPool(
            num_blocks, config.block_size, hasher=make_engine_hasher(config.seed ^ 0x5EED),
            host_tier=host,
        )
        self.scheduler = Scheduler(
            self.pool, profile, model=config.model, vocab=vocab,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
        )
        capacity = (num_blocks - 1) * config.block_size
        self.max_model_len = min(config.max_model_len or profile.max_model_len, capacity)
        self.sink = sink
        self.time_scale = config.time_scale
        self.steps = 0
        self._wake = asyncio.Event()
        self._t0: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warp = ClockWarp.open(Path(config.clock_file)) if config.clock_file else None
        self._virtual_now = 0.0
        self._reset_pending = False

    # ---- clock ---------------------------------------------------------------------

    def now(self) -> float:
        """Current simulated time in seconds since the engine started."""
        if self.time_scale == 0:
            return self._virtual_now
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        if self._t0 is None:
            self._t0 = self._wall(loop)
        return (self._wall(loop) - self._t0) / self.time_scale

    def close(self) -> None:
        """Unmap the clock file (``clock_file``), once ``run`` has stopped."""
        if self._warp is not None:
            self._warp.close()

    def _wall(self, loop: asyncio.AbstractEventLoop) -> float:
        """The loop's clock plus the benchmark's skipped idle time (``clock_file``)."""
        return loop.time() + self._warp.offset() if self._warp is not None else loop.time()

    # ---- requests ------------------------------------------------------------------

    def submit(self, req: SimRequest) -> None:
        """Queue a request; its ``on_output`` fires after each step that gives it a token
        (only after the last one when ``req.stream`` is false)."""
        self.scheduler.add(req, self.now())
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Forget a request whose client went away."""
        self.scheduler.abort(req)

    @property
    def num_running(self) -> int:
        """``vllm:num_requests_running``."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """``vllm:num_requests_waiting``."""
        return len(self.scheduler.waiting)

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (``AllBlocksCleared``); ``False`` while blocks are in use.

        As in vLLM 0.32, the ``AllBlocksCleared`` event goes out with the next engine
        step's batch, even when the engine is idle: a router that watches events keeps
        the old blocks until the next request runs (the real engine behaves the same).
        """
        ok = self.pool.reset()
        if ok:
            self._reset_pending = True
            self._wake.set()
        return ok

    # ---- the loop ------------------------------------------------------------------

    async def run(self) -> None:
        """Step forever (until cancelled)."""
        sched = self.scheduler
        pool = self.pool
        loop = asyncio.get_running_loop()
        if self._t0 is None:
            self._t0 = self._wall(loop)
        busy_until: float | None = None  # the last step's end, while steps run back to back
        while True:
            if not sched.has_work:
                busy_until = None
                self._wake.clear()
                await self._wake.wait()
                continue
            start = self.now() if busy_until is None else busy_until
            plan = sched.schedule(start)
            if not plan.scheduled:
                if busy_until is not None:  # only requests that arrived after it: now
                    busy_until = None
                    continue
                # Nothing fits (e.g. the head request waits for blocks held by nobody
                # running): wait for a new arrival or an abort.
                await self._flush(pool.take_events())
                self._wake.clear()
                await self._wake.wait()
                continue
            end = start + plan.duration_s
            if self.time_scale == 0:
                self._virtual_now = end
                await asyncio.sleep(0)
            else:
                assert self._t0 is not None
                due = self._t0 + end * self.time_scale  # the step's end on the wall clock
                delay = due - self._wall(loop)
                await asyncio.sleep(delay if delay > 0 else 0)
                busy_until = end if self._wall(loop) - due < RESYNC_S else None
            outputs = sched.finish_step(plan, end)
            self.steps += 1
            events = pool.take_events()
            if events:
                await self._flush(events)
            for req in outputs:
                cb = req.on_output
                if cb is not None and (req.stream or req.finished):
                    cb(req)

    def step_virtual(self) -> list[SimRequest]:
        """One synchronous step in virtual time (benchmarks and tests; no sink)."""
        sched = self.scheduler
        plan = sched.schedule(self._virtual_now)
        if not plan.scheduled:
            return []
        self._virtual_now += plan.duration_s
        self.steps += 1
        return sched.finish_step(plan, self._virtual_now)

    def advance_virtual(self, to: float) -> None:
        """Move the virtual clock forward to ``to`` (idle time between arrivals)."""
        if to > self._virtual_now:
            self._virtual_now = to

    async def _flush(self, events: list[PoolEvent]) -> None:
        self._reset_pending = False
        if events and self.sink is not None:
            await self.sink.publish(events)
