"""What a placement's allocations take from the conversations cached on a replica, and
what the placed conversation keeps of its own.

vLLM keeps idle cached blocks in one LRU free queue per replica; every block a request
allocates takes the queue's head.  A paused session's run of ``run`` blocks was freed
last to first behind ``free_mark`` free blocks, and ``consumed`` blocks have been
allocated since, so after ``a`` more allocations its leading ``clamp(D - a, 0, run)``
blocks are left, with ``D = free_mark + run - consumed`` (``IdleRun.depth``).

* **Displaced** (``displaced_blocks``): allocating ``x`` blocks now moves every idle run
  ``x`` blocks closer to eviction.  If the session comes back after ``t`` seconds, while
  the replica allocates ``rate`` blocks a second, it finds ``clamp(D - x - rate t, 0,
  run)`` blocks instead of ``clamp(D - rate t, 0, run)``.  Weighed by the chance it
  comes back and when (``router.think_times``) and summed over the replica's idle
  sessions, that is the placement's cost to the other conversations: zero where nobody
  paused is still coming back in time (the cache is lost anyway, or the pool is deep
  enough for everyone), high where the allocation pushes returning conversations out.
* **Retained** (``retained_blocks``): the placed conversation's own context, ``run``
  blocks released behind ``free`` free blocks when the turn ends, is a run of depth
  ``free + run`` that its next turn finds with the same arithmetic: where the pool
  turns over slowly a conversation keeps its cache between turns, where it churns it
  does not.

Both are expected blocks, in the same unit as the score's tokens once multiplied by the
block size.  Pure: no clock, no state.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from router.think_times import Returning

__all__ = ["GRID", "IdleRun", "displaced_blocks", "displacement_curve", "interpolate",
           "retained_blocks"]

GRID: tuple[float, ...] = (0.0, 8.0, 32.0, 128.0, 512.0, 2048.0, 8192.0, 32768.0)
"""Allocation sizes, in blocks, at which ``displacement_curve`` evaluates a replica."""


@dataclass(frozen=True, slots=True)
class IdleRun:
    """A paused session's blocks on a replica."""

    depth: float
    """Allocations the run's first block survives (``free_mark + run - consumed``)."""
    run: int
    """Blocks the session's last turn released."""
    elapsed_s: float
    """Seconds since that turn finished."""


def _left(depth: float, run: float) -> float:
    return min(run, max(0.0, depth))


def displaced_blocks(
    runs: Iterable[IdleRun],
    allocate: float,
    rate: float,
    outlook: Callable[[float], Returning | None],
) -> float:
    """The expected blocks of other sessions' returning context that allocating
    ``allocate`` blocks now evicts (module docstring); ``rate`` is the replica's
    allocation rate in blocks per second, ``outlook(elapsed)`` a paused session's
    chance and time of return."""
    if allocate <= 0:
        return 0.0
    total = 0.0
    for r in runs:
        ret = outlook(r.elapsed_s)
        if ret is None or ret.p <= 0 or not ret.waits:
            continue
        lost = 0.0
        for t in ret.waits:
            d = r.depth - rate * t
            if d <= 0:
                break  # returns this late (the waits ascend) find nothing either way
            lost += _left(d, r.run) - _left(d - allocate, r.run)
        total += ret.p * lost / len(ret.waits)
    return total


def displacement_curve(
    runs: Iterable[IdleRun],
    rate: float,
    outlook: Callable[[float], Returning | None],
    grid: Sequence[float] = GRID,
) -> tuple[float, ...]:
    """``displaced_blocks`` at every allocation size of ``grid``, in one pass over the
    runs: a replica's curve, read for any size by ``interpolate`` (the loss grows with
    the allocation; between grid points the chord stands in for it).

    Each (run, return time) pair that still finds blocks is one row of arrays, and the
    loss at every grid size is computed over all rows at once: a replica with thousands
    of paused conversations costs milliseconds, not a tenth of a second on the event
    loop."""
    depths: list[float] = []
    sizes: list[float] = []
    weights: list[float] = []
    for r in runs:
        ret = outlook(r.elapsed_s)
        if ret is None or ret.p <= 0 or not ret.waits:
            continue
        weight = ret.p / len(ret.waits)
        for t in ret.waits:
            d = r.depth - rate * t
            if d <= 0:
                break  # returns this late (the waits ascend) find nothing either way
            depths.append(d)
            sizes.append(r.run)
            weights.append(weight)
    if not depths:
        return (0.0,) * len(grid)
    depth = np.array(depths)
    run = np.array(sizes)
    before = np.minimum(depth, run)
    after = np.clip(depth - np.array(grid, dtype=float)[:, None], 0.0, run)
    return tuple(float(v) for v in (before - after) @ np.array(weights))


def interpolate(grid: Sequence[float], values: Sequence[float], x: float) -> float:
    """``values`` (at ``grid``) at ``x``, linearly between grid points, flat past the
    last."""
    if x <= grid[0]:
        return values[0]
    i = bisect.bisect_left(grid, x)
    if i >= len(grid):
        return values[-1]
    x0, x1 = grid[i - 1], grid[i]
    return values[i - 1] + (values[i] - values[i - 1]) * (x - x0) / (x1 - x0)


def retained_blocks(run: float, free: float, rate: float, returning: Returning | None) -> float:
    """The expected blocks of its own ``run`` a conversation finds when it comes back,
    released behind ``free`` free blocks on a replica allocating ``rate`` blocks a
    second (module docstring)."""
    if returning is None or returning.p <= 0 or not returning.waits or run <= 0:
        return 0.0
    depth = free + run
    kept = sum(_left(depth - rate * t, run) for t in returning.waits)
    return returning.p * kept / len(returning.waits)
