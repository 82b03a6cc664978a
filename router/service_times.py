"""How long a request stays in flight, and how much longer one that has run ``a``
seconds will stay: the look ahead's forecast of when a replica's pool frees up.

``ServiceTimes`` keeps a bounded sample of observed service times (sent to finished, as
the router sees them: queueing, prefill and the whole reply).  ``remaining(a)`` is the
mean residual ``E[S - a | S > a]`` over the sample: a request that has just been sent
is expected to take a mean service time, one that has already run long is expected to
finish sooner or later depending on the tail of what has been seen (a heavy tail keeps
its residual long).  The sorted sample and its suffix sums are rebuilt after
``REBUILD_EVERY`` new observations, so a query is a binary search.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque

__all__ = ["ServiceTimes"]

SAMPLES = 256
"""Service times kept (the newest)."""
REBUILD_EVERY = 8
"""New observations between rebuilds of the sorted sample."""


class ServiceTimes:
    """A bounded sample of service times and their mean residual (module docstring)."""

    def __init__(self, samples: int = SAMPLES) -> None:
        self._recent: deque[float] = deque(maxlen=samples)
        self._sorted: list[float] = []
        self._suffix: list[float] = [0.0]
        """``_suffix[i]``: the sum of ``_sorted[i:]``."""
        self._new = 0

    def __len__(self) -> int:
        return len(self._recent)

    def observe(self, seconds: float) -> None:
        """A request finished after ``seconds`` in flight."""
        self._recent.append(max(0.0, seconds))
        self._new += 1

    def remaining(self, elapsed: float) -> float | None:
        """Expected seconds left for a request in flight for ``elapsed`` seconds
        (``None`` before anything was observed; 0 past every observed time)."""
        if not self._recent:
            return None
        if self._new >= REBUILD_EVERY or not self._sorted:
            self._rebuild()
        i = bisect_right(self._sorted, elapsed)
        longer = len(self._sorted) - i
        if longer == 0:
            return 0.0
        return self._suffix[i] / longer - elapsed

    def _rebuild(self) -> None:
        ordered = sorted(self._recent)
        suffix = [0.0] * (len(ordered) + 1)
        for i in range(len(ordered) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + ordered[i]
        self._sorted, self._suffix, self._new = ordered, suffix, 0
