"""The load-only policies that make the proxy useful on day one.

* ``round_robin``: rotate over the candidates; the rest of the rotation is the failover
  order.
* ``least_loaded``: fewest in-flight requests by the router's own count
  (``LoadTracker``); ties go round-robin so equal replicas share traffic.
* ``random``: a shuffle with an injected ``random.Random`` (seeded in tests).

Each is built by a factory from a ``PolicyContext`` (see ``router.plugins``).  None of
them asks for usage receipts, and ``record`` is a no-op.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvkeys.types import ReplicaId
from router.policy import Decision, Receipt, RouteRequest

if TYPE_CHECKING:
    from router.load import LoadTracker
    from router.plugins import PolicyContext

__all__ = ["LeastLoaded", "RandomPolicy", "RoundRobin"]


class RoundRobin:
    """Rotate over the candidates."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    async def route(self, request: RouteRequest, candidates: Sequence[ReplicaId]) -> Decision:
        """``candidates`` rotated by a per-policy counter."""
        n = len(candidates)
        i = self._next % n
        self._next = i + 1
        order = tuple(candidates[i:]) + tuple(candidates[:i]) if i else tuple(candidates)
        return Decision(order, self.name, "rotation")

    def record(self, request: RouteRequest, decision: Decision, receipt: Receipt) -> None:
        """Nothing to learn."""

    @classmethod
    def factory(cls, ctx: PolicyContext) -> RoundRobin:
        """Build from a ``PolicyContext``."""
        return cls()


class LeastLoaded:
    """Fewest in-flight requests first (the router's own accounting)."""

    name = "least_loaded"

    def __init__(self, load: LoadTracker) -> None:
        self._load = load
        self._next = 0

    async def route(self, request: RouteRequest, candidates: Sequence[ReplicaId]) -> Decision:
        """Candidates sorted by in-flight count, ties broken by rotation."""
        n = len(candidates)
        start = self._next % n
        self._next = start + 1
        in_flight = self._load.in_flight
        order = sorted(
            range(n), key=lambda k: (in_flight(candidates[k]), (k - start) % n)
        )
        return Decision(tuple(candidates[k] for k in order), self.name, "least_in_flight")

    def record(self, request: RouteRequest, decision: Decision, receipt: Receipt) -> None:
        """Nothing to learn."""

    @classmethod
    def factory(cls, ctx: PolicyContext) -> LeastLoaded:
        """Build from a ``PolicyContext``."""
        return cls(ctx.load)


class RandomPolicy:
    """A uniformly random order."""

    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    async def route(self, request: RouteRequest, candidates: Sequence[ReplicaId]) -> Decision:
        """A shuffled copy of ``candidates``."""
        order = list(candidates)
        self._rng.shuffle(order)
        return Decision(tuple(order), self.name, "random")

    def record(self, request: RouteRequest, decision: Decision, receipt: Receipt) -> None:
        """Nothing to learn."""

    @classmethod
    def factory(cls, ctx: PolicyContext) -> RandomPolicy:
        """Build from a ``PolicyContext`` (uses its seeded ``rng``)."""
        return cls(ctx.rng)
