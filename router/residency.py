"""Residency: the chance a cached block is still on its replica when a request needs it.

Pure functions of the eviction pressure (the share of the free pool allocated before the
block is needed), used by ``router.scoring``.  A session's run of blocks is freed last to
first into vLLM's LRU free queue, so its leading blocks sit deepest and survive longest
(``tail_run``).  Nothing here awaits, reads a clock or keeps state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Tiers", "floor_within", "in_horizons", "resident_probability", "tail_run"]


def resident_probability(pressure: float, spread: float) -> float:
    """Chance an idle block is still resident under ``pressure`` (the share of the free
    pool allocated before it is needed): 1 up to ``1 - spread``, 0 from ``1 + spread``,
    linear between."""
    lo, hi = 1.0 - spread, 1.0 + spread
    if pressure <= lo:
        return 1.0
    if pressure >= hi:
        return 0.0
    return (hi - pressure) / (hi - lo)


def in_horizons(seconds: float, horizon_s: float | None) -> float:
    if horizon_s is None or math.isinf(horizon_s) or seconds <= 0:
        return 0.0
    return math.inf if horizon_s <= 0 else seconds / horizon_s


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


@dataclass(frozen=True, slots=True)
class Tiers:
    """The usable blocks by tier: ``[0, gpu_end)`` GPU, ``[gpu_end, cpu_end)`` CPU, the
    rest storage, with the CPU and storage values."""

    gpu_end: int
    cpu_end: int
    values: tuple[float, float]

    def value(self, a: int, b: int) -> float:
        """The summed tier values of blocks ``[a, b)``."""
        if b <= a:
            return 0.0
        if b <= self.gpu_end:
            return float(b - a)
        v_cpu, v_sto = self.values
        return (_overlap(a, b, 0, self.gpu_end)
                + v_cpu * _overlap(a, b, self.gpu_end, self.cpu_end)
                + v_sto * max(0, b - max(a, self.cpu_end)))

    def at(self, i: int) -> float:
        """The tier value of block ``i``."""
        if i < self.gpu_end:
            return 1.0
        return self.values[0] if i < self.cpu_end else self.values[1]


def floor_within(x: float, lo: int, hi: int) -> int:
    """``floor(x)`` clamped to ``[lo, hi]``, for any float (an infinite or NaN ``x`` never
    reaches ``math.floor``, which would raise on it; NaN gives ``lo``)."""
    if not x > lo:
        return lo
    return hi if x >= hi else math.floor(x)


def tail_run(
    allocations: float,
    depth0: float,
    run: int,
    start: int,
    end: int,
    p_cap: float,
    spread: float,
    tiers: Tiers,
    p_index: float,
) -> tuple[float, int, float]:
    """Tail blocks ``[start, end)`` of a session run of ``run`` blocks freed with
    ``depth0`` free blocks ahead, after ``allocations`` allocations: ``(sum of P_i x tier
    value, leading blocks with p_index x P_i >= 1/2, sum of P_i)``, each ``P_i`` capped at
    ``p_cap``.  ``P_i`` falls with ``i`` (deeper blocks survive longer), so the blocks at
    the cap come first and the loop runs only over the ramp, stopping at the first 0."""
    if not math.isfinite(allocations):  # an unbounded queue or lag: everything goes
        return 0.0, 0, 0.0
    lo = 1.0 - spread
    full_end = start
    if lo > 0:
        # depth0 + run - 1 - i >= allocations / lo  <=>  P_i = 1 (then capped); the
        # quotient may overflow to infinity (a horizon near 0), so clamp before flooring
        full_end = floor_within(depth0 + run - allocations / lo, start, end)
    full_end = min(full_end, max(start, run))  # past the run every depth is depth0
    weighted = p_cap * tiers.value(start, full_end)
    total = p_cap * (full_end - start)
    counting = p_index * p_cap >= 0.5
    resident = full_end - start if counting else 0
    for i in range(full_end, end):
        p = min(p_cap, resident_probability(allocations / (depth0 + max(0, run - 1 - i)),
                                            spread))
        if p <= 0.0:
            break
        weighted += p * tiers.at(i)
        total += p
        if counting and p_index * p >= 0.5:
            resident += 1
        else:
            counting = False
    return weighted, resident, total
