"""Provisional index entries: closing the burst blind spot.

Between routing a request and the ``BlockStored`` events of its prefill, the index does
not know the chosen replica will hold the request's blocks.  A burst of requests sharing
a new prefix (a new system prompt, a fan-out of one agent's sub-calls) would then be
spread by load, each computing the prefix again.  So right after a decision the router
records the request's block keys as provisionally held by the chosen replica, for a short
``ttl_s``; lookups see the union of the real index and these entries.  Real events
replace them naturally: once the index holds the blocks, the provisional run adds
nothing, and the entries expire.

Invariants:

* Per replica, the unexpired keys are prefix-closed along every chain: all keys of one
  insert share one expiry, and re-inserting a key only ever extends it, so a key is
  never outlived by a key after it in the same chain.  The held run of a prompt is
  therefore found by bisection, O(log n) per replica.
* Memory is bounded by ``max_keys`` (oldest inserts go first); expired entries are purged
  on every insert.  Times are passed in: no clock here.
* Provisional blocks count as GPU blocks (that is where the prefill will put them).

Stored per chain run, not per key: the keys one insert adds that were not stored yet
form a *run* (consecutive blocks of one chain) with one expiry, and each stored key maps
to its run.  A later turn of a conversation re-inserts its whole history: the runs it
covers get the later expiry in one write each (a run only partly covered is split, the
part outside keeping its expiry), and only its new blocks are written key by key.  An
expiring insert walks its keys run by run and deletes only the runs it still owns.  So
an insert costs its new keys plus a few runs, where writing every key's expiry cost
hundreds of dict writes per request.  The keys' expiries are exactly those of the
key-by-key rules (a key's expiry is the latest of the inserts that stored it; an
expiring insert drops the keys whose expiry is not later than its own): runs are an
exact representation, checked against those rules by a property test.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence

from kvkeys.types import PrefixHits, ReplicaHit, ReplicaId, RequestKey

__all__ = ["ProvisionalBlocks"]


class _Run:
    """Keys ``keys[lo:hi]`` (consecutive blocks of one chain, the first at block
    ``pos0``) stored with one expiry ``until``."""

    __slots__ = ("hi", "keys", "lo", "pos0", "until")

    def __init__(
        self, keys: tuple[RequestKey, ...], lo: int, hi: int, pos0: int, until: float
    ) -> None:
        self.keys, self.lo, self.hi, self.pos0, self.until = keys, lo, hi, pos0, until

    def index(self, key: RequestKey, pos: int) -> int:
        """Where ``key``, at block ``pos`` of a chain, is in ``keys``."""
        i = self.lo + pos - self.pos0
        if self.lo <= i < self.hi and self.keys[i] == key:
            return i
        return self.keys.index(key, self.lo, self.hi)  # not a chain: search


_Table = dict[RequestKey, _Run]


def _shared(run: _Run, at: int, keys: tuple[RequestKey, ...], i: int) -> int:
    """How many keys from ``keys[i]`` on are ``run``'s from its index ``at`` on (at
    least one: ``keys[i]`` is ``run.keys[at]``)."""
    mine = run.keys
    lo, hi = 1, min(run.hi - at, len(keys) - i)
    if mine[at : at + hi] == keys[i : i + hi]:
        return hi
    # Where they part (a sibling's history ends): the longest equal prefix, by bisection
    # on slice comparisons (equal prefixes are prefix-closed, chains or not).
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mine[at + lo : at + mid] == keys[i + lo : i + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _isolate(table: _Table, run: _Run, at: int, m: int) -> None:
    """Make ``run`` hold exactly its keys ``[at, at + m)``: those before and after move
    to runs of their own, with the same expiry."""
    if at > run.lo:
        _move(table, _Run(run.keys, run.lo, at, run.pos0, run.until))
    if at + m < run.hi:
        _move(table, _Run(run.keys, at + m, run.hi, run.pos0 + at + m - run.lo, run.until))
    run.pos0 += at - run.lo
    run.lo, run.hi = at, at + m


def _move(table: _Table, run: _Run) -> None:
    for k in run.keys[run.lo : run.hi]:
        table[k] = run


class ProvisionalBlocks:
    """Short-lived "this replica will hold these blocks" entries."""

    def __init__(self, *, ttl_s: float = 10.0, max_keys: int = 1_000_000) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._runs: dict[ReplicaId, _Table] = {}
        self._inserts: deque[tuple[float, ReplicaId, tuple[RequestKey, ...]]] = deque()
        self._size = 0
        self._latest = float("-inf")
        """The latest expiry any insert set."""

    def __len__(self) -> int:
        """Keys currently stored (expired ones until the next purge included)."""
        return self._size

    def add(self, replica: ReplicaId, keys: Sequence[RequestKey], now: float) -> None:
        """Record that ``replica`` will hold ``keys`` (a chain from block 0) until
        ``now + ttl_s``."""
        self._purge(now)
        if not keys or self.ttl_s <= 0:
            return
        until = now + self.ttl_s
        # A key not stored yet gets the expiry (with a monotonic clock every key does);
        # a stored one keeps a later one.
        store_new = until >= self._latest or until > -1.0
        self._latest = max(self._latest, until)
        table = self._runs.setdefault(replica, {})
        before = len(table)
        chain = tuple(keys)
        i, n = 0, len(chain)
        while i < n:
            run = table.get(chain[i])
            if run is None:
                i = self._store(table, chain, i, until) if store_new else i + 1
                continue
            at = run.index(chain[i], i)
            m = _shared(run, at, chain, i)
            if run.until < until:
                _isolate(table, run, at, m)
                run.until = until
            i += m
        self._size += len(table) - before
        self._inserts.append((until, replica, chain))
        while self._size > self.max_keys and self._inserts:
            self._drop(*self._inserts.popleft())

    @staticmethod
    def _store(table: _Table, chain: tuple[RequestKey, ...], i: int, until: float) -> int:
        """Store the keys from ``chain[i]`` up to the next stored one as one run; returns
        where it ends."""
        run = _Run((), 0, 0, i, until)
        j = i
        while j < len(chain) and chain[j] not in table:
            table[chain[j]] = run
            j += 1
        run.keys, run.hi = chain[i:j], j - i  # its own keys only: a run pins no insert
        return j

    def run(self, replica: ReplicaId, keys: Sequence[RequestKey], now: float) -> int:
        """Leading blocks of ``keys`` provisionally held by ``replica``."""
        table = self._runs.get(replica)
        if not table or not keys:
            return 0
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = table.get(keys[mid - 1])
            if (found.until if found is not None else -1.0) > now:
                lo = mid
            else:
                hi = mid - 1
        return lo
    def overlay(
        self,
        hits: PrefixHits,
        keys: Sequence[RequestKey],
        now: float,
        among: Collection[ReplicaId],
    ) -> PrefixHits:
        """``hits`` extended by provisional runs: a replica whose provisional run is longer
        than its indexed run gets the difference as GPU blocks."""
        merged: dict[ReplicaId, ReplicaHit] | None = None
        for replica in among:
            extra = self.run(replica, keys, now)
            if extra == 0:
                continue
            real = hits.by_replica.get(replica)
            held = real.blocks if real is not None else 0
            if extra <= held:
                continue
            if merged is None:
                merged = dict(hits.by_replica)
            if real is None:
                merged[replica] = ReplicaHit(gpu_blocks=extra)
            else:
                merged[replica] = ReplicaHit(
                    gpu_blocks=real.gpu_blocks + extra - held,
                    cpu_blocks=real.cpu_blocks,
                    storage_blocks=real.storage_blocks,
                )
        return hits if merged is None else PrefixHits(merged)

    def forget(self, replica: ReplicaId) -> None:
        """Drop every entry of ``replica`` (it restarted or left)."""
        table = self._runs.pop(replica, None)
        if table:
            self._size -= len(table)

    def _purge(self, now: float) -> None:
        while self._inserts and self._inserts[0][0] <= now:
            self._drop(*self._inserts.popleft())

    def _drop(self, until: float, replica: ReplicaId, keys: tuple[RequestKey, ...]) -> None:
        """Drop the keys of an insert whose expiry is not later than its own: a later
        insert that extended a key owns it now, and dropping it would break
        prefix-closure of the later chain."""
        table = self._runs.get(replica)
        if table is None:
            return
        i, n = 0, len(keys)
        while i < n:
            run = table.get(keys[i])
            if run is None:
                i += 1
                continue
            at = run.index(keys[i], i)
            m = _shared(run, at, keys, i)
            if run.until <= until:
                _isolate(table, run, at, m)
                for k in keys[i : i + m]:
                    del table[k]
                self._size -= m
            i += m
        if not table:
            del self._runs[replica]
