"""Provisional entries close the burst blind spot, expire, and stay bounded."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from kvkeys.keys import block_keys
from kvkeys.types import PrefixHits, ReplicaHit, ReplicaId, RequestKey
from router.provisional import ProvisionalBlocks

A, B = ReplicaId("a"), ReplicaId("b")
KEYS = block_keys(list(range(160)), 16, model="m")  # 10 blocks
OTHER = block_keys(list(range(1000, 1160)), 16, model="m")


def test_run_counts_leading_blocks_and_expires() -> None:
    p = ProvisionalBlocks(ttl_s=5.0)
    p.add(A, KEYS[:6], now=0.0)
    assert p.run(A, KEYS, 1.0) == 6
    assert p.run(A, KEYS[:3], 1.0) == 3
    assert p.run(B, KEYS, 1.0) == 0
    assert p.run(A, OTHER, 1.0) == 0
    assert p.run(A, KEYS, 5.0) == 0
    p.add(A, [], now=6.0)
    assert len(p) == 0


def test_reinsert_extends_and_keeps_chains_prefix_closed() -> None:
    p = ProvisionalBlocks(ttl_s=5.0)
    p.add(A, KEYS[:4], now=0.0)
    p.add(A, KEYS[:8], now=3.0)
    assert p.run(A, KEYS, 4.9) == 8
    p.add(A, OTHER[:1], now=5.5)  # purges the first insert: its keys were extended
    assert p.run(A, KEYS, 5.5) == 8
    assert p.run(A, KEYS, 8.0) == 0


def test_overlay_extends_the_index_with_gpu_blocks() -> None:
    p = ProvisionalBlocks(ttl_s=5.0)
    hits = PrefixHits({A: ReplicaHit(gpu_blocks=2, cpu_blocks=1), B: ReplicaHit(gpu_blocks=9)})
    assert p.overlay(hits, KEYS, 0.0, [A, B]) is hits
    p.add(A, KEYS[:7], now=0.0)
    p.add(B, KEYS[:4], now=0.0)
    merged = p.overlay(hits, KEYS, 1.0, [A, B])
    assert merged.by_replica[A] == ReplicaHit(gpu_blocks=6, cpu_blocks=1)
    assert merged.by_replica[B] == ReplicaHit(gpu_blocks=9)  # the index knows more
    fresh = p.overlay(PrefixHits(), KEYS, 1.0, [A])
    assert fresh.by_replica == {A: ReplicaHit(gpu_blocks=7)}


def test_burst_sharing_a_new_prefix_sees_the_first_decision() -> None:
    p = ProvisionalBlocks(ttl_s=10.0)
    p.add(B, KEYS, now=0.0)  # first request of the burst went to B
    later = block_keys(list(range(160)) + [7] * 32, 16, model="m")
    assert p.overlay(PrefixHits(), later, 0.01, [A, B]).blocks(B) == 10


def test_memory_bound_and_forget() -> None:
    p = ProvisionalBlocks(ttl_s=100.0, max_keys=12)
    p.add(A, KEYS, now=0.0)
    p.add(B, OTHER, now=1.0)
    assert len(p) <= 12
    assert p.run(A, KEYS, 2.0) == 0 and p.run(B, OTHER, 2.0) == 10
    p.forget(B)
    p.forget(B)
    assert len(p) == 0 and p.run(B, OTHER, 2.0) == 0
    p2 = ProvisionalBlocks(ttl_s=0.0)
    p2.add(A, KEYS, now=0.0)
    assert len(p2) == 0


def test_an_insert_with_an_earlier_clock_never_shortens_an_expiry() -> None:
    p = ProvisionalBlocks(ttl_s=5.0)
    p.add(A, KEYS[:4], now=5.0)
    p.add(A, KEYS[:8], now=1.0)  # out of order: extends only what it adds
    assert p.run(A, KEYS, 5.5) == 8
    assert p.run(A, KEYS, 7.0) == 4
    assert p.run(A, KEYS, 10.0) == 0


class _PerKey:
    """The expiry rules key by key (what ``ProvisionalBlocks`` stores per chain run)."""

    def __init__(self, ttl_s: float, max_keys: int) -> None:
        self.ttl_s, self.max_keys = ttl_s, max_keys
        self.expiry: dict[ReplicaId, dict[RequestKey, float]] = {}
        self.inserts: list[tuple[float, ReplicaId, tuple[RequestKey, ...]]] = []

    def size(self) -> int:
        return sum(len(t) for t in self.expiry.values())

    def add(self, replica: ReplicaId, keys: list[RequestKey], now: float) -> None:
        while self.inserts and self.inserts[0][0] <= now:
            self._drop(*self.inserts.pop(0))
        if not keys or self.ttl_s <= 0:
            return
        until = now + self.ttl_s
        table = self.expiry.setdefault(replica, {})
        for k in keys:
            table[k] = max(table.get(k, -1.0), until)
        self.inserts.append((until, replica, tuple(keys)))
        while self.size() > self.max_keys and self.inserts:
            self._drop(*self.inserts.pop(0))

    def _drop(self, until: float, replica: ReplicaId, keys: tuple[RequestKey, ...]) -> None:
        table = self.expiry.get(replica, {})
        for k in keys:
            if k in table and table[k] <= until:
                del table[k]
        if not table:
            self.expiry.pop(replica, None)


_CHAIN = [*KEYS, *OTHER[:2], *KEYS[:3]]  # a chain, then keys it already holds


@given(st.lists(st.tuples(st.sampled_from([A, B]), st.integers(0, len(_CHAIN)),
                          st.integers(0, len(_CHAIN)), st.integers(-3, 6)), max_size=40),
       st.sampled_from([0.0, 1.5, 4.0, math.inf]), st.integers(1, 30))
def test_runs_store_the_expiries_of_the_per_key_rules(
    ops: list[tuple[ReplicaId, int, int, int]], ttl_s: float, max_keys: int
) -> None:
    """Chains and their prefixes, siblings, slices that are not chains, repeated keys,
    a clock stepping back, an endless ttl, the memory bound: every key's expiry, the
    size and every run are those of the rules applied key by key."""
    fast, slow = ProvisionalBlocks(ttl_s=ttl_s, max_keys=max_keys), _PerKey(ttl_s, max_keys)
    now = 0.0
    siblings = {0: _CHAIN, 1: [*KEYS[:6], *OTHER[:4]]}
    for replica, start, stop, step in ops:
        now = max(0.0, now + step)  # a clock may step back, never below 0
        keys = siblings[start % 2][:stop] if start < 4 else _CHAIN[start:stop]
        fast.add(replica, keys, now)
        slow.add(replica, keys, now)
        assert len(fast) == slow.size()
        for r in (A, B):
            table = slow.expiry.get(r, {})
            for k in {*_CHAIN, *OTHER}:
                assert fast.run(r, [k], now) == (k in table and table[k] > now)
            for probe in (*siblings.values(), KEYS[:5], OTHER):
                assert fast.run(r, probe, now) == _bisected(table, probe, now)


def _bisected(table: dict[RequestKey, float], keys: list[RequestKey], now: float) -> int:
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if table.get(keys[mid - 1], -1.0) > now:
            lo = mid
        else:
            hi = mid - 1
    return lo


def test_a_later_turn_writes_only_its_new_keys() -> None:
    """The history a turn shares with its sibling is extended run by run: the keys of
    one insert share one run object."""
    p = ProvisionalBlocks(ttl_s=10.0)
    p.add(A, KEYS, now=0.0)
    sibling = [*KEYS[:7], *OTHER[:3]]
    p.add(A, sibling, now=1.0)
    assert len(p) == 13
    assert p.run(A, KEYS, 10.5) == 7 and p.run(A, sibling, 10.5) == 10
    assert p.run(A, KEYS, 11.0) == 0
