"""The cache bounds (``bench.bounds``): hand-computed cases and their ordering."""

from __future__ import annotations

import random

from bench.bounds import CacheRequest, cache_bounds, optimal_hits

MODEL = "m"


def test_repeated_prompt_hits_in_every_bound() -> None:
    # Block size 2: [1,2,3,4,5] has 2 full blocks, both usable ((5 - 1) // 2 = 2).
    reqs = [CacheRequest([1, 2, 3, 4, 5]), CacheRequest([1, 2, 3, 4, 6])]
    b = cache_bounds(reqs, block_size=2, capacity=2, model=MODEL)
    assert b.prompt_tokens == 10
    assert (b.pooled_lru_saved, b.pooled_optimal_saved, b.unbounded_saved) == (4, 4, 4)
    assert b.share(2) == {"of_pooled_lru": 0.5, "of_optimal": 0.5, "of_unbounded": 0.5}


def test_alternating_prompts_one_block_lru_thrashes_optimal_keeps_one() -> None:
    # Block size 1, capacity 1: A=[1,9], B=[2,9] alternate A, B, A, B.  Each prompt
    # stores 2 blocks and can hit 1 ((2 - 1) // 1).  LRU always evicts what comes back
    # next; the optimum keeps A's first block across B (bypassing B) for one hit, and
    # cannot also keep B's (their lifetimes overlap in a one-block cache).  Unbounded:
    # the second A and the second B hit their first block.
    a, b = [1, 9], [2, 9]
    reqs = [CacheRequest(t) for t in (a, b, a, b)]
    bd = cache_bounds(reqs, block_size=1, capacity=1, model=MODEL)
    assert (bd.pooled_lru_saved, bd.pooled_optimal_saved, bd.unbounded_saved) == (0, 1, 2)


def test_reply_blocks_take_lru_room_but_not_the_optimum() -> None:
    # Block size 2, capacity 2: P=[1,2,3] has 1 full block.  Q=[7,8,9] has one too,
    # and its 4-token reply fills (3 + 3) // 2 - 3 // 2 = 2 more: the LRU keeps Q's
    # newest blocks and loses P's.  The optimum never stores Q's (never used again).
    p = CacheRequest([1, 2, 3])
    q = CacheRequest([7, 8, 9], output_tokens=4)
    bd = cache_bounds([p, q, p], block_size=2, capacity=2, model=MODEL)
    assert (bd.pooled_lru_saved, bd.pooled_optimal_saved, bd.unbounded_saved) == (0, 2, 2)


def test_optimum_obeys_the_prefix_rule() -> None:
    # Keys as plain labels: request 0 stores a0, a1; request 1 stores c alone (next
    # used at request 3); request 2 wants a0, a1.  With capacity 2 the optimum keeps
    # a0, a1 (used sooner) and bypasses c; a child is never kept without its parent.
    hits = optimal_hits([["a0", "a1"], ["c"], ["a0", "a1"], ["c"]], [2, 1, 2, 1], 2)
    assert hits == [0, 0, 2, 0]
    # Capacity 1: keeping a1 alone would be useless (a0 is needed first); a0 stays.
    assert optimal_hits([["a0", "a1"], ["a0", "a1"]], [2, 2], 1) == [0, 1]
    # A block past the last-token cap is stored and hit by a longer prompt later.
    assert optimal_hits([["a0", "a1"], ["a0", "a1", "a2"]], [1, 2], 2) == [0, 2]


def test_bounds_are_ordered_on_random_traces() -> None:
    rng = random.Random(7)
    for _ in range(30):
        prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))]
                    for _ in range(4)]
        reqs = [CacheRequest(rng.choice(prefixes) + [rng.randrange(50)
                                                     for _ in range(rng.randrange(0, 6))],
                             output_tokens=rng.randrange(0, 6))
                for _ in range(rng.randrange(2, 25))]
        cap = rng.randrange(1, 12)
        bd = cache_bounds(reqs, block_size=2, capacity=cap, model=MODEL)
        assert bd.pooled_lru_saved <= bd.pooled_optimal_saved <= bd.unbounded_saved
        big = cache_bounds(reqs, block_size=2, capacity=10_000, model=MODEL)
        assert big.pooled_optimal_saved == big.unbounded_saved
