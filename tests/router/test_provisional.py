"""Provisional entries close the burst blind spot, expire, and stay bounded."""

from __future__ import annotations

from kvkeys.keys import block_keys
from kvkeys.types import PrefixHits, ReplicaHit, ReplicaId
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
