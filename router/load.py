"""Per-replica load as the router itself sees it (no scraping, no I/O).

For each replica the tracker counts:

* ``in_flight``: requests the router has sent and not yet finished;
* ``queued_prefill_tokens``: prompt tokens of in-flight requests that have not produced
  their first byte yet (the replica is still queueing or prefilling them);
* ``decoding``: in-flight requests past their first byte.

Invariant: every ``lease`` returns its counts on exit, whatever the exit (normal end,
client disconnect, cancellation, upstream error), so an idle router always reads zero.
All mutations are synchronous, hence atomic on the event loop: no locks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType

from kvkeys.types import ReplicaId

__all__ = ["LoadTracker", "ReplicaLoad", "Lease"]


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A snapshot of one replica's load."""

    in_flight: int = 0
    queued_prefill_tokens: int = 0
    decoding: int = 0


class _Counters:
    __slots__ = ("in_flight", "queued_prefill_tokens", "decoding")

    def __init__(self) -> None:
        self.in_flight = 0
        self.queued_prefill_tokens = 0
        self.decoding = 0


class Lease:
    """One request's share of a replica's load; a context manager, plain (``with``, what
    the proxy uses: no coroutine per request) or async (``async with``).

    ``first_byte()`` moves the request from queued prefill to decoding (idempotent).
    """

    __slots__ = ("_counters", "_prompt_tokens", "_first", "_open")

    def __init__(self, counters: _Counters, prompt_tokens: int) -> None:
        self._counters = counters
        self._prompt_tokens = prompt_tokens
        self._first = False
        self._open = False

    def __enter__(self) -> Lease:
        c = self._counters
        c.in_flight += 1
        c.queued_prefill_tokens += self._prompt_tokens
        self._open = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    async def __aenter__(self) -> Lease:
        return self.__enter__()

    def first_byte(self) -> None:
        """The replica produced its first byte: prefill is over."""
        if self._open and not self._first:
            self._first = True
            c = self._counters
            c.queued_prefill_tokens -= self._prompt_tokens
            c.decoding += 1

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def release(self) -> None:
        """Return the counts (idempotent; ``__exit__`` and ``__aexit__`` call it)."""
        if not self._open:
            return
        self._open = False
        c = self._counters
        c.in_flight -= 1
        if self._first:
            c.decoding -= 1
        else:
            c.queued_prefill_tokens -= self._prompt_tokens


class LoadTracker:
    """The router's own per-replica accounting."""

    def __init__(self, replicas: Iterable[ReplicaId] = ()) -> None:
        self._counters: dict[ReplicaId, _Counters] = {r: _Counters() for r in replicas}

    def lease(self, replica: ReplicaId, prompt_tokens: int = 0) -> Lease:
        """A lease on ``replica`` for a request of ``prompt_tokens`` prompt tokens."""
        counters = self._counters.get(replica)
        if counters is None:
            counters = self._counters[replica] = _Counters()
        return Lease(counters, max(0, prompt_tokens))

    def in_flight(self, replica: ReplicaId) -> int:
        """In-flight requests on ``replica`` (cheap; used by ``least_loaded``)."""
        counters = self._counters.get(replica)
        return counters.in_flight if counters is not None else 0

    def get(self, replica: ReplicaId) -> ReplicaLoad:
        """A snapshot of one replica's load."""
        c = self._counters.get(replica)
        if c is None:
            return ReplicaLoad()
        return ReplicaLoad(c.in_flight, c.queued_prefill_tokens, c.decoding)

    def snapshot(self) -> Mapping[ReplicaId, ReplicaLoad]:
        """A snapshot of every known replica's load."""
        return {r: ReplicaLoad(c.in_flight, c.queued_prefill_tokens, c.decoding)
                for r, c in self._counters.items()}

    def total_in_flight(self) -> int:
        """In-flight requests over all replicas."""
        return sum(c.in_flight for c in self._counters.values())
