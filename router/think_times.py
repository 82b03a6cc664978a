"""When paused conversations come back: the think-time distribution, learnt online.

A session's turn finishes, its user thinks, and the next turn arrives ``think`` seconds
later, or never (the conversation ended).  The router sees every pause start (a finished
turn, ``paused``) and every return with its think time (``returned``).  From them:

* the recent think times of returns: a bounded sample, kept sorted;
* the chance a pause ends in a return at all.  Pauses and returns are counted by the
  bucket of ``BUCKET_S`` seconds their pause *started* in (a return is filed under
  ``now - think``), so a bucket's returns over its pauses is exactly the return share of
  the pauses that started then, once all of them have had time to come back.  Only
  buckets older than the longest think time in the sample (plus a bucket) count: their
  pauses have come back, or never will (Laplace-smoothed; ``None`` before any bucket is
  that old).

``returning(elapsed)`` answers, for a session paused ``elapsed`` seconds: the chance it
still comes back (``R(> elapsed) / (R(> elapsed) + never)``, the sample's later returns
against the pauses that end without one, scaled to the sample), and when (the remaining
times of those later returns, as ``points`` equally likely values).

Bounded: ``max_samples`` think times and ``max_buckets`` buckets.  The counts are also
kept summed over every bucket, so the share is the sums less the few buckets not yet
settled (newest first): its cost does not grow with the router's uptime (summing every
bucket cost half a millisecond per decision once ``max_buckets`` were kept, after
about six hours).  Nothing here reads a clock; times are passed in.  Synchronous, so
every update is atomic on the event loop.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from dataclasses import dataclass

__all__ = ["BUCKET_S", "SETTLE_QUANTILE", "Returning", "ThinkTimes"]

BUCKET_S = 10.0
"""Width of the pause-start buckets, in seconds."""
SETTLE_QUANTILE = 0.95
"""A bucket counts once it is older than this quantile of the sampled think times."""


@dataclass(frozen=True, slots=True)
class Returning:
    """A paused session's outlook: ``p`` it comes back at all and, if it does, the
    remaining seconds until it does as equally likely points (``waits``, ascending)."""

    p: float
    waits: tuple[float, ...]


_NEVER = Returning(0.0, ())


class ThinkTimes:
    """The think-time sample and the pause and return counts per start bucket."""

    def __init__(
        self, *, max_samples: int = 1024, points: int = 8, max_buckets: int = 2048
    ) -> None:
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []
        self._max_samples = max_samples
        self._points = points
        self._max_buckets = max_buckets
        self._buckets: OrderedDict[int, list[int]] = OrderedDict()
        """Start bucket -> [pauses started, of which returned], oldest first."""
        self._totals = [0, 0]
        """The counts summed over every bucket kept."""

    def paused(self, now: float) -> None:
        """A session's turn finished at ``now``: a pause starts."""
        self._bucket(now)[0] += 1
        self._totals[0] += 1

    def returned(self, think_s: float, now: float) -> None:
        """A paused session came back at ``now`` after ``think_s`` seconds."""
        bucket = self._buckets.get(int((now - think_s) // BUCKET_S))
        if bucket is not None and bucket[1] < bucket[0]:
            bucket[1] += 1
            self._totals[1] += 1
        if len(self._recent) >= self._max_samples:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(think_s)
        bisect.insort(self._sorted, think_s)

    def _bucket(self, t: float) -> list[int]:
        key = int(t // BUCKET_S)
        counts = self._buckets.get(key)
        if counts is None:
            counts = self._buckets[key] = [0, 0]
            while len(self._buckets) > self._max_buckets:
                _, (n, r) = self._buckets.popitem(last=False)
                self._totals[0] -= n
                self._totals[1] -= r
        return counts

    def return_share(self, now: float) -> float | None:
        """The chance a pause ends in a return (module docstring), ``None`` before any
        pause is old enough to say."""
        s = self._sorted
        if not s:
            return None
        # Settled: buckets older than the sample's SETTLE_QUANTILE think time (a bucket's
        # few later returns still count when they come; one outlier does not hold back
        # the estimate for good).
        longest = s[min(len(s) - 1, int(SETTLE_QUANTILE * len(s)))]
        settled = int((now - longest) // BUCKET_S) - 1
        started, returned = self._totals
        for key, (n, r) in reversed(self._buckets.items()):  # newest first
            if key <= settled:
                break
            started -= n
            returned -= r
        if started == 0:
            return None
        return (returned + 1) / (started + 2)

    def returning(self, elapsed_s: float, share: float | None) -> Returning | None:
        """The outlook of a session paused ``elapsed_s`` seconds, given the return share
        (``return_share``, read once per decision); ``None`` while nothing is learnt."""
        s = self._sorted
        if share is None or not s:
            return None
        i = bisect.bisect_right(s, elapsed_s)
        later = len(s) - i
        if later == 0:
            return _NEVER
        never = len(s) * (1.0 - share) / share
        k = min(self._points, later)
        waits = tuple(s[i + (later * (2 * j + 1)) // (2 * k)] - elapsed_s for j in range(k))
        return Returning(later / (later + never), waits)
