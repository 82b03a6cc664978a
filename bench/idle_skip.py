"""The runner's clock, which skips the fleet's idle time when a clock warp file is shared.

A compressed replay of a chat trace spends much of its wall time with nothing to do:
every reply is in, and the next turn is a think time away (the tail of think times is
minutes long; at ``time_scale`` 0.05 a third to half of a run was such waits).  Nothing
changes while the fleet is idle except the clocks, so ``IdleSkipper`` moves them all
forward instead of waiting (``aio.clock_warp``: the simulated replicas' engine clocks
and a kvroute router's judgement clock read the same offset file):

* the runner's sessions sleep with ``sleep_until(due)`` on this clock (wall time plus
  the skipped time), so a skip wakes them early;
* ``busy()`` brackets every request: a skip happens only after nothing has been in
  flight for ``settle_s`` of wall time (the replicas' last steps and the router's last
  receipts and events are done), and the clocks then move to ``lead_s`` of wall time
  before the next turn is due (that turn then goes out on time; gaps under ``min_gap_s``
  are waited out).

Without a warp file (``warp=None``) it is the wall clock and nothing is skipped.  A
router whose clock does not read the file (a peer router) sees the fleet's idle gaps
shortened; the replicas and the trace's schedule still agree with each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Iterator

from aio.clock_warp import ClockWarp

__all__ = ["IdleSkipper"]


class IdleSkipper:
    """The run's clock and its sleepers (module docstring)."""

    def __init__(
        self,
        warp: ClockWarp | None = None,
        *,
        min_gap_s: float = 0.05,
        settle_s: float = 0.05,
        lead_s: float = 0.01,
        tick_s: float = 0.005,
    ) -> None:
        self._warp = warp
        self._min_gap_s = min_gap_s
        self._settle_s = settle_s
        self._lead_s = lead_s
        self._tick_s = tick_s
        self._in_flight = 0
        self._idle_since: float | None = time.perf_counter()
        self._due: dict[int, float] = {}
        self._ids = itertools.count()
        self._moved = asyncio.Event()
        self.skipped_s = 0.0
        """Wall seconds skipped so far."""

    def now(self) -> float:
        """Wall seconds (``time.perf_counter``) plus the time skipped."""
        if self._warp is None:
            return time.perf_counter()
        return time.perf_counter() + self._warp.offset()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """A request in flight: no skip until it is over and ``settle_s`` has passed."""
        self._in_flight += 1
        self._idle_since = None
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle_since = time.perf_counter()

    async def sleep_until(self, due: float) -> None:
        """Until ``now()`` reaches ``due`` (sooner in wall time when idle time is skipped)."""
        key = next(self._ids)
        self._due[key] = due
        try:
            while (delay := due - self.now()) > 0:
                moved = self._moved
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(moved.wait(), delay)
        finally:
            del self._due[key]

    async def run(self) -> None:
        """Skip idle time until cancelled (does nothing without a warp file)."""
        if self._warp is None:
            return
        while True:
            await asyncio.sleep(self._tick_s)
            self.skip()

    def skip(self) -> float:
        """Move the clocks forward now if the fleet is idle and the next turn far off;
        returns the wall seconds skipped (0 when not)."""
        since = self._idle_since
        if (self._warp is None or self._in_flight or since is None or not self._due
                or time.perf_counter() - since < self._settle_s):
            return 0.0
        gap = min(self._due.values()) - self.now() - self._lead_s
        if gap < self._min_gap_s:
            return 0.0
        self._warp.advance(gap)
        self.skipped_s += gap
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()
        return gap
