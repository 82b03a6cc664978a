"""How long to wait before the next attempt, and whether an attempt is left.

``Backoff.compute(failures)`` is pure: exponential from ``base_s`` doubling per failure,
capped at ``cap_s``, with optional "equal jitter" whose randomness is injected (a
``random.Random``), so tests are deterministic.  One class for every retry loop: the
proxy's failover (before the first byte, never inside the transport; the defaults are
its own), and the KV event subscribers' reconnects and discovery retries (with jitter,
so a fleet of routers does not reconnect in step).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Backoff"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff: ``min(cap_s, base_s * 2 ** (failures - 1))``."""

    base_s: float = 0.005
    cap_s: float = 0.1
    max_attempts: int = 2
    """Attempts in total, the first included."""
    rng: random.Random | None = None
    """When set, sleep a uniform time in ``[d/2, d]`` (equal jitter) instead of ``d``."""

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.cap_s < 0:
            raise ValueError("backoff times must be >= 0")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")

    def compute(self, failures: int) -> float:
        """Seconds to sleep after ``failures`` consecutive failures (0 for none)."""
        if failures <= 0 or self.base_s == 0:
            return 0.0
        delay = min(self.cap_s, self.base_s * (2.0 ** min(failures - 1, 62)))
        if self.rng is not None:
            delay = delay / 2 + self.rng.uniform(0, delay / 2)
        return delay

    def may_retry(self, attempts: int) -> bool:
        """Whether another attempt is allowed after ``attempts`` attempts."""
        return attempts < self.max_attempts
